"""Job configuration: typed schema, layered loading, validation."""

from orchestrator.config.loader import flatten, load_job, to_yaml
from orchestrator.config.schema import JobConfig

__all__ = ["JobConfig", "flatten", "load_job", "to_yaml"]
