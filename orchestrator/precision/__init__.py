"""Mixed precision on torch.amp: autocast, loss scaling, per-layer dtype policies, fp32 masters, and the
`Precision` object that holds them for one model."""

from orchestrator.precision.amp import AmpSettings, autocast_context
from orchestrator.precision.dtypes import dtype_name, parse_dtype
from orchestrator.precision.masters import MasterWeights
from orchestrator.precision.policy import Audit, LayerPlan, Policy, apply, broken_promises, plan
from orchestrator.precision.precision import Precision, PolicyNotHonoured
from orchestrator.precision.scaler import make_scaler
from orchestrator.precision.step_outcome import StepOutcome
from orchestrator.precision.guarded_step import (GuardedScaler, LossScaleCollapsed, NonFiniteGradients, NonFiniteLoss,
                                           NothingTrained)

__all__ = [
    "AmpSettings", "Audit", "GuardedScaler", "LayerPlan", "LossScaleCollapsed", "MasterWeights", "NonFiniteGradients",
    "NonFiniteLoss", "NothingTrained",
    "Policy", "PolicyNotHonoured", "Precision", "StepOutcome", "apply", "autocast_context", "broken_promises",
    "dtype_name", "make_scaler", "parse_dtype", "plan",
]
