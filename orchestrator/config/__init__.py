"""Job configuration: typed schema, layered loading, validation."""

from orchestrator.config.schema import JobConfig

__all__ = ["JobConfig", "flatten", "load_job", "to_yaml"]


def __getattr__(name: str):
    # The loader on first use: it validates optimizers and precision policies (torch, seconds), which the
    # schema and the config reference of `--help` never need.
    if name in ("flatten", "load_job", "to_yaml"):
        from orchestrator.config import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'orchestrator.config' has no attribute {name!r}")
