"""`scaling.strategy: fsdp` as one object: everything the training step, the train state and the checkpoint code do
differently from DDP, behind the methods a DDP strategy has too (see docs/precision.md, "Under FSDP").

    strategy = FsdpStrategy(FsdpSettings.from_config(cfg.scaling, cfg.precision), device, rank, world_size)
    model, audit = strategy.wrap(model, policy)        # plan, cast, hooks, fully_shard; the audit of step 1
    optimizer = build_optimizer(cfg.optim, strategy.optimizer_params())
    with strategy.no_sync():                           # each non-final micro-step
        ...backward...
    outcome = guard.step(optimizer, loss, step, strategy.named_tensors, ...)
"""

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from orchestrator.precision.fsdp import FsdpAudit, FsdpPlan, FsdpSettings, prepare
from orchestrator.precision.policy import LayerPlan, Policy
from orchestrator.train import fsdp, fsdp_memory, sharded_checkpoint
from orchestrator.train.checkpoint import Candidate


class FsdpStrategy:
    name = "fsdp"

    def __init__(self, settings: FsdpSettings, device: torch.device, rank: int, world_size: int):
        self.settings, self.device, self.rank, self.world_size = settings, device, rank, world_size
        self.model: Optional[nn.Module] = None
        self.plans: dict[str, LayerPlan] = {}
        self.plan: Optional[FsdpPlan] = None

    # -- the model ----------------------------------------------------------------------------------------

    def wrap(self, model: nn.Module, policy: Policy) -> tuple[nn.Module, FsdpAudit]:
        """Shard `model` (fp32, on the device, every rank's weights rank 0's) under `policy`; returns it with the
        audit of its first forward pass. Replaces `Precision.prepare` + DDP: no MasterWeights (the fp32 shards are
        the masters), the hooks of `policy.apply` without its parameter casts, then `fully_shard` per unit."""
        self.plans, self.plan = prepare(model, policy, self.settings, self.device.type)
        self.model = fsdp.shard(model, self.plan, self.device)
        return self.model, FsdpAudit(model, policy, self.plans, self.plan)

    def optimizer_params(self) -> Iterator[torch.Tensor]:
        """What the optimizer steps: this rank's shards (fp32 under master weights)."""
        return self.model.parameters()

    @property
    def named_tensors(self) -> fsdp.LocalShards:
        """The optimizer's tensors by name with this rank's gradient shards (`GuardedScaler.step`, fault drills)."""
        return fsdp.LocalShards(self.model)

    # -- the step -----------------------------------------------------------------------------------------

    def no_sync(self) -> AbstractContextManager:
        """Around a non-final micro-step's forward and backward: nothing is reduced."""
        return fsdp.no_sync(self.model)

    def clip(self, optimizer: torch.optim.Optimizer, max_norm: Optional[float]) -> Optional[torch.Tensor]:
        """Clip to the total norm over all shards; the norm before clipping (a plain tensor, equal on every rank)."""
        return fsdp.clip_grad_norm((p for group in optimizer.param_groups for p in group["params"]), max_norm)

    # -- state ----------------------------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 weights and buffers on rank 0's CPU ({} elsewhere): the logged model, export, a DDP resume."""
        return fsdp.full_state_dict(self.model)

    def load_full_state_dict(self, state: Optional[dict[str, torch.Tensor]]) -> None:
        fsdp.load_full_state_dict(self.model, state)

    def staged_checkpoint(self, optimizer: torch.optim.Optimizer, shared: Optional[dict[str, Any]],
                          own: dict[str, Any], step: int) -> AbstractContextManager[Path]:
        """This rank's part of a checkpoint (the shards, and `shared` on rank 0, `own` on every rank) in a staging
        directory to report. A collective."""
        return sharded_checkpoint.staged_sharded_checkpoint(self.rank, self.world_size, self.model, optimizer,
                                                            shared, own, step)

    def load_newest_valid(self, candidates: Sequence[Candidate], optimizer: torch.optim.Optimizer,
                          agree: Optional[Callable[[bool], bool]] = None):
        """The newest checkpoint valid on every rank, loaded into the model and optimizer: ((shared, own) or None,
        warnings). A collective."""
        return sharded_checkpoint.load_newest_valid_sharded(
            candidates, self.rank, self.world_size, self.model, optimizer,
            agree or (lambda ok: sharded_checkpoint.all_ranks_agree(ok, self.device)))

    # -- memory ----------------------------------------------------------------------------------------------

    def memory(self, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, dict[str, int]]:
        """This rank's bytes of parameters, gradients and optimizer state (`memory/<category>/<dtype>`)."""
        return fsdp_memory.rank_bytes(self.model, optimizer)
