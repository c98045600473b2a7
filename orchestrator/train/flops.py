"""A training step's FLOPs, counted by torch's own `FlopCounterMode` and split by the dtype each op ran in.

`count_flops(fn)` runs `fn` (a forward and backward) under `torch.utils.flop_counter.FlopCounterMode` and returns
the FLOPs of every op it has a formula for (matmuls, convolutions, scaled-dot-product and flex attention, float8's
`_scaled_mm`), each tallied under the kind of arithmetic it ran in, read from its inputs at run time: `fp8`,
`bf16`, `fp16`, `tf32` (an fp32 matmul or convolution on a CUDA device that allows TF32) or `fp32`. Under a
per-layer policy this is what each layer computed in, measured, not what the policy promised.

What it does not count: elementwise ops, normalisations, softmax outside fused attention, the optimizer's update
and the loss (torch has no formula for them; in a transformer or a CNN they are a few percent of the FLOPs), and
communication. MFU read from these FLOPs is therefore a slight underestimate, as Composer's, Lightning's and
torchtitan's are.
"""

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry

KINDS = ("fp8", "bf16", "fp16", "tf32", "fp32")
"""The kinds of arithmetic a FLOP is counted under, as the peak table names them (`orchestrator.train.peaks`)."""

_CONVOLUTIONS = {torch.ops.aten.convolution, torch.ops.aten._convolution, torch.ops.aten.convolution_backward}


@dataclass
class FlopTally:
    """FLOPs by the kind of arithmetic they ran in (`KINDS`)."""

    by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())


def _first_floating(values: Any) -> torch.dtype | None:
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.dtype
        if isinstance(value, (list, tuple)):
            found = _first_floating(value)
            if found is not None:
                return found
    return None


def kind_of(dtype: torch.dtype | None, device_type: str, convolution: bool) -> str:
    """The kind of arithmetic an op on inputs of `dtype` runs in: float8 dtypes are `fp8`; fp32 is `tf32` where
    the CUDA device is allowed TF32 for it (cuDNN's switch for convolutions, cuBLAS's for matmuls)."""
    if dtype is None or dtype == torch.float32:
        if device_type == "cuda":
            allowed = torch.backends.cudnn.allow_tf32 if convolution else torch.backends.cuda.matmul.allow_tf32
            if allowed:
                return "tf32"
        return "fp32"
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if "float8" in str(dtype):
        return "fp8"
    return "fp32"  # float64 and others: no tensor-core peak applies; fp32 is the closest row of the table


def _tallied(op, formula: Callable[..., int], tally: dict[str, int]) -> Callable[..., int]:
    """`formula` (torch's, taking the op's arguments) that also adds its FLOPs under the op's kind."""
    convolution = op in _CONVOLUTIONS

    def counted(*args, out_val=None, **kwargs) -> int:
        flops = formula(*args, out_val=out_val, **kwargs)
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        device_type = tensor.device.type if tensor is not None else "cpu"
        tally[kind_of(_first_floating(args), device_type, convolution)] += flops
        return flops

    counted._get_raw = True  # FlopCounterMode passes the tensors themselves, not their shapes
    return counted


class FlopCount:
    """A context in which every op with a FLOP formula is counted, by kind (`tally` once it has exited)."""

    def __init__(self) -> None:
        self._by_kind: dict[str, int] = defaultdict(int)
        # torch's registry holds formulas already made to take the op's arguments: each is wrapped as it is.
        mapping = {op: _tallied(op, formula, self._by_kind) for op, formula in flop_registry.items()}
        self._mode = FlopCounterMode(display=False, custom_mapping=mapping)

    def __enter__(self) -> "FlopCount":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self._mode.__exit__(*exc_info)

    @property
    def tally(self) -> FlopTally:
        return FlopTally({kind: flops for kind, flops in self._by_kind.items() if flops})


def count_flops(fn: Callable[[], Any]) -> FlopTally:
    """The FLOPs of what `fn` runs (a forward and backward), by kind."""
    with FlopCount() as counter:
        fn()
    return counter.tally
