"""Memory per rank under FSDP: what this rank holds of the parameters, gradients and optimizer state, measured on its
shards, and the same figures predicted from the model and the plan (`orchestrator.summary --strategy fsdp`).

Both speak the memory ledger's language (`{category: {dtype: bytes}}`, metrics `memory/<category>_<dtype>_bytes`):
- `params`: this rank's shards, in their storage dtype (fp32 under master weights: they are the masters, so
  there is no `master` category under FSDP). FSDP pads each parameter's first dimension to a multiple of the
  world size: every rank stores ceil(rows / N) rows of each;
- `grads`: this rank's gradient shards (one padded buffer per unit, in the storage dtype);
- `optimizer`: the optimizer's per-element state on this rank's rows (not padded).
The gathered parameters a unit computes with exist only around its forward and backward (the root's from its
forward to the end of backward): `gathered_bytes` predicts that peak, on top of the figures above.
"""

import math
from typing import Iterable, Mapping, Optional

import torch
from torch import nn

from orchestrator.precision.dtypes import dtype_name
from orchestrator.precision.fsdp import FsdpPlan
from orchestrator.train.fsdp import local
from orchestrator.precision.ledger import bytes_by_dtype, optimizer_state_tensors

STATE_CATEGORIES = ("params", "grads", "optimizer")


def rank_bytes(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, dict[str, int]]:
    """This rank's bytes per category and dtype, read on its shards (after a step: between forward and backward the
    root's parameters are gathered, not shards)."""
    params = list(model.parameters())
    measured = {"params": bytes_by_dtype(local(param) for param in params),
                "grads": bytes_by_dtype(local(param.grad) for param in params)}
    if optimizer is not None:
        measured["optimizer"] = bytes_by_dtype(local(state) for state in optimizer_state_tensors(optimizer))
    return measured


def metrics(measured: Mapping[str, Mapping[str, int]]) -> dict[str, float]:
    """`memory/<category>_<dtype>_bytes` (the memory ledger's metric names)."""
    return {f"memory/{category}_{dtype}_bytes": float(size)
            for category, per_dtype in measured.items() for dtype, size in per_dtype.items()}


def _rows(param: torch.Tensor) -> tuple[int, int]:
    """(first dimension, elements per row): how FSDP shards a parameter (dim 0)."""
    if param.dim() == 0:
        return 1, 1
    rows = param.shape[0]
    return rows, (param.numel() // rows if rows else 0)


def predict_rank_bytes(model: nn.Module, fsdp_plan: FsdpPlan, world_size: int, *, rank: int = 0,
                       optimizer_states: int | Mapping[str, int] = 0) -> dict[str, dict[str, int]]:
    """What rank `rank` of `world_size` will hold under FSDP, per category and dtype, from the model's shapes (its
    dtypes do not matter: the plan says each unit's storage dtype). `optimizer_states`: per-element state tensors
    per parameter (SGD with momentum 1, Adam 2), one number for all or by parameter name. Rank 0 holds the most."""
    params = dict(model.named_parameters())
    totals: dict[str, dict[str, int]] = {category: {} for category in STATE_CATEGORIES}
    for unit in fsdp_plan.units:
        item = torch.empty((), dtype=unit.storage_dtype).element_size()
        dtype = dtype_name(unit.storage_dtype)
        for name in unit.params:
            param = params[name]
            rows, per_row = _rows(param)
            chunk = math.ceil(rows / world_size)
            mine = max(0, min(chunk, rows - rank * chunk))
            states = optimizer_states if isinstance(optimizer_states, int) else optimizer_states.get(name, 0)
            for category, elements in (("params", chunk * per_row), ("grads", chunk * per_row),
                                       ("optimizer", states * mine * per_row)):
                if elements:
                    totals[category][dtype] = totals[category].get(dtype, 0) + elements * item
    return totals


def gathered_bytes(model: nn.Module, fsdp_plan: FsdpPlan) -> int:
    """The gathered parameters' peak on one rank: the root unit's (kept from its forward to the end of backward) and
    the largest other unit's, each in its compute dtype. With prefetching on a GPU, one more unit may be in flight."""
    params = dict(model.named_parameters())

    def size(unit) -> int:
        item = torch.empty((), dtype=unit.compute_dtype).element_size()
        return sum(params[name].numel() for name in unit.params) * item

    root = next(unit for unit in fsdp_plan.units if not unit.name)
    others = [size(unit) for unit in fsdp_plan.units if unit.name]
    return size(root) + max(others, default=0)


def state_bytes(measured: Mapping[str, Mapping[str, int]], categories: Iterable[str] = STATE_CATEGORIES) -> int:
    """The bytes of `categories` (params, grads and optimizer state by default), all dtypes."""
    return sum(sum(measured.get(category, {}).values()) for category in categories)
