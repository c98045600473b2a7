"""What one training step mutates, built together and captured together.

`build_training()` turns a job config and (optionally) a `TrainState` into the model under its
precision (wrapped for data parallelism, `orchestrator.train.ddp`), the optimizer, the LR schedule and the
`Precision` object.
`Training.capture()` turns them back into a `TrainState`. Resume, rollback and promotion are all
"capture (or load) a state, then build from it".
"""

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from orchestrator.precision import Precision
from orchestrator.precision.finite import first_nonfinite_tensor, named_tensors
from orchestrator.precision.ledger import param_bytes_by_dtype
from orchestrator.train import task
from orchestrator.train.batch import Batch
from orchestrator.train.models import build_model
from orchestrator.train.modes import freeze_norm, train_mode
from orchestrator.train.ddp import Wrap, ddp_wrap
from orchestrator.train.optim import build_optimizer, build_scheduler
from orchestrator.train.resume import IncompatibleResume, model_mismatch
from orchestrator.train.state import TrainState



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
    """What the loop calls: DDP-wrapped when there are several workers."""
    raw: nn.Module
    """The model inside DDP (for state dicts)."""
    params_bytes: int
    """Bytes of the parameters as stored under the policy."""
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

    def capture(self) -> TrainState:
        """The train state of the model, optimizer, schedule and loss scaler (not yet placed in the run).

        Tensors may alias live ones (optimizer state): serialise it, or `.detached()` it.
        """
        scaling = self.precision.state_dict()
        return TrainState(model=self.precision.fp32_state_dict(), optimizer=self.optimizer.state_dict(),
                          scheduler=self.scheduler.state_dict() if self.scheduler is not None else {},
                          scaler=scaling["scaler"], counters=scaling["counters"], promoted=list(self.promoted))

    def first_nonfinite(self) -> Optional[str]:
        """What a checkpoint would hold that is not finite on this rank (the model's parameters and buffers as
        stored, the fp32 masters, the optimizer's state), described; None when all of it is finite. Checked on
        the device, read in one host transfer."""
        model = self.prepared.raw
        masters = self.precision.named_tensors if self.precision.masters else []
        optimizer_state = ((f"optimizer {key} of {name}", value) for name, tensor in self.precision.named_tensors
                           for key, value in self.optimizer.state.get(tensor, {}).items())
        return first_nonfinite_tensor(itertools.chain(
            named_tensors(model.state_dict()), ((f"{name} (fp32 master)", t) for name, t in masters),
            ((name, t) for name, value in optimizer_state for name, t in named_tensors(value, name))))


def build_training(cfg, device: torch.device, *, rank: int = 0, world_size: int = 1, total_steps: int,
                   state: Optional[TrainState] = None, wrap: Optional[Wrap] = None) -> Training:
    """Build everything a step needs from fp32 weights (the state's, after a restart) and load the rest of
    `state` into it. The model is moved to the device, given rank 0's weights, cast by its precision, and
    only then wrapped by `wrap` (default: `ddp_wrap(cfg)`)."""
    promoted = list(state.promoted) if state is not None else []
    precision = Precision(cfg.precision, device, rank=rank, world_size=world_size, promoted=promoted)
    model = build_model(cfg.model)
    if state is not None:
        mismatch = model_mismatch({k: list(v.shape) for k, v in state.model.items()},
                                  {k: list(v.shape) for k, v in model.state_dict().items()})
        if mismatch:
            raise IncompatibleResume(f"model: {mismatch} (model.name={cfg.model.name}): the checkpoint was trained "
                                     "with another model. Set the model back, or start a new run without --resume.")
        model.load_state_dict(state.model)
    memory_format = torch.channels_last if cfg.perf.channels_last else torch.contiguous_format
    train_mode(model)  # the model's own train() runs (an override keeping norms in eval); frozen modules stay so
    if cfg.run.freeze_norm:  # at every (re)build: a resumed or rolled-back run stays frozen too
        freeze_norm(model)
    model.to(device, memory_format=memory_format)  # before masters: their copies keep the layout
    broadcast_from_rank0(model)
    precision.prepare(model)
    compile_options = {"backend": cfg.perf.compile_backend, "mode": cfg.perf.compile_mode} if cfg.perf.compile else None
    prepared = PreparedModel((wrap or ddp_wrap(cfg))(model), model, sum(param_bytes_by_dtype(model).values()),
                             memory_format, compile_options)
    optimizer = build_optimizer(cfg.optim, precision.named_tensors, model)  # grouped by name: masters follow
    scheduler = build_scheduler(cfg.optim, optimizer, total_steps)
    if state is not None:
        optimizer.load_state_dict(state.optimizer)
        if scheduler is not None and state.scheduler:
            scheduler.load_state_dict(state.scheduler)
        precision.load_state_dict(state.scaler, state.counters)
    return Training(prepared, optimizer, scheduler, precision, promoted, cfg.optim.clip_grad_norm,
                    task.build_loss(cfg.task), task.build_metrics(cfg.task))
