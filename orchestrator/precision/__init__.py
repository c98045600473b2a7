"""Mixed precision on torch.amp: autocast, loss scaling (and, later, per-layer policies)."""

from orchestrator.precision.amp import (
    found_inf,
    AmpSettings,
    autocast_context,
    dtype_name,
    loss_scale_of,
    make_scaler,
    parse_dtype,
)

__all__ = ["found_inf", "AmpSettings", "autocast_context", "dtype_name", "loss_scale_of", "make_scaler", "parse_dtype"]
