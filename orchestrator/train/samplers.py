"""The orders a rank walks: its share of each epoch of the training set, and of the eval set.

- `ResumableSampler` (a fixed number of workers): torch's `DistributedSampler` that can start an epoch part-way.
- `ElasticSampler` (`scaling.num_workers: [min, max]`): the same steps on any number of ranks. Each epoch is one
  permutation of the training set, seeded by (seed, epoch) as `DistributedSampler`'s is. Step s of the epoch is the
  block `[s x G, (s + 1) x G)` of it, G being the global batch (`run.batch_size x run.accumulate_steps x max`),
  whatever the world size W: the block is cut into W x k micro-batches as even as can be (k =
  `micro_batches(W)`, sizes differing by at most one sample), and rank r trains the r-th run of k of them. So a
  run that resizes mid-epoch and goes on from a checkpoint of step s trains exactly the samples of steps s + 1
  onwards, each once: the epoch still sees every sample of its whole global batches once (the tail short of one,
  a different few samples each epoch, is left out). Every rank runs k forward and backward passes a step, so
  collectives inside them (FSDP's all-gathers, DDP's buffer broadcast) stay paired.
- `ShardSampler`: evaluation's share, every sample exactly once over all ranks.
"""

import itertools
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler

from orchestrator.config.workers import micro_batches


class ElasticSampler(Sampler[list[int]]):
    """Rank `rank` of `world_size`'s micro-batches (lists of indices), k per step (a batch sampler)."""

    def __init__(self, dataset: Dataset, *, rank: int, world_size: int, seed: int, batch_size: int,
                 accumulate_steps: int, max_world_size: int):
        self.dataset, self.rank, self.world_size, self.seed = dataset, rank, world_size, seed
        self.global_batch = batch_size * accumulate_steps * max_world_size
        self.per_rank = micro_batches(accumulate_steps, max_world_size, world_size)
        self.steps = len(dataset) // self.global_batch
        self.epoch, self.start = 0, 0

    def set_position(self, epoch: int, batches_done: int, batch_size: int) -> None:
        """The epoch, and how many of this rank's micro-batches of it were already trained on (whole steps)."""
        self.epoch, self.start = epoch, min(batches_done // self.per_rank, self.steps)

    def sizes(self) -> list[int]:
        """Each micro-batch's size in a step, over all ranks in order (rank r's are the r-th run of `per_rank`)."""
        parts = self.world_size * self.per_rank
        small, larger = divmod(self.global_batch, parts)
        return [small + (1 if index < larger else 0) for index in range(parts)]

    def step_indices(self, order: torch.Tensor, step: int) -> list[list[int]]:
        """This rank's micro-batches of step `step` (from 0) of the epoch whose permutation is `order`."""
        block = order[step * self.global_batch:(step + 1) * self.global_batch]
        parts = torch.split(block, self.sizes())
        return [part.tolist() for part in parts[self.rank * self.per_rank:(self.rank + 1) * self.per_rank]]

    def order(self) -> torch.Tensor:
        """The epoch's permutation of the training set."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator)

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order()
        for step in range(self.start, self.steps):
            yield from self.step_indices(order, step)

    def __len__(self) -> int:
        return (self.steps - self.start) * self.per_rank


class ShardSampler(Sampler[int]):
    """Rank r of w gets indices r, r+w, r+2w, ...: every sample exactly once over all ranks.

    Used for evaluation, where DistributedSampler's padding would count some samples twice.
    """

    def __init__(self, length: int, rank: int, world_size: int):
        self.indices = range(rank, length, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way, after the batches a checkpoint already saw.

    The order of an epoch depends only on (seed, epoch), so skipping the first `start` indices
    of it gives exactly the batches the interrupted run would have trained on next.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start = 0

    def set_position(self, epoch: int, batches_done: int, batch_size: int) -> None:
        self.set_epoch(epoch)
        self.start = min(batches_done * batch_size, self.num_samples)

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.start, None)

    def __len__(self) -> int:
        return self.num_samples - self.start


@dataclass(frozen=True)
class Elastic:
    """An elastic run's global batch: `batch_size x accumulate_steps x max_world_size` samples a step."""

    accumulate_steps: int
    max_world_size: int


def train_shard(train: Dataset, rank: int, world_size: int, seed: int, batch_size: int = 1,
                elastic: Optional[Elastic] = None) -> Union[ResumableSampler, ElasticSampler]:
    """Rank `rank`'s share of each epoch's shuffled order. The tail that does not divide by the world size
    is dropped (a different few samples each epoch), so no sample is trained on twice in an epoch. `elastic`:
    the same steps on any world size (`ElasticSampler`), as micro-batches of indices."""
    if elastic is not None:
        return ElasticSampler(train, rank=rank, world_size=world_size, seed=seed, batch_size=batch_size,
                              accumulate_steps=elastic.accumulate_steps, max_world_size=elastic.max_world_size)
    return ResumableSampler(train, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
