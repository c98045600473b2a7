"""`perf/tflops_per_s`, `perf/mfu` and `perf/tokens_per_s`: what the run's throughput means in FLOPs and tokens.

The first step of each attempt runs under torch's FLOP counter (`orchestrator.train.flops`), which gives the
FLOPs of a training sample by the kind of arithmetic they ran in. At each report with `perf/samples_per_s`:

    perf/tflops_per_s = FLOPs per sample x samples/s / 1e12        (all ranks together)
    perf/mfu          = perf/tflops_per_s / (peak TFLOP/s per device x world size)

The peak is `perf.peak_tflops` when set, else the device's row of `orchestrator.train.peaks` for the step's mix of
kinds; where neither is known (a CPU, a device not in the table) `perf/mfu` is not logged and the console says
why, once. A batch whose first input holds token ids (an integer tensor of 2 or more dims: `[batch, sequence]`)
also gives `perf/tokens_per_s`: the window's tokens per sample x samples/s.
"""

from typing import Optional

import torch

from orchestrator.train.flops import FlopCount, FlopTally
from orchestrator.train.hooks import Hook
from orchestrator.train.peaks import device_row, step_peak_tflops


def tokens_in(batch) -> int:
    """Token ids in a batch: the numel of its first input when that is an integer tensor of 2 or more dims; else
    0 (a batch without a sequence dimension)."""
    first = next((value for _, value in batch.inputs()), None)
    if isinstance(first, torch.Tensor) and first.dim() >= 2 and not first.is_floating_point() \
            and first.dtype != torch.bool:
        return first.numel()
    return 0


class Throughput(Hook):
    name = "throughput"

    def __init__(self, peak_tflops: Optional[float] = None) -> None:
        """`peak_tflops`: `perf.peak_tflops`, the peak per device (None: from the device table)."""
        self.peak_override = peak_tflops
        self.flops_per_sample: Optional[float] = None
        self.tally: Optional[FlopTally] = None
        self.peak: Optional[float] = None
        self.why_no_mfu: Optional[str] = None
        self.said_why = False
        self.tokens = self.samples = 0
        self._counting: Optional[FlopCount] = None

    def before_step(self, loop, step) -> None:
        if self.tally is None and self._counting is None:
            self._counting = FlopCount().__enter__()

    def after_step(self, loop, step) -> None:
        self.tokens += sum(tokens_in(batch) for batch in step.batches)
        self.samples += step.samples
        if self._counting is not None:
            self._counting.__exit__(None, None, None)
            self.tally, self._counting = self._counting.tally, None
            self.flops_per_sample = self.tally.total / max(step.samples, 1)
            self.peak, self.why_no_mfu = self.peak_of(loop.device)

    def teardown(self, loop) -> None:
        if self._counting is not None:  # the first step failed: leave no counter installed
            self._counting.__exit__(None, None, None)
            self._counting = None

    def peak_of(self, device: torch.device) -> tuple[Optional[float], Optional[str]]:
        """The peak TFLOP/s per device for this run's mix of kinds, or why there is none."""
        if self.peak_override is not None:
            return float(self.peak_override), None
        if not self.tally or not self.tally.total:
            return None, "perf/mfu is not logged: the FLOP counter found no matmul or convolution in a step"
        if device.type != "cuda":
            return None, (f"perf/mfu is not logged: no peak is known for a {device.type} device; set "
                          "perf.peak_tflops to its peak TFLOP/s to log it")
        name = torch.cuda.get_device_name(device)
        row = device_row(name)
        if row is None:
            return None, (f"perf/mfu is not logged: '{name}' is not in ampflow's table of peaks; set "
                          "perf.peak_tflops to its peak TFLOP/s for the run's dtypes")
        peak = step_peak_tflops(self.tally.by_kind, row)
        if peak is None:
            return None, (f"perf/mfu is not logged: the {row} has no peak for "
                          f"{', '.join(sorted(self.tally.by_kind))}; set perf.peak_tflops")
        return peak, None

    def collect(self, loop, report) -> None:
        samples_per_s = report.metrics.get("perf/samples_per_s")
        if samples_per_s is not None and self.flops_per_sample is not None:
            tflops = self.flops_per_sample * samples_per_s / 1e12
            report.metrics["perf/tflops_per_s"] = tflops
            if self.peak is not None:
                report.metrics["perf/mfu"] = tflops / (self.peak * loop.world_size)
        if samples_per_s is not None and self.samples:
            if self.tokens:
                report.metrics["perf/tokens_per_s"] = self.tokens / self.samples * samples_per_s
            self.tokens = self.samples = 0
        if self.why_no_mfu is not None and not self.said_why and loop.rank == 0:
            report.warnings.append(self.why_no_mfu)
            self.said_why = True

