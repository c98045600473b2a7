"""`dtype: float8` as a per-layer rule: the Linear layers it matches compute their matmuls in float8 through
torchao's `Float8Linear` (weights stay in their storage dtype, fp32 by default; inputs, weights and gradients are
cast to float8 with dynamic scales, tensorwise or rowwise), on GPUs with float8 tensor cores (compute capability
8.9+: H100, L4, L40S) and, emulated and slow, on the CPU. Under FSDP2 tensorwise scaling all-gathers the weights
in float8 (torchao's float8 all-gather).
"""

import functools
import importlib
import importlib.util
from typing import Optional

import torch
from torch import nn

FLOAT8 = "float8"
SCALINGS = ("tensorwise", "rowwise")
INSTALL = "pip install 'ampflow[fp8]' (torchao)"

MIN_SIZES = ("auto", "torchao", "none")
"""`precision.float8_min_size`: which Linear layers a float8 rule leaves out as too small to gain (see below)."""

THRESHOLDS = {
    "tensorwise": "K <= 4096 and N <= 1024",
    "rowwise": "N <= 2048, or K <= 1024, or N <= 4096 and K <= 2048",
}
"""torchao's measured H100 thresholds (`torchao.float8._auto_filter_for_recipe`), in words, per scaling: a layer of
K inputs and N outputs they cover is slower in float8 than in bf16 (the casts and scales cost more than the faster
matmul gains). Dims not multiples of 16 cannot run float8 matmuls at all."""


def unavailable(device: Optional[torch.device] = None) -> Optional[str]:
    """Why float8 rules cannot run here (no torchao; a GPU without float8 tensor cores), or None."""
    if importlib.util.find_spec("torchao") is None:
        return f"float8 rules need torchao, which is not installed: {INSTALL}"
    if device is not None and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            return (f"float8 rules need a GPU with float8 tensor cores (compute capability 8.9+: H100, L4, L40S); "
                    f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}. Use bfloat16 there.")
    return None


@functools.lru_cache(maxsize=1)
def import_error() -> Optional[str]:
    """Why torchao, found installed (`unavailable` says None), fails to import (a build for another torch, a
    missing piece), or None. Importing it takes seconds: asked only where float8 is about to run."""
    try:
        importlib.import_module("torchao.float8")
    except Exception as exc:  # its first line: one line to the console
        first = (str(exc).splitlines() or [""])[0]
        return (f"float8 needs torchao, which is installed but fails to import ({type(exc).__name__}: {first}); "
                f"reinstall it: {INSTALL}")
    return None


def is_float8(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear"


def too_small(linear: nn.Module, scaling: str) -> Optional[str]:
    """Why float8 would not pay on `linear` (its K x N against torchao's threshold for `scaling`), or None. The
    decision is torchao's own filter (`_auto_filter_for_recipe`); the reason names the rule it applies."""
    from torchao.float8 import _auto_filter_for_recipe

    if _auto_filter_for_recipe(scaling, filter_fqns=[])(linear, ""):
        return None
    n, k = linear.weight.shape
    if k % 16 or n % 16:
        return f"K x N = {k} x {n}: float8 matmuls need both dims multiples of 16"
    return f"K x N = {k} x {n} is within torchao's H100 threshold for {scaling} scaling ({THRESHOLDS[scaling]})"


def float8_layers(plans: dict) -> dict[str, str]:
    """Layer (qualified name) -> scaling, for the layers a float8 rule planned (`policy.plan`)."""
    return {("" if name == "(model)" else name): layer.float8 for name, layer in plans.items() if layer.float8}


def convert_float8(model: nn.Module, scaling_by_layer: dict[str, str], device: torch.device, fsdp: bool = False) -> None:
    """Swap each named Linear for a Float8Linear with its scaling (before hooks are installed and before FSDP
    shards it; the parameters are the same objects)."""
    if not scaling_by_layer:
        return
    reason = unavailable(device)
    if reason is not None:
        raise RuntimeError(reason)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    modules = dict(model.named_modules())
    for name in scaling_by_layer:
        if not isinstance(modules[name], nn.Linear):
            raise ValueError(f"precision.rules: float8 applies to Linear layers; '{name}' is "
                             f"{type(modules[name]).__name__}. Match only Linear layers with a float8 rule.")
    for scaling in SCALINGS:
        names = {name for name, s in scaling_by_layer.items() if s == scaling}
        if not names:
            continue
        config = Float8LinearConfig.from_recipe_name(scaling)
        if fsdp and scaling == "tensorwise":
            config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn in names)


def float8_linear(linear: nn.Linear, scaling: str = "tensorwise") -> nn.Module:
    """A Float8Linear computing what `linear` computes (sharing its parameters), with `scaling`."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear.from_float(linear, config=Float8LinearConfig.from_recipe_name(scaling))


def native(device: torch.device) -> bool:
    """Whether `device` has float8 matmuls (elsewhere torch emulates them, slowly)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
