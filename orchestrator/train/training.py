"""What one training step mutates, built together and captured together.

`build_training()` turns a job config and (optionally) a train state into the model under its
precision policy (DDP-wrapped), the optimizer, the LR schedule and the guarded GradScaler.
`Training.capture()` turns them back into a train state of plain tensors and numbers. Resume,
rollback and promotion are all "capture (or load) a state, then build from it".
"""

from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from orchestrator import precision
from orchestrator.train.memory import MemoryLedger, param_bytes_by_dtype
from orchestrator.train.models import build_model
from orchestrator.train.optim import build_optimizer, build_scheduler
from orchestrator.precision import AmpSettings, GuardedScaler, MasterWeights
from orchestrator.precision.masters import fp32_state_dict


def require_bf16_support(policy: precision.Policy, device: torch.device) -> None:
    uses_bf16 = torch.bfloat16 in (policy.compute_dtype, policy.param_dtype) or any(
        rule.dtype == torch.bfloat16 for rule in policy.rules)
    if uses_bf16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise RuntimeError(f"precision: bfloat16 asked, but {torch.cuda.get_device_name(device)} has no bfloat16 "
                           "support. Use preset O1 or O2 (float16 with loss scaling).")


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
    masters: Optional[MasterWeights]
    audit: Optional[precision.Audit]
    """Records the first step's output dtypes; closed (and set to None) by the loop."""
    params_bytes: int
    """Bytes of the parameters as stored under the policy."""
    memory_format: torch.memory_format = torch.contiguous_format
    """What 4-D inputs are converted to before the forward pass (`perf.channels_last`)."""
    compile_options: Optional[dict[str, Any]] = None
    """torch.compile arguments still to apply (`perf.compile`); None once compiled, or when not asked."""

    def compile_when_audited(self) -> None:
        """Compile once the first step's audit has closed: the audited step runs eagerly with its hooks, and the
        compiled graph never sees them (no recompilation when they are removed)."""
        if self.compile_options is not None and self.audit is None:
            self.model = torch.compile(self.model, **self.compile_options)
            self.compile_options = None

    def inputs(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A batch of inputs on the device, in the model's memory format."""
        tensor = tensor.to(device, non_blocking=True)
        if tensor.dim() == 4 and self.memory_format != torch.contiguous_format:
            tensor = tensor.contiguous(memory_format=self.memory_format)
        return tensor

    def optimizer_params(self) -> Iterator[torch.Tensor]:
        return self.masters.optimizer_params(self.raw) if self.masters else self.raw.parameters()

    def named_optimizer_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors the optimizer steps, by the name of the parameter they stand for."""
        names = [name for name, _ in self.raw.named_parameters()]
        return list(zip(names, self.optimizer_params()))

    def fp32_state_dict(self) -> dict[str, torch.Tensor]:
        return self.masters.fp32_state_dict(self.raw) if self.masters else fp32_state_dict(self.raw)


def prepare_model(cfg, device: torch.device, weights: Optional[dict] = None, promoted: Sequence[str] = (),
                  ddp: bool = True) -> PreparedModel:
    """Build the model with fp32 `weights` (after a restart), move it to the device, take rank 0's
    fp32 state, capture fp32 masters, cast layers per the precision policy (with the `promoted`
    layers in fp32), and only then let Ray Train wrap it in DDP."""
    policy = precision.Policy.from_config(cfg.precision).with_promoted(promoted)
    require_bf16_support(policy, device)
    model = build_model(cfg.model)
    if weights is not None:
        model.load_state_dict(weights)
    memory_format = torch.channels_last if cfg.perf.channels_last else torch.contiguous_format
    model.to(device, memory_format=memory_format)  # before masters: their copies keep the layout
    broadcast_from_rank0(model)
    plans = precision.plan(model, policy)
    masters = MasterWeights(model, plans) if policy.master_weights else None
    precision.apply(model, policy, plans, device.type)
    params_bytes = sum(param_bytes_by_dtype(model).values())
    audit = precision.Audit(model, policy, plans)
    wrapped = model
    if ddp:
        import ray.train.torch

        wrapped = ray.train.torch.prepare_model(model, parallel_strategy_kwargs=ddp_kwargs(cfg.ddp))
        register_comm_hook(wrapped, cfg.ddp.comm_hook)
    compile_options = {"backend": cfg.perf.compile_backend, "mode": cfg.perf.compile_mode} if cfg.perf.compile else None
    return PreparedModel(wrapped, model, masters, audit, params_bytes, memory_format, compile_options)


def ddp_kwargs(ddp_cfg) -> dict[str, Any]:
    """The `ddp` section as DistributedDataParallel arguments."""
    return {"bucket_cap_mb": ddp_cfg.bucket_cap_mb, "gradient_as_bucket_view": ddp_cfg.gradient_as_bucket_view,
            "static_graph": ddp_cfg.static_graph, "find_unused_parameters": ddp_cfg.find_unused_parameters}


def register_comm_hook(model: nn.Module, hook: str) -> None:
    """`ddp.comm_hook`: compress gradients to fp16/bf16 for the all-reduce (a no-op without DDP)."""
    if hook == "none" or not isinstance(model, nn.parallel.DistributedDataParallel):
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    compress = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[hook]
    model.register_comm_hook(state=None, hook=compress)


@dataclass
class Training:
    prepared: PreparedModel
    optimizer: torch.optim.Optimizer
    scheduler: Optional[torch.optim.lr_scheduler.LRScheduler]
    guard: GuardedScaler
    ledger: MemoryLedger
    promoted: list[str] = field(default_factory=list)
    """Layers moved to fp32 at run time (`on_collapse: promote`), part of the effective policy."""

    def __post_init__(self) -> None:
        self.named_tensors = self.prepared.named_optimizer_tensors()

    def capture(self) -> dict[str, Any]:
        """The train state (fp32 weights, optimizer, schedule, scaler, counters, promoted layers).

        Tensors may alias live ones (optimizer state): serialise it, or `detached_copy()` it.
        """
        return {
            "model": self.prepared.fp32_state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
            "scaler": self.guard.scaler.state_dict(),
            "counters": asdict(self.guard.counters),
            "promoted": list(self.promoted),
        }


def build_training(cfg, device: torch.device, *, rank: int = 0, world_size: int = 1, total_steps: int,
                   state: Optional[dict[str, Any]] = None, ddp: bool = True) -> Training:
    """Build everything a step needs; each part of `state` that is present is loaded into it."""
    state = state or {}
    promoted = list(state.get("promoted", []))
    prepared = prepare_model(cfg, device, weights=state.get("model"), promoted=promoted, ddp=ddp)
    optimizer = build_optimizer(cfg.optim, prepared.optimizer_params())
    scheduler = build_scheduler(cfg.optim, optimizer, total_steps)
    guard = GuardedScaler(AmpSettings.from_config(cfg.precision), cfg.precision.scaler, device, rank, world_size)
    if "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state.get("scheduler"):
        scheduler.load_state_dict(state["scheduler"])
    if state.get("scaler"):
        guard.scaler.load_state_dict(state["scaler"])
    if "counters" in state:
        guard.counters = type(guard.counters)(**state["counters"])
    return Training(prepared, optimizer, scheduler, guard, MemoryLedger(prepared.raw), promoted)


def detached_copy(value: Any) -> Any:
    """A deep copy of a train state with every tensor cloned to the CPU (a snapshot for rollback)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: detached_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(detached_copy(item) for item in value)
    return value
