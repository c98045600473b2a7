"""`precision/audit`: what each layer really stored and computed in, once per model."""

from typing import Any, Optional

from orchestrator.train.hooks import Hook


class PolicyAudit(Hook):
    """Closes the precision audit after the first forward pass under a (new) policy: after a step, or after an
    epoch's evaluation when the policy changed on the epoch's last step. A layer that broke its rule fails the
    run there (`PolicyNotHonoured`); the entries go out with the next report."""

    name = "audit"

    def __init__(self) -> None:
        self.entries: Optional[list[dict[str, Any]]] = None

    def after_step(self, loop, step) -> None:
        self._close(loop)

    def end_epoch(self, loop, report) -> None:
        self._close(loop)

    def collect(self, loop, report) -> None:
        if self.entries is not None:
            report.tables["precision/audit"], self.entries = self.entries, None

    def _close(self, loop) -> None:
        entries = loop.training.precision.close_audit()
        if entries is not None:
            self.entries = entries
