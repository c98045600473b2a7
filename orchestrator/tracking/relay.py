"""From the Ray Train controller to the driver: every report, in order.

`RelayCallback` runs on the controller and only forwards (a non-blocking actor call), so a slow
or unreachable MLflow can never hold up training; the driver drains the relay and does all MLflow
I/O (`orchestrator.tracking.writer`). Workers never talk to MLflow, and a restarted worker group
reports into the same relay, hence the same run.
"""

from typing import Any

import ray
from ray.train import UserCallback

from orchestrator.train.step import OVERFLOW_LOG  # noqa: F401  (every rank's skipped-step records)
from orchestrator.train.system import SYSTEM_SAMPLES


@ray.remote(num_cpus=0)
class ReportRelay:
    def __init__(self) -> None:
        self.queue: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []

    def push(self, report: dict[str, Any], overflow_records: list[dict[str, Any]]) -> None:
        self.queue.append((report, overflow_records))

    def take(self) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
        queue, self.queue = self.queue, []
        return queue


class RelayCallback(UserCallback):
    """Forwards rank 0's report (metrics already reduced over all ranks), with every rank's system samples, and
    every rank's overflow records."""

    def __init__(self, relay):
        self.relay = relay

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        self.relay.push.remote(*merge_ranks(metrics))


def merge_ranks(metrics: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(rank 0's report with all ranks' system samples, all ranks' overflow records) from each rank's report."""
    overflow = [record for rank_metrics in metrics for record in rank_metrics.get(OVERFLOW_LOG, [])]
    report = {k: v for k, v in metrics[0].items() if k not in (OVERFLOW_LOG, SYSTEM_SAMPLES)}
    samples = [sample for rank_metrics in metrics for sample in rank_metrics.get(SYSTEM_SAMPLES, [])]
    if samples:
        report[SYSTEM_SAMPLES] = samples
    return report, overflow
