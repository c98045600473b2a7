"""The job schema's sections, one module per part of the job; `orchestrator.config.schema` puts them together as
`JobConfig`. Each is a typed dataclass with a doc line under each field (what `--help-config` lists)."""
