"""`perf/time_to_first_step_s`: from submit's start to the end of a fresh run's first step."""

import time
from typing import Optional

from orchestrator.train.hooks import Hook


class TimeToFirstStep(Hook):
    name = "time_to_first_step"

    def __init__(self, launched_at: Optional[float]) -> None:
        """`launched_at`: when submit began (wall clock); None: not measured."""
        self.launched_at, self.seconds = launched_at, None

    def after_step(self, loop, step) -> None:
        if step.number == 1 and self.launched_at is not None:  # a fresh run's first step
            self.seconds = time.time() - self.launched_at

    def collect(self, loop, report) -> None:
        if self.seconds is not None:
            report.metrics["perf/time_to_first_step_s"], self.seconds = self.seconds, None
