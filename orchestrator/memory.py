"""Memory as it really is: bytes by dtype, and the device/process peak."""

import resource
import sys
from collections import Counter

import torch
from torch import nn

from orchestrator.precision.amp import dtype_name


def param_bytes_by_dtype(model: nn.Module) -> dict[str, int]:
    """Bytes of the parameters as stored, per dtype (shared parameters counted once)."""
    totals: Counter[str] = Counter()
    for param in model.parameters():  # .parameters() already de-duplicates shared tensors
        totals[dtype_name(param.dtype)] += param.numel() * param.element_size()
    return dict(totals)


def peak_bytes(device: torch.device) -> int:
    """CUDA max allocated on a GPU; this process's peak resident set on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB
