"""Each strategy's checkpoint format, an object (`orchestrator.checkpoint.checkpointer.Format`):

- `FullState` (DDP): every rank holds the whole model, so rank 0 writes it whole in `train_state.pt`
  (`orchestrator.checkpoint.files`);
- `DcpShards` (FSDP2): every rank writes its shards through torch.distributed.checkpoint
  (`orchestrator.checkpoint.sharded`), a collective.
"""

from contextlib import AbstractContextManager
from pathlib import Path

import torch
from torch import nn

from orchestrator.checkpoint import files
from orchestrator.checkpoint.checkpointer import Saved


class FullState:
    """DDP's checkpoint: the full state from rank 0, each rank its own part."""

    def __init__(self, rank: int):
        self.rank = rank

    def staged(self, saved: Saved, step: int) -> AbstractContextManager[Path]:
        return files.staged_checkpoint(self.rank, saved.shared, saved.own, step, facts=saved.facts)


class DcpShards:
    """FSDP2's checkpoint: every rank's shards of `model` and `optimizer` (DCP), the rest as under DDP."""

    def __init__(self, rank: int, world_size: int, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.rank, self.world_size, self.model, self.optimizer = rank, world_size, model, optimizer

    def staged(self, saved: Saved, step: int) -> AbstractContextManager[Path]:
        from orchestrator.checkpoint import sharded  # torch's DCP and DTensor take seconds to import: FSDP runs only

        return sharded.staged_sharded_checkpoint(self.rank, self.world_size, self.model, self.optimizer,
                                                 saved.shared, saved.own, step, saved.facts)
