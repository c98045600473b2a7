"""What a collapsed loss scale does (`precision.scaler.on_collapse`): abort, promote the overflowing layers to
fp32, or roll back to the last checkpoint; the same on every rank (the flags were agreed)."""

from typing import Optional

from orchestrator.precision import LossScaleCollapsed
from orchestrator.train.hooks import Hook
from orchestrator.checkpoint.state import TrainState


class CollapseRecovery(Hook):
    """After a step, when the flags read so far say the scale collapsed (read late: on a GPU one step after the
    collapsed one, at the latest at the report): raise (`abort`, or `promote` with no layer to blame),
    or rebuild the training from a state (`loop.build`) and go on; the run is tagged `precision.promoted`."""

    name = "collapse"

    def __init__(self, on_collapse: str) -> None:
        self.on_collapse = on_collapse
        self.last_good: Optional[TrainState] = None
        """What `rollback` returns to: the last checkpoint's state (or the start's), kept on the CPU."""
        self.tags: dict[str, str] = {}

    def setup(self, loop) -> None:
        self._remember(loop)

    def on_checkpoint(self, loop, directory, name) -> None:
        self._remember(loop)

    def _remember(self, loop) -> None:
        if self.on_collapse == "rollback":
            self.last_good = loop.training.snapshot().detached()

    def after_step(self, loop, step) -> None:
        training = loop.training
        guard = training.precision.guard
        collapsed = guard.take_collapse()  # found when the flags were read: this step's, or on a GPU the one before
        if collapsed is None:
            return
        number, reason = collapsed
        layers = guard.overflowing_layers()  # a collective: every rank is here, the flags were agreed
        what = "loss scale collapsed" if guard.scaler.is_enabled() else "training collapsed (no loss scale)"
        message = f"{what} at step {number}: {reason}; overflowing layers: " \
                  f"{', '.join(layers) or 'none identified'}"
        if self.on_collapse == "abort" or (self.on_collapse == "promote" and not layers):
            raise LossScaleCollapsed(f"{message}. Keep those layers in fp32 (precision.rules), lower optim.lr, or "
                                     "set precision.scaler.on_collapse: promote | rollback.")
        now = training.snapshot()  # this rank's shards under FSDP: no other rank is needed
        if self.on_collapse == "promote":  # a fresh scale: the layers that overflowed are fp32 now
            now.scaler, now.promoted = None, list(dict.fromkeys(training.promoted + layers))
            state = now
            self.tags["precision.promoted"] = ",".join(state.promoted)
        else:  # rollback: the last good weights, optimizer and scale; time (step, schedule) goes on
            state = self.last_good.detached()
            state.scheduler, state.counters, state.promoted = now.scheduler, now.counters, now.promoted
        loop.training = loop.build(state)
        records = guard.drain_overflow_log()  # not reported yet: they go out with the rebuilt guard's
        if guard.rank == 0:
            records.append({"step": number, "event": "collapse", "action": self.on_collapse,
                            "reason": reason, "layers": layers})
        loop.training.precision.guard.overflow_log.extend(records)

    def collect(self, loop, report) -> None:
        report.tags.update(self.tags)
        self.tags = {}
