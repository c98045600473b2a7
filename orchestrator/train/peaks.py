"""The peak dense TFLOP/s of a device for each kind of arithmetic, and the peak of a step's mix of kinds.

The figures are the vendors' datasheet peaks without structured sparsity (NVIDIA's "with sparsity" figures are
twice these), per GPU. `perf.peak_tflops` overrides them for a device not listed or a clock that differs.
"""

from typing import Mapping, Optional

PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"fp8": 1513.0, "bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "H100 NVL": {"fp8": 1670.5, "bf16": 835.3, "fp16": 835.3, "tf32": 417.6, "fp32": 60.0},
    "H200": {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200 NVL": {"fp8": 1670.5, "bf16": 835.3, "fp16": 835.3, "tf32": 417.6, "fp32": 60.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"fp8": 733.0, "bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6},
    "L4": {"fp8": 242.5, "bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
}
"""Dense TFLOP/s per GPU by device and kind of arithmetic (`orchestrator.train.flops.KINDS`). The A100 has no
fp8 tensor cores."""

# The name torch reports (`torch.cuda.get_device_name`) -> the table's row: the first pattern found in the name.
# More specific names first ("H100 PCIe" before "H100", "L40S" before "L4").
_NAMES = (("H100 NVL", "H100 NVL"), ("H100 PCIe", "H100 PCIe"), ("H100", "H100 SXM"), ("H200 NVL", "H200 NVL"),
          ("H200", "H200"), ("A100", "A100"), ("L40S", "L40S"), ("L4", "L4"))


def device_row(device_name: str) -> Optional[str]:
    """The table's row for a device name as torch reports it (`NVIDIA H100 80GB HBM3` -> `H100 SXM`); None for
    a device not in the table."""
    folded = device_name.upper()
    return next((row for pattern, row in _NAMES if pattern.upper() in folded), None)


def step_peak_tflops(flops_by_kind: Mapping[str, int], row: str) -> Optional[float]:
    """The peak TFLOP/s of a step whose FLOPs ran in these kinds on a device of `row`: the FLOP-weighted harmonic
    mean of the kinds' peaks, so that the step's FLOPs at this peak take as long as each kind's FLOPs at its own
    peak, added up. None when a kind the step used has no peak on this device."""
    peaks = PEAK_TFLOPS[row]
    total = sum(flops_by_kind.values())
    if total <= 0 or any(kind not in peaks for kind, flops in flops_by_kind.items() if flops):
        return None
    seconds_at_peak = sum(flops / peaks[kind] for kind, flops in flops_by_kind.items() if flops)
    return total / seconds_at_peak
