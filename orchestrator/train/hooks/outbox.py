"""Reports a rank keeps until the driver has logged them, so a resumed run can send them again.

A driver that dies (or loses MLflow) while holding reports would lose them: each rank keeps what it reported
since the newest report the driver logged for sure (`Session.logged_through`) in its part of every
checkpoint, and a resumed run sends it again; the driver's writer drops what MLflow already has.
"""

from typing import Any, Optional

from orchestrator.train.collectives import all_reduce
from orchestrator.train.hooks import Hook
from orchestrator.common.report import Report

MAX_UNLOGGED = 1000
"""Most reports a rank keeps for a resumed run to send again (a driver cut off from MLflow for that long loses
the oldest of them if it dies too)."""


def kept_for_replay(report: Report, rank: int) -> Optional[dict[str, Any]]:
    """What of a report a rank keeps until the driver has logged it (its wire form): rank 0 its report (the one
    the driver logs), every rank its overflow records and system samples (the driver merges all ranks');
    warnings are not repeated."""
    if rank == 0:
        return Report(**{**vars(report), "warnings": [], "replay": []}).to_wire()
    if report.overflow_records or report.system_samples:
        return Report(seq=report.seq, overflow_records=report.overflow_records,
                      system_samples=report.system_samples).to_wire()
    return None


class ReplayOutbox(Hook):
    """Keeps each report (the last hook to see it, so it is complete); a checkpoint holds what the driver has
    not logged yet; a resumed run's first report carries it (`resent`)."""

    name = "replay"

    def __init__(self, session, rank: int, device) -> None:
        self.session, self.rank, self.device = session, rank, device
        self.unlogged: list[dict[str, Any]] = []
        """This rank's reports the driver may not have logged yet (wire forms), oldest first."""

    def collect(self, loop, report) -> None:
        kept = kept_for_replay(report, self.rank)
        if kept is not None:
            self.unlogged = [*self.unlogged, kept][-MAX_UNLOGGED:]

    def state_dict(self) -> dict[str, Any]:
        """At a checkpoint, on every rank: what the driver has not logged yet. Rank 0 asks how far the driver
        has logged, and every rank hears the same answer (one all-reduce)."""
        logged = self.session.logged_through() if self.rank == 0 else 0
        logged = all_reduce([-1.0 if logged is None else float(logged)], self.device)[0]
        self.unlogged = [] if logged < 0 else [kept for kept in self.unlogged if kept["seq"] > logged]
        return {"unlogged": self.unlogged}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.unlogged = list(state.get("unlogged", []))

    def resent(self, loop, checkpoint_report: dict[str, Any], warnings: list[str]) -> Report:
        """A resumed run's first report: on rank 0 the checkpoint's own report and the kept reports, in order
        (logged once: the driver drops steps it already has), the warnings of the way back and the
        `resumed_from_step` tag; on every rank the kept overflow records and system samples (the relay merges
        every rank's)."""
        kept = [Report.from_wire(wire) for wire in self.unlogged]
        resent = Report(overflow_records=[r for report in kept for r in report.overflow_records],
                        system_samples=[s for report in kept for s in report.system_samples])
        if self.rank == 0:
            own = Report.from_wire(checkpoint_report)
            for field in ("seq", "step", "epoch", "epochs", "total_steps", "metrics"):
                setattr(resent, field, getattr(own, field))
            resent.replay = [Report(**{**vars(report), "overflow_records": [], "system_samples": []})
                             for report in kept]
            resent.warnings = warnings
            resent.tags = {"resumed_from_step": str(loop.global_step)}
        return resent
