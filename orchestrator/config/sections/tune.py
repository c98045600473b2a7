"""The `tune` section: how `ampflow tune` chooses a per-layer precision policy for the job."""

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class TuneSection:
    target: Optional[str] = None
    """The device the policy is planned for (`ampflow tune`): `h100`, `a100` or `cpu`, whose costs come from a model
    (each layer's FLOPs and bytes over that device's rates); null: each layer's cost is measured on the device at
    hand."""
    tolerance: float = 0.05
    """The relative error the chosen policy may add: to the model's output and to its gradients (predicted as the
    root sum of squares of the lowered layers' errors), and to the validation run's loss against fp32."""
    candidates: List[str] = field(default_factory=lambda: ["float16", "bfloat16", "float8"])
    """The dtypes each layer with parameters is tried in (fp32 is always the fallback); float8 for Linear layers
    only, where torchao is installed and the device has float8 matmuls (or `emulate_float8`)."""
    emulate_float8: bool = False
    """Probe float8 on a device without float8 matmuls (the CPU, a GPU before compute capability 8.9) through
    emulation: its errors are float8's, its measured cost is not (plan with `target`)."""
    batches: int = 2
    """Batches of the job's training data the probe runs (each layer and dtype is measured on all of them)."""
    validate_steps: int = 20
    """Optimizer steps of the validation run: the chosen policy beside fp32, from the same seed, on the same
    batches (0: no validation)."""
    max_rounds: int = 5
    """How many times a failed validation may move the riskiest lowered layer up one dtype and check again."""
