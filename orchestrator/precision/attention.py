"""Where layers' outputs meet: the projections whose outputs reach one scaled-dot-product attention (or one matmul
of two activations, as eager attention's `q @ k^T` and `probs @ v`) together.

Such an op takes its operands in one dtype: torch refuses query, key and value of different dtypes, and matmul does
not promote. A policy that lowers the query projection alone (a rule naming it, or the tuner's probe of one layer)
leaves the block unrunnable. `meeting_groups` finds the groups from one fp32 forward pass of the real model on a real
batch, by following which layer last computed each tensor through every torch op; `split_groups` says which groups
a policy would hand different dtypes. Pre-flight refuses such a policy naming its rule, and the tuner lowers a group
as one unit.
"""

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from orchestrator.precision.policy import NORM_TYPES, LayerPlan, Policy

MEETING_OPS = {F.scaled_dot_product_attention, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
               torch.bmm, torch.Tensor.bmm, torch.einsum}
"""Ops that take their floating operands in one dtype (no type promotion)."""


@dataclass(frozen=True)
class MeetingGroup:
    block: str
    """The module whose forward calls the op (`(model)` for the model itself): the attention block."""
    layers: tuple[str, ...]
    """The layers with parameters whose outputs reach the op, in the model's order."""

    def relative(self, layer: str) -> str:
        return layer[len(self.block) + 1:] if self.block != "(model)" and layer.startswith(self.block + ".") \
            else layer


def producing_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers that decide the dtype of what they hand on: modules with parameters of their own, except the model
    itself and normalisation layers (a norm hands on what its input carries, as the probe's candidates)."""
    return [(name, module) for name, module in model.named_modules()
            if name and not isinstance(module, NORM_TYPES) and any(True for _ in module.parameters(recurse=False))]


class _Trace(TorchFunctionMode):
    """Each tensor's producers (the layers whose outputs it was computed from, through any op), and the producers
    of the operands of every meeting op with two or more of them."""

    def __init__(self, calling: Callable[[], str]):
        super().__init__()
        self.sources: Any = WeakTensorKeyDictionary()
        self.calling = calling
        self.meetings: list[tuple[str, list[frozenset]]] = []

    def of(self, value: Any) -> frozenset:
        return frozenset().union(*(self.sources.get(t, frozenset()) for t in tree_leaves(value)
                                   if isinstance(t, torch.Tensor)))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in MEETING_OPS:
            operands = [self.of(a) for a in (*args, *kwargs.values())[:3] if isinstance(a, torch.Tensor)]
            if func is torch.einsum:
                operands = [self.of(a) for a in tree_leaves((args[1:], kwargs)) if isinstance(a, torch.Tensor)]
            if sum(bool(o) for o in operands) >= 2:
                self.meetings.append((self.calling(), [o for o in operands if o]))
        sources = self.of((args, kwargs))
        if sources:
            for tensor in tree_leaves(result):
                if isinstance(tensor, torch.Tensor):
                    self.sources[tensor] = self.sources.get(tensor, frozenset()) | sources
        return result


def meeting_groups(model: nn.Module, forward: Callable[[nn.Module], Any]) -> list[MeetingGroup]:
    """The groups of layers whose outputs meet in one op, from `forward(model)` (one pass, no gradients, in the
    model's own dtypes; the model is left as it was). Groups of one layer (a fused qkv projection) are left out:
    they cannot be split."""
    names = {module: name for name, module in model.named_modules()}
    producers = {module for _, module in producing_layers(model)}
    order = {name: index for index, name in enumerate(names.values())}
    stack: list[str] = []
    trace = _Trace(lambda: stack[-1] if stack else "(model)")

    def enter(module, args):
        stack.append(names[module] or "(model)")

    def leave(module, args, output):
        stack.pop()
        if module in producers:  # what a layer computes is its own, whatever its inputs came from
            for tensor in tree_leaves(output):
                if isinstance(tensor, torch.Tensor):
                    trace.sources[tensor] = frozenset({names[module]})

    handles = [handle for module in names for handle in (
        module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True))]
    try:
        with torch.no_grad(), trace:
            forward(model)
    finally:
        for handle in handles:
            handle.remove()
    groups: dict[str, set[str]] = {}
    for block, operands in trace.meetings:
        met = set().union(*operands)
        if len(met) > 1:
            groups.setdefault(block, set()).update(met)
    return [MeetingGroup(block, tuple(sorted(layers, key=order.__getitem__))) for block, layers in groups.items()]


def hands_on(layer: LayerPlan, policy: Policy) -> torch.dtype:
    """The dtype `layer`'s output has under `policy`: its own inside a rule's region or without autocast, else
    autocast's for the layers autocast runs (Linear, convolutions)."""
    if layer.in_region or not policy.autocast:
        return layer.param_dtype
    return policy.compute_dtype if layer.type_is_autocast else layer.param_dtype


def split_groups(groups: list[MeetingGroup], plans: dict[str, LayerPlan],
                 policy: Policy) -> list[tuple[MeetingGroup, dict[str, torch.dtype]]]:
    """The groups whose layers `policy` hands different dtypes where they meet, each with its layers' dtypes.
    Where the op runs under autocast (its block in no rule's region) autocast gives the operands one dtype."""
    split = []
    for group in groups:
        block = plans.get("" if group.block == "(model)" else group.block)
        if policy.autocast and block is not None and not block.in_region:
            continue
        dtypes = {layer: hands_on(plans[layer], policy) for layer in group.layers}
        if len(set(dtypes.values())) > 1:
            split.append((group, dtypes))
    return split


def deciding_rule(group: MeetingGroup, dtypes: dict[str, torch.dtype],
                  plans: dict[str, LayerPlan]) -> Optional[str]:
    """The rule that sets part of the group apart: the one deciding the fewest of its layers' dtype."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for layer, dtype in dtypes.items():
        by_dtype.setdefault(dtype, []).append(layer)
    fewest = min(by_dtype.values(), key=len)
    return next((plans[layer].rule for layer in fewest if plans[layer].rule), None) or next(
        (plans[layer].rule for layer in group.layers if plans[layer].rule), None)
