"""Whether a set of tensors is finite: what a checkpoint, the logged model and an export are checked with.

One boolean per tensor is computed on the tensor's device and all of them are read in one host transfer, so
checking a model costs one pass over its values and one sync, not one sync per tensor.
"""

from typing import Any, Iterable, Iterator, Optional

import torch


class NonFiniteModel(ValueError):
    """A model about to be logged or exported holds inf or nan."""


def named_tensors(value: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every floating-point tensor in `value` (a tensor, or dicts and lists of them, as a state dict or an
    optimizer's state), named by its path (`state.3.exp_avg`)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            yield prefix, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from named_tensors(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from named_tensors(item, f"{prefix}.{index}" if prefix else str(index))


@torch.no_grad()
def first_nonfinite_tensor(named: Iterable[tuple[str, torch.Tensor]]) -> Optional[str]:
    """The first tensor holding inf or nan, described (`features.0.weight: 3 of 432 values not finite (nan)`),
    or None when every one is finite."""
    tensors = [(name, tensor.detach()) for name, tensor in named if tensor.numel()]
    if not tensors:
        return None
    flags = [torch.isfinite(tensor).all() for _, tensor in tensors]
    for (name, tensor), ok in zip(tensors, torch.stack([flag.to(flags[0].device) for flag in flags]).tolist()):
        if ok:
            continue
        bad = int((~torch.isfinite(tensor)).sum())
        kind = "nan" if bool(torch.isnan(tensor).any()) else "inf"
        return f"{name}: {bad} of {tensor.numel()} values not finite ({kind})"
    return None


def model_nonfinite(model: torch.nn.Module) -> Optional[str]:
    """`first_nonfinite_tensor` over a model's parameters and buffers (BatchNorm's running statistics too)."""
    return first_nonfinite_tensor(named_tensors(model.state_dict()))
