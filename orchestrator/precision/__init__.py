"""Mixed precision on torch.amp: autocast, loss scaling, per-layer dtype policies, fp32 masters."""

from orchestrator.precision.amp import (
    AmpSettings,
    autocast_context,
    dtype_name,
    found_inf,
    loss_scale_of,
    make_scaler,
    parse_dtype,
)
from orchestrator.precision.masters import MasterWeights
from orchestrator.precision.policy import Audit, LayerPlan, Policy, apply, broken_promises, plan

__all__ = [
    "AmpSettings", "Audit", "LayerPlan", "MasterWeights", "Policy", "apply", "autocast_context",
    "broken_promises", "dtype_name", "found_inf", "loss_scale_of", "make_scaler", "parse_dtype", "plan",
]
