"""The loss scale's telemetry: `amp/*` metrics with every report, and the overflow records since the last."""

from orchestrator.train.hooks import Hook


class LossScaleTelemetry(Hook):
    """`amp/loss_scale`, `amp/skipped_steps`, ... with every report; `amp/skip_rate` with the epoch's; every
    skipped step's record (`amp/overflow_log.json`) with the report after it, and a warning for steps taken
    with non-finite gradients (`precision.on_nonfinite_grads: warn`)."""

    name = "loss_scale"

    def collect(self, loop, report) -> None:
        guard = loop.training.precision.guard
        report.metrics.update(guard.metrics())
        report.overflow_records.extend(guard.drain_overflow_log())
        report.warnings.extend(guard.drain_warnings())

    def end_epoch(self, loop, report) -> None:
        report.metrics.update(loop.training.precision.guard.end_epoch())
