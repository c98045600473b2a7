"""Memory in the reports: bytes by dtype and category (`memory/<category>_<dtype>_bytes`, `memory/breakdown`) once
the first step has measured them, and every epoch the peaks of every rank and what each rank holds of the model's
state. The ledger measures the rank it runs on (rank 0's figures are logged): under FSDP its shards."""

import resource
import sys
from typing import Any, Optional

import torch

from orchestrator.train.collectives import per_rank
from orchestrator.train.hooks import Hook


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


class MemoryReport(Hook):
    """The memory ledger's table and metrics with the report after the first complete step; each epoch's
    report adds `memory/peak_bytes` (max over ranks: a collective, every rank makes it), the per-rank peaks,
    `memory/rank<r>_state_bytes` (the parameters, gradients, optimizer state and masters rank r holds: under FSDP
    its shards, so the ranks differ) and `memory/params_bytes`."""

    name = "memory"

    def __init__(self) -> None:
        self.table: Optional[list[dict[str, Any]]] = None

    def after_step(self, loop, step) -> None:
        table = loop.training.precision.ledger.take_table()  # once the optimizer has stepped
        if table is not None:
            self.table = table

    def end_epoch(self, loop, report) -> None:
        report.metrics.update(memory_peaks(loop.rank, loop.world_size, loop.device))
        held = per_rank(float(state_bytes(loop.training.precision.ledger.bytes)), loop.rank, loop.world_size,
                        loop.device)
        report.metrics.update({f"memory/rank{r}_state_bytes": size for r, size in enumerate(held)})
        report.metrics.update({"memory/params_bytes": float(loop.training.prepared.params_bytes),
                               **loop.training.precision.ledger.metrics()})

    def collect(self, loop, report) -> None:
        if self.table is not None:
            report.tables["memory/breakdown"], self.table = self.table, None
            report.metrics.update(loop.training.precision.ledger.metrics())


STATE = ("params", "grads", "optimizer", "master")


def state_bytes(measured: dict[str, dict[str, int]]) -> int:
    """Bytes of the parameters, gradients, optimizer state and masters, all dtypes."""
    return sum(sum(measured.get(category, {}).values()) for category in STATE)


def memory_peaks(rank: int, world_size: int, device: torch.device) -> dict[str, float]:
    """`memory/peak_bytes` (max over ranks) and `memory/rank<r>_peak_bytes` (and CUDA's
    `memory/rank<r>_peak_reserved_bytes`)."""
    peaks = per_rank(float(peak_bytes(device)), rank, world_size, device)
    metrics = {"memory/peak_bytes": max(peaks), **{f"memory/rank{r}_peak_bytes": p for r, p in enumerate(peaks)}}
    reserved = peak_reserved_bytes(device)
    if reserved is not None:
        reserved_peaks = per_rank(float(reserved), rank, world_size, device)
        metrics.update({f"memory/rank{r}_peak_reserved_bytes": p for r, p in enumerate(reserved_peaks)})
    return metrics
