"""Training under FSDP2 (`scaling.strategy: fsdp`): sharding, the step's collectives, and the full state dict.

What differs from DDP, each in one function the training step calls through `FsdpStrategy`:

- `shard`: `fully_shard` on each unit of the plan (`orchestrator.precision.fsdp`), deepest first, then
  the root. Buffers are not sharded: as DDP does, every forward starts from rank 0's (`broadcast_buffers`),
  so BatchNorm's running statistics, checkpoints and evaluation are rank 0's on every rank;
- `no_sync`: the non-final micro-steps of gradient accumulation reduce nothing (FSDP keeps the unsharded
  gradients, in `reduce_dtype`, until the last micro-step reduce-scatters their sum);
- `clip_grad_norm`: the total norm over every rank's shards (one all-reduce), as a plain tensor;
- `LocalShards`: the optimizer's tensors by name with this rank's shard of each gradient, for the overflow
  log (the found-inf itself is agreed over all ranks by DTensor's unscale and by `GuardedScaler`);
- `full_state_dict` / `load_full_state_dict`: the whole model in fp32 on rank 0's CPU (the logged MLflow
  model, export) and back.
"""

from collections.abc import Sequence
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from orchestrator.precision.fsdp import FsdpPlan


def local(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard(model: nn.Module, fsdp_plan: FsdpPlan, device: torch.device) -> nn.Module:
    """Apply `fully_shard` to each unit with its MixedPrecisionPolicy, deepest first, the root last (in place).
    Needs the process group; every rank must hold the same weights (rank 0's) before."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("scaling.strategy fsdp needs torch.distributed initialised (Ray Train and the Ray-free "
                           "loop do it before the model is built)")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    modules = dict(model.named_modules())
    for unit in fsdp_plan.units:
        fully_shard(modules[unit.name], mesh=mesh, mp_policy=unit.mp_policy)
    if dist.get_world_size() > 1 and any(True for _ in model.buffers()):
        model.register_forward_pre_hook(_broadcast_buffers_hook, prepend=True)
    return model


def _broadcast_buffers_hook(module: nn.Module, args: tuple) -> None:
    broadcast_buffers(module)


@torch.no_grad()
def broadcast_buffers(model: nn.Module) -> None:
    """Give every rank rank 0's buffers (one broadcast per dtype), as DDP does before each forward."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in model.buffers():
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    for buffers in by_dtype.values():
        flat = torch.cat([buffer.reshape(-1) for buffer in buffers])
        dist.broadcast(flat, src=0)
        offset = 0
        for buffer in buffers:
            buffer.copy_(flat[offset: offset + buffer.numel()].view_as(buffer))
            offset += buffer.numel()


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes meanwhile reduce no gradient (a non-final micro-step of gradient accumulation)."""
    if not isinstance(model, FSDPModule):
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: Optional[float]) -> Optional[torch.Tensor]:
    """Clip the gradients to total norm `max_norm` over every rank's shards; the norm before clipping (the same on
    every rank, a plain tensor left on the device), None without clipping."""
    if max_norm is None:
        return None
    grads = [param for param in parameters if param.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm)
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).detach()


class _LocalView:
    """A parameter seen through this rank's shard: `grad` is the shard's gradient (a view: writes reach it)."""

    def __init__(self, param: torch.Tensor):
        self.param = param

    @property
    def grad(self) -> Optional[torch.Tensor]:
        return local(self.param.grad)


class LocalShards(Sequence):
    """(name, tensor) pairs, in the optimizer's order, whose `.grad` is this rank's shard of the gradient: what
    `GuardedScaler.step` and the fault drills read (an overflow is logged by the rank whose shard holds it)."""

    def __init__(self, model: nn.Module):
        self.items = [(name, _LocalView(param)) for name, param in model.named_parameters()]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state in fp32 on rank 0's CPU (gathered from every rank: a collective); {} on the other
    ranks. Under master weights the shards are the fp32 masters, so the values are exact. Its keys are the plain
    model's: `load_state_dict` of an unsharded copy takes it. Copies: training goes on without changing them."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # Copies: on a single rank (and for buffers) the gathered values are the live CPU tensors themselves.
    return {key: value.detach().to(torch.float32 if value.is_floating_point() else value.dtype, copy=True)
            for key, value in state.items()}


def load_full_state_dict(model: nn.Module, state: Optional[dict[str, torch.Tensor]]) -> None:
    """Load rank 0's full state dict (fp32) into the sharded model, each rank keeping its shards in their storage
    dtype (a collective: the other ranks pass None). `state` itself is left as it is (torch replaces its entries)."""
    set_model_state_dict(model, dict(state) if dist.get_rank() == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
