"""How a run walks its data (`Layout`): world size, batch size, micro-batches per step, training samples, steps per
epoch, epochs, total steps, the schedule. The step arithmetic the driver (`orchestrator.runner.preflight`) and
each worker (`orchestrator.train.loop`) both do; a checkpoint records it (`orchestrator.checkpoint.resume`)."""

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

from omegaconf import OmegaConf

from orchestrator.config.workers import Workers, micro_batches


def steps_per_epoch(train_samples: int, world_size: int, batch_size: int, accumulate_steps: int,
                    max_steps_per_epoch: Optional[int], max_world_size: Optional[int] = None) -> int:
    """Optimizer steps in an epoch: each rank's shard (the tail that does not divide by the world size dropped)
    in batches (the last one partial), grouped by `accumulate_steps` (an incomplete group dropped), at most
    `max_steps_per_epoch`. Elastic (`max_world_size` given): the whole global batches (`batch_size x
    accumulate_steps x max_world_size`) in the epoch, whatever the world size."""
    if max_world_size is not None:
        steps = train_samples // (batch_size * accumulate_steps * max_world_size)
    else:
        steps = math.ceil((train_samples // world_size) / batch_size) // accumulate_steps
    return steps if max_steps_per_epoch is None else min(steps, max_steps_per_epoch)


def schedule_of(optim_cfg) -> dict[str, Any]:
    """What decides the learning-rate schedule besides the run's length."""
    return {"schedule": str(optim_cfg.schedule), "warmup_fraction": optim_cfg.warmup_fraction,
            "schedule_kwargs": OmegaConf.to_container(optim_cfg.schedule_kwargs, resolve=True)
            if OmegaConf.is_config(optim_cfg.schedule_kwargs) else dict(optim_cfg.schedule_kwargs)}


def depends_on_length(schedule: Mapping[str, Any]) -> bool:
    """Whether the schedule's learning rates depend on the run's total steps: all but a constant rate."""
    return schedule["schedule"] != "none" or schedule["warmup_fraction"] is not None


@dataclass(frozen=True)
class Layout:
    """How a run walks its data: what a position in it means."""

    world_size: int
    batch_size: int
    accumulate_steps: int
    """`run.accumulate_steps` (elastic: micro-batches of the global batch per `max_world_size` ranks)."""
    train_samples: int
    steps_per_epoch: int
    epochs: int
    total_steps: int
    schedule: dict[str, Any] = field(default_factory=dict, compare=False)
    max_world_size: Optional[int] = None
    """An elastic run's largest world size (its global batch is `batch_size x accumulate_steps x` it); None for a
    fixed one."""

    @classmethod
    def of(cls, cfg, train_samples: int, world_size: int, total_steps: Optional[int] = None,
           workers: Optional[Workers] = None) -> "Layout":
        """The job's layout on `world_size` ranks; `total_steps` defaults to a run from the start. `workers`: the
        job's, as built once (`orchestrator.config.job.Job.layout`); read from `cfg` when not given."""
        workers = workers or Workers.of(cfg.scaling)
        max_world_size = workers.max if workers.elastic else None
        per_epoch = steps_per_epoch(train_samples, world_size, cfg.run.batch_size, cfg.run.accumulate_steps,
                                    cfg.run.max_steps_per_epoch, max_world_size)
        return cls(world_size, cfg.run.batch_size, cfg.run.accumulate_steps, train_samples, per_epoch,
                   cfg.run.epochs, per_epoch * cfg.run.epochs if total_steps is None else total_steps,
                   schedule_of(cfg.optim), max_world_size)

    @property
    def micro_batches(self) -> int:
        """Micro-batches each rank trains per optimizer step."""
        if self.max_world_size is None:
            return self.accumulate_steps
        return micro_batches(self.accumulate_steps, self.max_world_size, self.world_size)

    @property
    def global_batch(self) -> Optional[int]:
        """Samples in an optimizer step over every rank, when every step has as many (elastic); else None (the
        epoch's last batch may be partial)."""
        return self.batch_size * self.accumulate_steps * self.max_world_size if self.max_world_size else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "Layout":
        return cls(**{key: values[key] for key in cls.__dataclass_fields__ if key in values})
