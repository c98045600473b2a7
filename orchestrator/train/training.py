"""What one training step mutates, built together and captured together.

`build_training()` turns a job config and (optionally) a `TrainState` into the model under its
precision, spread over the ranks by the job's strategy (`scaling.strategy`, `orchestrator.train.strategy`:
DDP or FSDP), the optimizer, the LR schedule and the `Precision` object.
`Training.capture()` turns them back into a `TrainState` (a checkpoint's train_state.pt), `Training.snapshot()`
into one to rebuild from in this process. Resume, rollback and promotion are all "capture (or load) a state,
then build from it".
"""

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from orchestrator.config.job import Job
from orchestrator.precision import Precision
from orchestrator.precision.finite import first_nonfinite_tensor, named_tensors
from orchestrator.precision.ledger import param_bytes_by_dtype
from orchestrator.train import cuda_defaults, task
from orchestrator.train.batch import Batch
from orchestrator.precision.shards import local
from orchestrator.train.models import build_model
from orchestrator.common.modes import freeze_norm, train_mode
from orchestrator.train.ddp import Wrap
from orchestrator.train.optim import build_optimizer, build_scheduler, should_step_schedule
from orchestrator.checkpoint.resume import IncompatibleResume, model_mismatch
from orchestrator.checkpoint.state import TrainState
from orchestrator.train.strategy import Strategy, make_strategy


@torch.no_grad()
def broadcast_from_rank0(model: nn.Module) -> None:
    """Give every rank rank 0's fp32 parameters and buffers.

    DDP broadcasts rank 0's state when it wraps the model, but by then a half-precision policy has
    cast the parameters and each rank has captured fp32 masters from its own initialisation: the
    ranks' masters would differ and the ranks drift apart. So the broadcast happens here, in fp32,
    before masters are taken.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)


@dataclass
class PreparedModel:
    model: nn.Module
    """What the loop calls: DDP-wrapped when there are several workers, or sharded (FSDP)."""
    raw: nn.Module
    """The model inside DDP (the sharded model itself under FSDP)."""
    params_bytes: int
    """Bytes of the parameters as stored under the policy (this rank's shards under FSDP)."""
    memory_format: torch.memory_format = torch.contiguous_format
    """What 4-D floating inputs are converted to before the forward pass (`perf.channels_last`)."""
    compile_options: Optional[dict[str, Any]] = None
    """torch.compile arguments still to apply (`perf.compile`); None once compiled, or when not asked."""

    def compile_when(self, audited: bool) -> None:
        """Compile once the first step's audit has closed: the audited step runs eagerly with its hooks, and the
        compiled graph never sees them (no recompilation when they are removed)."""
        if self.compile_options is not None and audited:
            self.model = torch.compile(self.model, **self.compile_options)
            self.compile_options = None

    def place(self, batch: Batch, device: torch.device) -> Batch:
        """The batch on the device (every dtype kept), 4-D floating inputs in the model's memory format."""
        return batch.to(device, self.memory_format)


@dataclass
class Training:
    prepared: PreparedModel
    optimizer: torch.optim.Optimizer
    scheduler: Optional[torch.optim.lr_scheduler.LRScheduler]
    precision: Precision
    promoted: list[str] = field(default_factory=list)
    """Layers moved to fp32 at run time (`on_collapse: promote`), part of the effective policy."""
    clip_grad_norm: Optional[float] = None
    """`optim.clip_grad_norm`: the total gradient norm each step is clipped to (None: no clipping)."""
    loss: Optional[Callable[[Any, Any], torch.Tensor]] = None
    """`task.loss`: (outputs, targets) -> the batch's mean loss, in fp32."""
    metrics: list[Any] = field(default_factory=list)
    """`task.metrics`: `task.SummedMetric`s and `task.TorchMetric`s, updated with each eval batch."""
    strategy: Optional[Strategy] = None
    """How the model is spread over the ranks (`scaling.strategy`): the step, checkpoints and the full weights go
    through it."""

    def capture(self) -> TrainState:
        """The train state of the model, optimizer, schedule and loss scaler (not yet placed in the run), as a
        checkpoint's train_state.pt holds it: under FSDP without the model and optimizer (their shards are written
        beside it). Needs no other rank.

        Tensors may alias live ones (optimizer state): serialise it, or `.detached()` it.
        """
        return self._state(*self.strategy.checkpoint_state(self.precision, self.optimizer))

    def snapshot(self) -> TrainState:
        """The train state to rebuild from in this process (`on_collapse: rollback | promote`): under FSDP with this
        rank's shards of the model and optimizer. Tensors alias live ones: `.detached()` it to keep it."""
        return self._state(*self.strategy.snapshot_state(self.precision, self.optimizer))

    def _state(self, model: dict[str, Any], optimizer: dict[str, Any]) -> TrainState:
        scaling = self.precision.state_dict()  # first: every step's flags read, the schedule stepped for them
        return TrainState(model=model, optimizer=optimizer,
                          scheduler=self.scheduler.state_dict() if self.scheduler is not None else {},
                          scaler=scaling["scaler"], counters=scaling["counters"], promoted=list(self.promoted))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights in fp32 on the CPU (the logged model's): under FSDP gathered to rank 0 (a
        collective: every rank calls it; the others get {})."""
        return self.strategy.full_state_dict()

    def model_shapes(self) -> dict[str, list[int]]:
        """The whole model's state-dict shapes (under FSDP the unsharded ones), as a checkpoint's facts record them."""
        return {name: list(tensor.shape) for name, tensor in self.prepared.raw.state_dict().items()}

    def first_nonfinite(self) -> Optional[str]:
        """What a checkpoint would hold that is not finite on this rank (the model's parameters and buffers as
        stored, the fp32 masters, the optimizer's state; under FSDP this rank's shards of them), described; None
        when all of it is finite. Checked on the device, read in one host transfer."""
        model = self.prepared.raw
        masters = self.precision.named_tensors if self.precision.masters else []
        optimizer_state = ((f"optimizer {key} of {name}", value)
                           for name, tensor in self.strategy.named_optimizer_params()
                           for key, value in self.optimizer.state.get(tensor, {}).items())
        return first_nonfinite_tensor((name, local(tensor)) for name, tensor in itertools.chain(
            named_tensors(model.state_dict()), ((f"{name} (fp32 master)", t) for name, t in masters),
            ((name, t) for name, value in optimizer_state for name, t in named_tensors(value, name))))


def build_training(cfg, device: torch.device, *, rank: int = 0, world_size: int = 1, total_steps: int,
                   state: Optional[TrainState] = None, wrap: Optional[Wrap] = None) -> Training:
    """Build everything a step needs and load `state` into it (after a restart: its fp32 weights under DDP, its
    shards under FSDP). The model is moved to the device, given rank 0's weights, then prepared by the job's
    strategy: under DDP cast by its precision and only then wrapped by `wrap` (default: `ddp_wrap(cfg)`); under
    FSDP planned into units and sharded (`wrap` is not used)."""
    promoted = list(state.promoted) if state is not None else []
    precision = Precision(cfg.precision, device, rank=rank, world_size=world_size, promoted=promoted,
                          policy=Job.of(cfg).policy)
    strategy = make_strategy(cfg, device, rank, world_size, wrap)
    model = build_model(cfg.model)
    if state is not None:
        mismatch = model_mismatch({k: list(v.shape) for k, v in state.model.items()},
                                  {k: list(v.shape) for k, v in model.state_dict().items()}) if state.model else None
        if mismatch:  # under FSDP a checkpoint's train state holds no weights: its shards are checked as they load
            raise IncompatibleResume(f"model: {mismatch} (model.name={cfg.model.name}): the checkpoint was trained "
                                     "with another model. Set the model back, or start a new run without --resume.")
        strategy.load_weights(model, state)
    memory_format = torch.channels_last if cuda_defaults.channels_last(cfg, model, device) else torch.contiguous_format
    cuda_defaults.set_cudnn_benchmark(cfg, device)
    train_mode(model)  # the model's own train() runs (an override keeping norms in eval); frozen modules stay so
    if cfg.run.freeze_norm:  # at every (re)build: a resumed or rolled-back run stays frozen too
        freeze_norm(model)
    model.to(device, memory_format=memory_format)  # before masters: their copies keep the layout
    broadcast_from_rank0(model)
    wrapped = strategy.prepare(model, precision)
    compile_options = {"backend": cfg.perf.compile_backend, "mode": cfg.perf.compile_mode} if cfg.perf.compile else None
    prepared = PreparedModel(wrapped, model, sum(param_bytes_by_dtype(model).values()), memory_format, compile_options)
    # Grouped by name: masters (DDP) and shards (FSDP) follow their parameter's group.
    optimizer = build_optimizer(cfg.optim, strategy.named_optimizer_params(), model,
                                fused=cuda_defaults.fused_optimizer(cfg, device))
    scheduler = build_scheduler(cfg.optim, optimizer, total_steps)
    if state is not None:
        strategy.load_state(optimizer, state)
        if scheduler is not None and state.scheduler:
            scheduler.load_state_dict(state.scheduler)
        precision.load_state_dict(state.scaler, state.counters)
    if scheduler is not None:  # once per step taken, as soon as the host knows it was (before the next step's update)
        precision.guard.on_settled.append(lambda outcome: scheduler.step() if should_step_schedule(outcome) else None)
    return Training(prepared, optimizer, scheduler, precision, promoted, cfg.optim.clip_grad_norm,
                    task.build_loss(cfg.task), task.build_metrics(cfg.task), strategy)
