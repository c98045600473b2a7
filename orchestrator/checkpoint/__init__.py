"""A run's checkpoints: the train state (`state`), its files with their manifests and hashes (`files`, DDP's full
state; `sharded`, FSDP2's DCP shards), the facts a resume is checked against (`resume`) and the checkpoints in
storage (`stored`). No Ray, no MLflow, nothing of the training loop: `orchestrator.train` and
`orchestrator.runner` both use it."""
