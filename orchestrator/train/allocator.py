"""glibc's allocator settings for a training process (`perf.keep_freed_memory`), set in its environment before it
starts (`orchestrator.runner.launch`, `orchestrator.train.local`)."""

import os

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
