"""Memory of a training process that is not about dtypes: glibc's allocator settings (`perf.keep_freed_memory`)
and the peak memory a rank reached. Bytes by dtype and category are the precision ledger's
(`orchestrator.precision.ledger`)."""

import os
import resource
import sys
from typing import Optional

import torch

KEEP_FREED_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(4 * 2**30)}
"""glibc malloc settings (`perf.keep_freed_memory`): blocks up to 32 MiB (the largest fixed threshold glibc takes)
come from the heap instead of their own mmap, and the heap is not given back to the system below 4 GiB of free
space. By default glibc unmaps a freed activation buffer and the next step faults its pages in again."""


def allocator_env(keep_freed_memory: bool) -> dict[str, str]:
    """The variables a training process starts with under `perf.keep_freed_memory` ({} when off); values already
    in this process's environment win. glibc reads them once, when the process starts."""
    if not keep_freed_memory:
        return {}
    return {name: os.environ.get(name, value) for name, value in KEEP_FREED_MEMORY_ENV.items()}


def peak_bytes(device: torch.device) -> int:
    """CUDA max allocated on a GPU; this process's peak resident set on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


def peak_reserved_bytes(device: torch.device) -> Optional[int]:
    """CUDA max reserved by the caching allocator; None on the CPU (RSS already covers it)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    return None
