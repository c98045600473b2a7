"""DistributedDataParallel as the job's `ddp` section configures it: how the prepared model is wrapped.

`Wrap` is what `build_training` applies to the model once its precision is in place: Ray Train's
`prepare_model` on a Ray Train worker (`orchestrator.runner.worker`), `ddp_wrap` elsewhere.
"""

from typing import Any, Callable

import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

Wrap = Callable[[nn.Module], nn.Module]
"""Wraps the prepared model for data parallelism (Ray Train's `prepare_model`, or DDP by hand)."""


def ddp_kwargs(ddp_cfg) -> dict[str, Any]:
    """The `ddp` section as DistributedDataParallel arguments."""
    return {"bucket_cap_mb": ddp_cfg.bucket_cap_mb, "gradient_as_bucket_view": ddp_cfg.gradient_as_bucket_view,
            "static_graph": ddp_cfg.static_graph, "find_unused_parameters": ddp_cfg.find_unused_parameters}


def register_comm_hook(model: nn.Module, hook: str) -> None:
    """`ddp.comm_hook`: compress gradients to fp16/bf16 for the all-reduce (a no-op without DDP)."""
    if hook == "none" or not isinstance(model, nn.parallel.DistributedDataParallel):
        return
    compress = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[hook]
    model.register_comm_hook(state=None, hook=compress)


def ddp_wrap(cfg) -> Wrap:
    """torch's DistributedDataParallel with the job's `ddp` knobs; a single process is left unwrapped
    (as Ray Train's prepare_model does)."""
    def wrap(model: nn.Module) -> nn.Module:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return model
        wrapped = nn.parallel.DistributedDataParallel(model, **ddp_kwargs(cfg.ddp))
        register_comm_hook(wrapped, cfg.ddp.comm_hook)
        return wrapped

    return wrap
