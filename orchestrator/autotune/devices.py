"""Cost models of the devices a policy can be planned for (`tune.target`): a layer's time is its FLOPs over the
device's rate for its dtype, or its bytes over the memory bandwidth, whichever is longer (a roofline).

Rates are the vendors' dense peak figures (no sparsity): what matters to the choice is their ratio between
dtypes, which the peaks give right. fp32 matrix work is counted at the plain fp32 rate (torch's default
`float32_matmul_precision` is "highest": no TF32 for matmuls).
"""

from dataclasses import dataclass

BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1}


@dataclass(frozen=True)
class DeviceRates:
    name: str
    matmul: dict[str, float]
    """FLOP/s of matrix work (Linear, convolution) by dtype; a dtype missing here is not native to the device."""
    elementwise: dict[str, float]
    """FLOP/s of other work (normalisation, embeddings) by dtype."""
    bandwidth: float
    """Memory bytes per second."""

    def supports(self, dtype: str) -> bool:
        return dtype in self.matmul


TARGETS = {
    # NVIDIA H100 SXM: 67 TFLOP/s fp32, 989 fp16/bf16 and 1979 float8 tensor cores, 3.35 TB/s HBM3.
    "h100": DeviceRates("h100", matmul={"float32": 67e12, "float16": 989e12, "bfloat16": 989e12, "float8": 1979e12},
                        elementwise={"float32": 67e12, "float16": 134e12, "bfloat16": 134e12}, bandwidth=3.35e12),
    # NVIDIA A100 SXM 80GB: 19.5 TFLOP/s fp32, 312 fp16/bf16 tensor cores, 2.04 TB/s HBM2e.
    "a100": DeviceRates("a100", matmul={"float32": 19.5e12, "float16": 312e12, "bfloat16": 312e12},
                        elementwise={"float32": 19.5e12, "float16": 78e12, "bfloat16": 39e12}, bandwidth=2.04e12),
    # (no float8 matmuls before compute capability 8.9)
    # A server CPU without native half precision: fp16 and bf16 are emulated, about 10x slower than fp32 (as
    # measured on such a machine: a small CNN's step 72 ms in fp32, 820 ms under bf16 autocast).
    "cpu": DeviceRates("cpu", matmul={"float32": 1e12, "float16": 0.1e12, "bfloat16": 0.1e12},
                       elementwise={"float32": 0.1e12, "float16": 0.01e12, "bfloat16": 0.01e12}, bandwidth=100e9),
}


@dataclass(frozen=True)
class Work:
    """What one layer does in one training step (forward and backward) on the probe's batch."""

    flops: float
    """Forward FLOPs (backward is counted as twice as many)."""
    params: int
    """Elements of its own parameters."""
    activations: int
    """Elements of its input and output (read and written once each way)."""
    matmul: bool
    """Matrix work (Linear, convolution): tensor-core rates."""


def modelled_time(work: Work, dtype: str, device: DeviceRates) -> float:
    """Seconds of one forward and backward of the layer in `dtype` on `device`: FLOPs or bytes, whichever is
    longer, plus, for a lowered layer, the casts of its input and output from and to fp32 (an upper bound: two
    lowered neighbours need no cast between them)."""
    rates = device.matmul if work.matmul else device.elementwise
    size = BYTES[dtype]
    compute = 3 * work.flops / rates[dtype]
    memory = (3 * work.activations + 3 * work.params) * size / device.bandwidth
    casts = 0.0 if dtype == "float32" else work.activations * (4 + size) / device.bandwidth
    if dtype == "float8":  # its weights stay fp32 and are cast each step (and their gradient computed in float8)
        casts += 2 * work.params * (4 + size) / device.bandwidth
    return max(compute, memory) + casts

