"""Mixed precision on torch.amp: autocast, loss scaling, per-layer dtype policies, fp32 masters."""

from orchestrator.precision.amp import AmpSettings, autocast_context, dtype_name, make_scaler, parse_dtype
from orchestrator.precision.masters import MasterWeights
from orchestrator.precision.policy import Audit, LayerPlan, Policy, apply, broken_promises, plan
from orchestrator.precision.scaling import GuardedScaler, LossScaleCollapsed, NonFiniteLoss, StepOutcome

# `Precision` (orchestrator.precision.mixed) is imported from its module: it depends on the memory ledger.

__all__ = [
    "AmpSettings", "Audit", "GuardedScaler", "LayerPlan", "LossScaleCollapsed", "MasterWeights", "NonFiniteLoss",
    "Policy", "StepOutcome", "apply", "autocast_context", "broken_promises", "dtype_name", "make_scaler",
    "parse_dtype", "plan",
]
