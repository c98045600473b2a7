"""`scaling.strategy: fsdp` as one object: everything the training step, the train state and the checkpoint code do
differently from DDP, behind the methods a DDP strategy has too (see docs/precision.md, "Under FSDP").

    strategy = FsdpStrategy(FsdpSettings.from_config(cfg.scaling, cfg.precision), device, rank, world_size)
    model, audit = strategy.wrap(model, policy)        # plan, cast, hooks, fully_shard; the audit of step 1
    optimizer = build_optimizer(cfg.optim, strategy.optimizer_params())
    with strategy.no_sync():                           # each non-final micro-step
        ...backward...
    outcome = guard.step(optimizer, loss, step, strategy.named_tensors, ...)

The training loop reaches it through `orchestrator.train.strategy` (`scaling.strategy: fsdp`), which gives DDP the same
methods: `prepare` (the build: `wrap` under the `Precision` object), `named_optimizer_params`, `load_weights` /
`load_state`, `checkpoint_state` / `snapshot_state` (what a checkpoint's train_state.pt holds, and what a rollback or
a promotion rebuilds from), `load_shards`.
"""

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar

import torch
from torch import nn

from orchestrator.config.job import Job
from orchestrator.config.strategies import FSDP
from orchestrator.precision import Precision
from orchestrator.precision.blocks import apply_blocks, compile_options
from orchestrator.precision.kept import check_attention_blocks
from orchestrator.precision.fsdp import FsdpAudit, FsdpPlan, FsdpSettings, plan_units, prepare
from orchestrator.precision.policy import LayerPlan, Policy, plan
from orchestrator.checkpoint import sharded as sharded_checkpoint
from orchestrator.checkpoint.checkpointer import Saved
from orchestrator.checkpoint.formats import DcpShards
from orchestrator.train import fsdp, fsdp_memory
from orchestrator.checkpoint.files import STATE_FILE, Candidate, CorruptCheckpoint
from orchestrator.train.collectives import all_agree
from orchestrator.checkpoint.state import TrainState

Built = TypeVar("Built")
"""What a resume builds from the state it found (`orchestrator.train.training.Training`)."""


class FsdpStrategy:
    choice = FSDP

    def __init__(self, settings: FsdpSettings, device: torch.device, rank: int, world_size: int,
                 compile_options: Optional[dict[str, Any]] = None):
        self.settings, self.device, self.rank, self.world_size = settings, device, rank, world_size
        self.compile_options = compile_options
        """torch.compile's arguments for the blocks a rule compiles (`perf.compile_backend`, `perf.compile_mode`)."""
        self.model: Optional[nn.Module] = None
        self.plans: dict[str, LayerPlan] = {}
        self.plan: Optional[FsdpPlan] = None

    @classmethod
    def from_config(cls, cfg: Any, device: torch.device, rank: int, world_size: int) -> "FsdpStrategy":
        return cls(FsdpSettings.from_config(cfg.scaling, cfg.precision), device, rank, world_size,
                   compile_options(cfg.perf))

    @classmethod
    def build(cls, cfg: Any, device: torch.device, rank: int, world_size: int, wrap: Any = None) -> "FsdpStrategy":
        """The job's FSDP for one build of the model (`wrap`, DDP's, is not used)."""
        return cls.from_config(cfg, device, rank, world_size)

    # -- before the build: pre-flight, resuming, the trained model ------------------------------------------------

    @staticmethod
    def check_plan(cfg: Any, model: nn.Module, batch: Any = None) -> None:
        """Pre-flight: the units and their policies can be planned on the CPU model (BadInput naming the rule, the
        `scaling.fsdp.wrap` glob or the model's `fsdp_units` entry that cannot be)."""
        policy = Job.of(cfg).policy
        plans = plan(model, policy)
        if batch is not None:  # a rule splitting an attention block fails under FSDP2's per-unit casts as under DDP
            check_attention_blocks(cfg, model, batch, policy, plans)
        plan_units(model, policy, plans, FsdpSettings.from_config(cfg.scaling, cfg.precision))

    @staticmethod
    def resume(candidates: Sequence[Candidate], rank: int, world_size: int, device: torch.device,
               build: Callable[[Optional[TrainState]], Built], agree: Callable[[bool], bool]
               ) -> tuple[Optional[TrainState], list[str], Built]:
        """The build comes first (the policy, and so the units, depend on the state's promoted layers), then the
        shards are loaded into it while the checkpoint is still open."""

        def read(directory: Path) -> TrainState:
            return TrainState.from_files(*sharded_checkpoint.read_rank_files(directory, rank))

        def use(directory: Path, state: TrainState) -> tuple[TrainState, Built]:
            training = build(state)
            training.strategy.load_shards(directory, training.optimizer)
            return state, training

        found, warnings = sharded_checkpoint.newest_valid_sharded(candidates, rank, world_size, read, use, agree)
        if found is None:
            return None, warnings, build(None)
        return found[0], warnings, found[1]

    @staticmethod
    def load_trained_weights(directory: Path, model: nn.Module) -> TrainState:
        """The weights in the shards, read whole (`read_full_model`: no process group, nothing unpickled); the train
        state without the model and optimizer, which its shards hold."""
        sharded_checkpoint.verify_sharded_checkpoint(directory, rank=0, world_size=1)  # every writer's files
        shared = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
        try:
            state = TrainState.from_files(shared, None)
        except ValueError as exc:
            raise CorruptCheckpoint(f"{directory.name}: {exc}") from None
        model.load_state_dict(sharded_checkpoint.read_full_model(directory, model))
        return state

    # -- the model ----------------------------------------------------------------------------------------

    def wrap(self, model: nn.Module, policy: Policy) -> tuple[nn.Module, FsdpAudit]:
        """Shard `model` (fp32, on the device, every rank's weights rank 0's) under `policy`; returns it with the
        audit of its first forward pass. Replaces `Precision.prepare` + DDP: no MasterWeights (the fp32 shards are
        the masters), the hooks of `policy.apply` without its parameter casts, the rules' activation checkpointing and
        compilation, then `fully_shard` per unit."""
        self.plans, self.plan = prepare(model, policy, self.settings, self.device.type)
        apply_blocks(model, self.plans, self.compile_options)  # checkpointing, compile, then fully_shard (torchtitan)
        self.model = fsdp.shard(model, self.plan, self.device)
        return self.model, FsdpAudit(model, policy, self.plans, self.plan)

    def prepare(self, model: nn.Module, precision: Precision) -> nn.Module:
        """The training build's step from an fp32 model (on the device, rank 0's weights on every rank) to the one
        the loop calls: `wrap` under `precision`'s policy, the audit and ledger handed to `precision`."""
        model, audit = self.wrap(model, precision.policy)
        precision.prepare_sharded(model, audit, self.named_tensors)
        return model

    def optimizer_params(self) -> Iterator[torch.Tensor]:
        """What the optimizer steps: this rank's shards (fp32 under master weights)."""
        return self.model.parameters()

    def named_optimizer_params(self) -> list[tuple[str, torch.Tensor]]:
        """The optimizer's tensors by parameter name (`optim.param_groups` match these names): the sharded
        parameters."""
        return list(self.model.named_parameters())

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

    def load_weights(self, model: nn.Module, state: TrainState) -> None:
        """Before `prepare`: nothing (a state's weights are shards, loaded into the sharded model by `load_state`)."""

    def load_state(self, optimizer: torch.optim.Optimizer, state: TrainState) -> None:
        """After the optimizer is built: a `snapshot_state`'s shards into the model and optimizer (a checkpoint's
        train state holds none: its shards are loaded by `load_shards`). The units may differ from the snapshot's
        (a promotion): each parameter is sharded the same way whatever its unit, so the shards load as they are."""
        if state.model:
            self.model.load_state_dict(state.model)
        if state.optimizer:
            optimizer.load_state_dict(state.optimizer)

    def checkpoint_state(self, precision: Precision, optimizer: torch.optim.Optimizer
                         ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model and optimizer in a checkpoint's train_state.pt: none (the shards go to `sharded/`, through
        `checkpoint_format`)."""
        return {}, {}

    def snapshot_state(self, precision: Precision, optimizer: torch.optim.Optimizer
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's shards of the model and its optimizer state (aliasing the live ones), for a rebuild in this
        process (`on_collapse`). The optimizer's own state dict, not torch.distributed's: that one would first step
        an optimizer without state."""
        return self.model.state_dict(), optimizer.state_dict()

    def load_shards(self, directory: Path, optimizer: torch.optim.Optimizer) -> None:
        """A verified sharded checkpoint's shards into the model and optimizer (a collective)."""
        sharded_checkpoint.load_shards(directory, self.model, optimizer)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 weights and buffers on rank 0's CPU ({} elsewhere): the logged model, export, a DDP resume."""
        return fsdp.full_state_dict(self.model)

    def load_full_state_dict(self, state: Optional[dict[str, torch.Tensor]]) -> None:
        fsdp.load_full_state_dict(self.model, state)

    def checkpoint_format(self, optimizer: torch.optim.Optimizer) -> "BufferedShards":
        """Every rank's shards (DCP, a collective), and `shared` and `facts` on rank 0, `own` on every rank."""
        return BufferedShards(self.rank, self.world_size, self.model, optimizer)

    def load_newest_valid(self, candidates: Sequence[Candidate], optimizer: torch.optim.Optimizer,
                          agree: Optional[Callable[[bool], bool]] = None):
        """The newest checkpoint valid on every rank, loaded into the model and optimizer: ((shared, own) or None,
        warnings). A collective."""
        return sharded_checkpoint.load_newest_valid_sharded(
            candidates, self.rank, self.world_size, self.model, optimizer,
            agree or (lambda ok: all_agree(ok, self.device)))

    # -- memory ----------------------------------------------------------------------------------------------

    def memory(self, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, dict[str, int]]:
        """This rank's bytes of parameters, gradients and optimizer state (`memory/<category>_<dtype>_bytes`)."""
        return fsdp_memory.rank_bytes(self.model, optimizer)


class BufferedShards(DcpShards):
    """`DcpShards` with rank 0's buffers on every rank first (as the next forward would make them), so whichever
    rank's copy DCP keeps, it is rank 0's."""

    def staged(self, saved: Saved, step: int) -> AbstractContextManager[Path]:
        fsdp.broadcast_buffers(self.model)
        return super().staged(saved, step)
