"""Each rank's system metrics (`system/rank_<r>/...`), sampled on a thread and sent with the rank's reports."""

from typing import Optional

from orchestrator.train.hooks import Hook
from orchestrator.train.system import SystemSampler, start_sampler


class SystemMetrics(Hook):
    """Samples this rank's CPU, memory and GPU every `tracking.system_metrics_interval_s` (0: off); the
    training thread pays one attribute store per step (the step a sample is logged at)."""

    name = "system"

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.sampler: Optional[SystemSampler] = None

    def setup(self, loop) -> None:
        self.sampler = start_sampler(loop.rank, loop.device, self.interval_s)

    def before_step(self, loop, step) -> None:
        if self.sampler is not None:
            self.sampler.step = step.number

    def collect(self, loop, report) -> None:
        if self.sampler is not None:
            report.system_samples.extend(self.sampler.take())

    def teardown(self, loop) -> None:
        if self.sampler is not None:
            self.sampler.stop()
