"""The loss scale's telemetry: `amp/*` metrics, and the overflow records since the last report."""

from typing import Any, Optional

from orchestrator.train.hooks import Hook

GAUGE = "amp/loss_scale"
"""Logged with every report: the scale's history is the loss-scale plot (1.0 throughout without a scaler)."""


def is_last_report(report) -> bool:
    """The run's last report: the last epoch's, or the one early stopping ended the run with."""
    return report.epoch == report.epochs or "early_stopped_at_epoch" in report.tags


class LossScaleTelemetry(Hook):
    """`amp/loss_scale` with every report. The counters (`amp/skipped_steps`, `amp/consecutive_skips`,
    `amp/growth_events`, `amp/rank_disagreements`, `amp/nan_loss_steps`, `amp/nonfinite_grad_steps`, and the
    epochs' `amp/skip_rate`) from the first report where one is not zero, and all of them, zero or not, with the
    run's last report: a clean run draws no flat lines of zeros, yet says once, at its end, that nothing was
    skipped. Every skipped step's record (`amp/overflow_log.json`) goes with the report after it, and a warning
    for steps taken with non-finite gradients (`precision.on_nonfinite_grads: warn`)."""

    name = "loss_scale"

    def __init__(self) -> None:
        self.shown: set[str] = set()
        """Counters that have been non-zero in this run: logged with every report from then on."""
        self.skip_rate: Optional[float] = None
        self.last: Optional[Any] = None

    def collect(self, loop, report) -> None:
        guard = loop.training.precision.guard
        last = report is self.last
        counters = guard.metrics()
        if self.skip_rate is not None:
            counters["amp/skip_rate"], self.skip_rate = self.skip_rate, None
        for key, value in counters.items():
            if key == GAUGE or value != 0 or key in self.shown or last:
                if key != GAUGE and value != 0:
                    self.shown.add(key)
                report.metrics[key] = value
        report.overflow_records.extend(guard.drain_overflow_log())
        report.warnings.extend(guard.drain_warnings())

    def end_epoch(self, loop, report) -> None:
        self.skip_rate = loop.training.precision.guard.end_epoch()["amp/skip_rate"]
        self.last = report if is_last_report(report) else None

    def state_dict(self) -> dict[str, Any]:
        return {"shown": sorted(self.shown)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shown = set(state.get("shown", []))
