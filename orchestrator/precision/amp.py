"""Autocast and GradScaler, decided once from the precision section.

A tiny vocabulary in the spirit of Composer's `precision_context()`: the worker
asks for one context manager per forward pass and one scaler, and never branches
on dtypes itself.
"""

import contextlib
import math
from dataclasses import dataclass
from typing import Any, ContextManager, Optional

import torch

from orchestrator.errors import BadInput

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}


def parse_dtype(name: str, where: str = "precision.compute_dtype") -> torch.dtype:
    key = _ALIASES.get(str(name), str(name))
    if key not in DTYPES:
        raise BadInput(f"{where}: unknown dtype '{name}'. Use one of {', '.join(DTYPES)} (or fp32/fp16/bf16).")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float16` -> `float16`, the spelling used in metrics, tags and artifacts."""
    return str(dtype).removeprefix("torch.")


DEFAULT_MAX_SCALE = float(2**24)
"""Apex's cap on the dynamic loss scale."""


@dataclass(frozen=True)
class AmpSettings:
    compute_dtype: torch.dtype
    """Autocast dtype (with `autocast`); float32 means autocast is off."""
    loss_scale: str | float
    """`dynamic`, `none`, or a fixed scale."""
    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    autocast: bool = True
    """Run the forward pass under torch.autocast (`precision.autocast`, resolved: null means on for a half
    compute dtype). Off, every layer computes in the dtype it stores (Apex O2/O3, Lightning's *-true)."""
    max_scale: float = DEFAULT_MAX_SCALE
    """The dynamic loss scale never grows past this."""

    @classmethod
    def from_config(cls, precision: Any) -> "AmpSettings":
        compute_dtype = parse_dtype(precision.compute_dtype)
        autocast, max_scale = precision.autocast, float(precision.max_scale)
        if not math.isfinite(max_scale) or max_scale < 1:
            raise BadInput(f"precision.max_scale: {max_scale:g} must be a finite number >= 1 (default 2^24).")
        return cls(
            compute_dtype=compute_dtype,
            loss_scale=parse_loss_scale(precision.loss_scale),
            init_scale=float(precision.init_scale),
            growth_factor=float(precision.growth_factor),
            backoff_factor=float(precision.backoff_factor),
            growth_interval=int(precision.growth_interval),
            autocast=compute_dtype != torch.float32 if autocast is None else bool(autocast),
            max_scale=max_scale,
        )

    @property
    def autocast_enabled(self) -> bool:
        return self.autocast and self.compute_dtype != torch.float32

    @property
    def scaler_enabled(self) -> bool:
        """A scaler for fp16 autocast (for fp16 parameters the policy decides: `Policy.scaler_enabled`)."""
        return self.autocast_enabled and self.compute_dtype == torch.float16 and self.loss_scale != "none"


def parse_loss_scale(text: Any) -> str | float:
    value = str(text).strip().lower()
    if value in ("dynamic", "none"):
        return value
    try:
        scale = float(value)
    except ValueError:
        scale = float("nan")
    if not math.isfinite(scale) or scale <= 0:
        raise BadInput(
            f"precision.loss_scale: '{text}' is not `dynamic`, `none` or a positive finite number (e.g. 1024)."
        )
    return scale


def autocast_context(settings: AmpSettings, device_type: str) -> ContextManager:
    if not settings.autocast_enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=settings.compute_dtype)


class HalfGradScaler(torch.amp.GradScaler):
    """A GradScaler that also unscales float16 gradients in place: fp16 parameters without fp32 masters
    (O3-like policies) have nothing else to unscale. torch refuses by default because the unscaled
    values may underflow; the lint says so. `_unscale_grads_` is private (stable since torch 1.6)."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)


class FixedScaler(HalfGradScaler):
    """A static loss scale: steps with inf/nan gradients are still skipped, the scale never moves."""

    def update(self, new_scale: Optional[float | torch.Tensor] = None) -> None:
        super().update(self._init_scale if new_scale is None else new_scale)


def make_scaler(settings: AmpSettings, device_type: str, enabled: Optional[bool] = None) -> torch.amp.GradScaler:
    """A GradScaler, enabled when `enabled` says (default: fp16 autocast with scaling on)."""
    kwargs = dict(
        device=device_type,
        enabled=settings.scaler_enabled if enabled is None else enabled,
        growth_factor=settings.growth_factor,
        backoff_factor=settings.backoff_factor,
        growth_interval=settings.growth_interval,
    )
    if isinstance(settings.loss_scale, float):
        return FixedScaler(init_scale=settings.loss_scale, **kwargs)
    return HalfGradScaler(init_scale=settings.init_scale, **kwargs)
