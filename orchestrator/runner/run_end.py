"""The end of a planned run, exactly once: the MLflow writer flushed, the run checked complete in MLflow, its
record and MLflow status closed, and MLflow's refused writes summed up on the console."""

import sys
from typing import Optional

from orchestrator.runner.plan import RunPlan
from orchestrator.runner.records import close_run
from orchestrator.tracking.refusals import Refusals
from orchestrator.tracking.secrets import redact

TRACKING_INCOMPLETE_TAG = "tracking_incomplete"
"""The tag of a run that trained but whose records MLflow did not all take: what is missing, and why."""


class RunEnd:
    """Ends the planned run exactly once: flushes the MLflow writer (once there is one), checks that MLflow has
    everything the run logged (a run missing records is FAILED, tagged `tracking_incomplete`, never FINISHED),
    then `close_run` (run record + MLflow status) with the tracker as it is by then (MLflow may have come back
    mid-run), and says how many writes MLflow refused, one line per kind."""

    def __init__(self, plan: RunPlan):
        self.plan, self.tracker, self.writer, self.status = plan, plan.tracker, None, None
        self.refusals = plan.tracker.refusals if plan.tracker is not None else Refusals()
        """The run's refused writes and lost records (its tracker's and writer's)."""
        self.closed = True
        """Whether MLflow took the run's final status (False: it still shows RUNNING)."""
        self.missing: list[str] = []
        """Artifacts the run logged that its artifact store no longer has."""
        self.clock = None
        """The run's attempts as its writer saw them (`orchestrator.tracking.goodput.RunClock`), once it has one."""

    def flush(self, timeout_s: float):
        """Stop the writer and log what it still holds; the tracker the run ended up with."""
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.close(timeout_s)
            finally:  # even a writer that fails to close leaves the run to be closed
                self.tracker = writer.tracker
        return self.tracker

    def close(self, status: str, timeout_s: Optional[float] = None) -> None:
        if self.status is not None:
            return
        timeout_s = self.plan.cfg.tracking.flush_timeout_s if timeout_s is None else timeout_s
        self.status = status
        try:
            self.flush(timeout_s)
        except Exception as exc:  # what the writer held is lost, but the run still ends with its status
            print(f"error: the MLflow writer failed while closing ({type(exc).__name__}: {redact(str(exc))}).",
                  file=sys.stderr)
        if self.tracker is not None and status != "KILLED":  # an interrupt's close has seconds, not a listing
            self.missing = self.tracker.missing_artifacts() or []
            self.refusals.lose("artifacts", len(self.missing))
        if self.incomplete:
            self.status = status = "FAILED" if status == "FINISHED" else status
            try:
                self.tracker.set_tag(TRACKING_INCOMPLETE_TAG, self.why_incomplete())
            except Exception:  # the store still refuses: the console says it
                pass
        self.closed = close_run(self.tracker, status, timeout_s, self.plan.cfg.checkpoint.storage_path,
                                self.plan.run_name)
        for line in self.refusals.summary():
            print(line, file=sys.stderr)

    @property
    def incomplete(self) -> bool:
        """MLflow lacks records of the run (never taken, or gone from its artifact store)."""
        return self.tracker is not None and self.refusals.any_lost

    def why_incomplete(self) -> str:
        """`MLflow did not record 19 metric values and 3 artifacts (...)`, naming artifacts gone from the store."""
        gone = ""
        if self.missing:
            shown = ", ".join(self.missing[:5]) + (", ..." if len(self.missing) > 5 else "")
            gone = f"; {len(self.missing)} of them logged earlier and gone from its artifact store ({shown})"
        refused = next(iter(self.refusals.summary()), None)
        return f"MLflow did not record {self.refusals.lost_text()} of the run{gone}" + \
            (f" ({refused})" if refused else "")
