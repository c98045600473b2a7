"""torch.amp's settings, decided once from the precision section: the autocast dtype and the loss scale.

A tiny vocabulary in the spirit of Composer's `precision_context()`: the worker
asks for one context manager per forward pass (`autocast_context`) and never branches
on dtypes itself. The GradScalers these settings make are in `orchestrator.precision.scaler`.
"""

import contextlib
import math
from dataclasses import dataclass
from typing import Any, ContextManager

import torch

from orchestrator.errors import BadInput
from orchestrator.precision.dtypes import parse_dtype

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
