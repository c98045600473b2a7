"""What `scaling.num_workers` says: a fixed number of workers, or an elastic range `[min, max]`.

An elastic run keeps its global batch whatever the number of workers W: a step is `run.batch_size x
run.accumulate_steps x max` samples, split over the W ranks in `micro_batches(W)` micro-batches each
(`orchestrator.train.samplers.ElasticSampler`); see docs/deploy.md, "Elastic runs", for why.
"""

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

from omegaconf import ListConfig


@dataclass(frozen=True)
class Workers:
    min: int
    max: int
    elastic: bool

    @classmethod
    def of(cls, scaling: Any) -> "Workers":
        """The count of a `scaling` section (or a bare `num_workers` value), checked by `problem` first."""
        value = scaling.num_workers if hasattr(scaling, "num_workers") else scaling
        if isinstance(value, (list, tuple, ListConfig)):
            low, high = (int(v) for v in value)
            return cls(low, high, True)
        return cls(int(value), int(value), False)

    def for_ray(self) -> Union[int, tuple[int, int]]:
        """Ray Train's `ScalingConfig(num_workers=...)`: an int, or `(min, max)` for elastic scaling."""
        return (self.min, self.max) if self.elastic else self.max

    def __str__(self) -> str:
        return f"[{self.min}, {self.max}]" if self.elastic else str(self.max)

    def micro_batches(self, accumulate_steps: int, world_size: int) -> int:
        """Micro-batches each of `world_size` ranks trains per optimizer step: `accumulate_steps` for a fixed count,
        else `micro_batches(accumulate_steps, max, world_size)`."""
        return micro_batches(accumulate_steps, self.max, world_size) if self.elastic else accumulate_steps


def micro_batches(accumulate_steps: int, max_world_size: int, world_size: int) -> int:
    """An elastic run's micro-batches per rank and step on `world_size` ranks: the `accumulate_steps x max` of the
    global batch shared out, rounded up (the samples are then spread evenly over them: every rank runs as many
    forward and backward passes)."""
    return math.ceil(accumulate_steps * max_world_size / world_size)


MAX_WORKERS = 100_000
"""The most workers `scaling.num_workers` may ask for (a number, or an elastic range's max): more than the largest
clusters hold, and a bound that keeps every check of the count quick."""


def problem(value: Any, batch_size: int, accumulate_steps: int) -> Optional[str]:
    """What is wrong with a `scaling.num_workers` value, or None. Takes the same time whatever the numbers."""
    if isinstance(value, (list, tuple, ListConfig)):
        if len(value) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            shown = list(value) if len(value) <= 10 else f"a list of {len(value)} values"
            return f"an elastic range is two whole numbers [min, max], got {shown}."
        low, high = value
        if not 1 <= low <= high:
            return f"an elastic range [min, max] needs 1 <= min <= max, got [{low}, {high}]."
        if high > MAX_WORKERS:
            return f"an elastic range's max is at most {MAX_WORKERS:,} workers, got [{low}, {high}]."
        if batch_size < 1 or accumulate_steps < 1:
            return None  # their own checks say so
        world_size = uneven_world_size(low, high, batch_size, accumulate_steps)
        if world_size is not None:
            global_batch = batch_size * accumulate_steps * high
            each = micro_batches(accumulate_steps, high, world_size)
            return (f"with {world_size} workers the global batch of {global_batch} samples (run.batch_size x "
                    f"run.accumulate_steps x {high}) cannot give each rank {each} non-empty micro-batches. Raise "
                    "run.batch_size to 2 or more, or use a range whose every count divides "
                    f"run.accumulate_steps x {high}.")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        return f"a number of workers, or an elastic range [min, max], got {value!r}."
    if value < 1:
        return f"must be >= 1, got {value}."
    if value > MAX_WORKERS:
        return f"must be at most {MAX_WORKERS:,} workers, got {value}."
    return None


def uneven_world_size(low: int, high: int, batch_size: int, accumulate_steps: int) -> Optional[int]:
    """The fewest workers W of the range [low, high] whose ranks cannot each have `micro_batches(W)` non-empty
    micro-batches out of the global batch (`batch_size x accumulate_steps x high` samples), or None.

    W ranks train W x ceil(A x high / W) < A x high + W <= 2 x A x high micro-batches (A: accumulate_steps): with
    two samples or more a micro-batch, every W fits. With one, W must divide A x high; counts from `low` up that
    all divide it have a least common multiple that divides it too, and k consecutive numbers hold a multiple of
    each of 1..k, so their lcm is at least lcm(1..k) >= 2^(k-1): the search below stops within log2(A x high) + 2
    counts, however large the range."""
    if batch_size >= 2:
        return None
    samples = accumulate_steps * high
    for world_size in range(low, high + 1):
        if samples % world_size:
            return world_size
    return None
