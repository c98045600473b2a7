"""A run's goodput: where its wall time went, from submit to its end, across its attempts.

The driver's writer shows every item the relay hands it to a `RunClock` (`report`, `ended`, `node_lost`); once
the run is over, `RunClock.breakdown(end_at)` splits the wall time, submit to end, into parts that sum to it:

- `training`: time in steps that count (the loop's `time/compute_s`: forward, backward, the optimizer and the
  gradients' exchange);
- `startup`: submit to the start of the first attempt's first window (the first step);
- `restarts`: from an attempt's last report to the next attempt's start of training (the failure, Ray Train's
  restart, the resume; steps trained after that last report are lost in it too);
- `redone`: steps trained again after a restart (the previous attempt's last reported step minus the step the
  next one resumed from), each at that earlier attempt's own time per step;
- `checkpoint`, `eval`, `data`, `other`: the loop's `time/checkpoint_s`, `time/eval_s`, `time/data_s` and
  `time/other_s` (`other` with `time/comm_s`, the loop's exchanges outside the steps, and what the windows leave
  uncovered between the reports' times);
- `end`: from the last report to the end (the final checkpoint, the model logged, shutdown).

Without the loop's `time/*` metrics an attempt's time between its first and last report counts as training.
Nothing here imports Ray: the accounting is plain arithmetic over the reports' times (`Report.at`).
"""

import time
from dataclasses import dataclass, field
from typing import Any, Optional

TIME_KEYS = ("time/data_s", "time/compute_s", "time/comm_s", "time/eval_s", "time/checkpoint_s", "time/other_s")
"""The training loop's per-window split of its wall time (seconds since the previous report)."""

PARTS = ("training", "startup", "restarts", "redone", "checkpoint", "eval", "data", "other", "end")
"""The parts of the wall time, each logged as `goodput/<part>_s`; they sum to `goodput/wall_s`."""

WORDS = {"training": "training", "startup": "start-up", "restarts": "restarts", "redone": "redone",
         "checkpoint": "checkpoints", "eval": "evaluation", "data": "data stalls", "other": "other", "end": "the end"}
"""How the console's summary line names each part."""

CAUSES = {"node loss": "a node loss", "preemption": "a preemption", "failure": "a failure",
          "elastic resize": "an elastic resize", None: "a restart"}
"""Why an attempt ended (`AttemptEnded.cause`), as the console says it."""


@dataclass
class AttemptEnded:
    """The Ray Train controller restarts the worker group (`orchestrator.tracking.attempts.AttemptWatch`)."""

    at: float
    """When the controller decided it (wall clock, seconds)."""
    cause: str
    """`preemption`, `failure` or `elastic resize` (a node loss is told apart later, by `NodeLost`)."""


@dataclass
class Attempt:
    """One worker group's run, as the driver saw it through its reports."""

    number: int
    began_at: float
    """When it began: submit for the first, the previous attempt's end (or last report) after."""
    training_from: Optional[float] = None
    """When its training began: a resumed attempt's first report (sent before its first step), or a fresh one's
    first report less that report's window."""
    last_report_at: Optional[float] = None
    ended_at: Optional[float] = None
    """When the controller ended it (None: it ran to the run's end, or its end was not told)."""
    ended_by: Optional[str] = None
    """Why it ended (`CAUSES`)."""
    resumed_from_step: Optional[int] = None
    start_step: int = 0
    """The step it trained from (its checkpoint's, 0 afresh)."""
    last_step: Optional[int] = None
    """The newest step it reported."""
    last_seq: int = 0
    world_size: Optional[int] = None
    time: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIME_KEYS, 0.0))
    """Its reports' `time/*` summed."""
    timed: bool = False
    """Whether any of its reports carried `time/*`."""

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.number, "world_size": self.world_size, "resumed_from_step": self.resumed_from_step,
                "first_step": self.start_step, "last_step": self.last_step, "ended_by": self.ended_by,
                "began_at": self.began_at, "training_from": self.training_from,
                "last_report_at": self.last_report_at, "ended_at": self.ended_at}


@dataclass
class Breakdown:
    """The run's wall time in parts (seconds), in all and per attempt."""

    parts: dict[str, float]
    attempts: list[dict[str, Any]]
    """Each attempt: `Attempt.to_json()` with its own `parts` and `steps_redone` (the steps of it that the next
    attempt trained again)."""
    restart_causes: list[str]
    """Why each restart happened, in order (`CAUSES` keys; None when not told)."""
    timed: bool
    """Whether the loop's `time/*` metrics were there to split the attempts' time by."""

    @property
    def wall_s(self) -> float:
        return sum(self.parts.values())

    @property
    def fraction(self) -> float:
        wall = self.wall_s
        return self.parts["training"] / wall if wall > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        """`goodput/fraction`, `goodput/wall_s`, `goodput/attempts` and `goodput/<part>_s`."""
        return {"goodput/fraction": self.fraction, "goodput/wall_s": self.wall_s,
                "goodput/attempts": float(len(self.attempts)),
                **{f"goodput/{part}_s": seconds for part, seconds in self.parts.items()}}

    def to_json(self) -> dict[str, Any]:
        """`perf/time_breakdown.json`."""
        return {"wall_s": self.wall_s, "fraction": self.fraction, "parts_s": self.parts,
                "restart_causes": self.restart_causes, "timed": self.timed, "attempts": self.attempts}

    def line(self) -> str:
        """`time: 81% training, 8% start-up, 5% evaluation, 4% checkpoints, 2% redone after a node loss`: the
        parts that round to 1% or more, largest first."""
        wall = self.wall_s
        if wall <= 0:
            return "time: nothing measured"
        causes = [CAUSES.get(cause, cause) for cause in dict.fromkeys(self.restart_causes)]
        after = f" after {' and '.join(causes)}" if causes else ""
        shown = sorted(((seconds / wall, part) for part, seconds in self.parts.items()
                        if round(100 * seconds / wall) >= 1 or part == "training"), reverse=True)
        said = [f"{round(100 * share)}% {WORDS[part]}{after if part in ('restarts', 'redone') else ''}"
                for share, part in shown]
        return f"time: {', '.join(said)} (of {wall:.0f} s)"


class RunClock:
    """The run's attempts, from the reports (and restarts) the driver sees, in order."""

    def __init__(self, submitted_at: Optional[float] = None):
        """`submitted_at`: when submit began (wall clock, as `perf/time_to_first_step_s` counts from); now if
        None."""
        self.submitted_at = time.time() if submitted_at is None else submitted_at
        self.attempts: list[Attempt] = []

    # -- what the driver sees --------------------------------------------------------------------------

    def report(self, report) -> None:
        """A report (`orchestrator.common.report.Report`) as the relay handed it over; its `at` is when rank 0
        made it (the driver's clock when it has none)."""
        at = report.at if report.at is not None else time.time()
        resumed = report.tags.get("resumed_from_step")
        current = self.attempts[-1] if self.attempts else None
        if current is None:
            current = self._begin(self.submitted_at)
        elif current.ended_at is not None or (current.last_report_at is not None and (
                resumed is not None or report.seq <= current.last_seq)):
            # The controller said it ended, or the report starts over: a resumed attempt's first, or a fresh
            # attempt's (its numbering restarts) when no checkpoint was there to resume from.
            current = self._begin(current.ended_at or current.last_report_at)
        current.last_report_at, current.last_seq = at, report.seq
        if resumed is not None:  # sent before the attempt's first step: the checkpoint's report, sent again
            current.resumed_from_step = current.start_step = int(resumed)
            current.training_from, current.last_step = at, int(resumed)
            return
        window = [float(report.metrics[key]) for key in TIME_KEYS if key in report.metrics]
        if current.training_from is None:  # a fresh attempt's first report: its window began with the first step
            current.training_from = max(current.began_at, at - sum(window)) if window else at
            first_step_s = report.metrics.get("perf/time_to_first_step_s")
            if not window and first_step_s is not None and current.began_at <= self.submitted_at + first_step_s:
                # No window to go by: the end of the first step (which then counts as start-up).
                current.training_from, current.start_step = min(at, self.submitted_at + first_step_s), 1
        for key in TIME_KEYS:
            current.time[key] += float(report.metrics.get(key, 0.0))
        current.timed = current.timed or bool(window)
        current.last_step = report.step if current.last_step is None else max(current.last_step, report.step)
        if "system/world_size" in report.metrics:
            current.world_size = int(report.metrics["system/world_size"])

    def ended(self, ended: AttemptEnded) -> None:
        """The controller ended the running attempt (it restarts it)."""
        current = self.attempts[-1] if self.attempts else self._begin(self.submitted_at)
        if current.ended_at is not None:  # a restarted group that ended before it reported anything
            current = self._begin(current.ended_at)
        current.ended_at = ended.at
        current.ended_by = current.ended_by or ended.cause  # a node loss told first stays what ended it

    def node_lost(self, at: float) -> None:
        """A node of the run was lost when its ranks failed at `at`: the attempt running then ended by it."""
        running = [attempt for attempt in self.attempts if attempt.began_at <= at
                   and (attempt.training_from is None or attempt.training_from <= at)]
        if running:
            running[-1].ended_by = "node loss"

    def last_step(self) -> int:
        """The newest step any attempt reported (0 before the first report)."""
        return max((attempt.last_step or 0 for attempt in self.attempts), default=0)

    def _begin(self, at: float) -> Attempt:
        attempt = Attempt(number=len(self.attempts) + 1, began_at=at)
        self.attempts.append(attempt)
        return attempt

    # -- the accounting --------------------------------------------------------------------------------

    def breakdown(self, end_at: Optional[float] = None) -> Breakdown:
        """The wall time from submit to `end_at` (now if None) in parts; the parts sum to it exactly (each time
        is taken no earlier than the one before, so a clock off by a little never makes a part negative)."""
        end_at = time.time() if end_at is None else end_at
        trained = [attempt for attempt in self.attempts if attempt.training_from is not None]
        rows, cursor = [], self.submitted_at
        for index, attempt in enumerate(trained):
            own = dict.fromkeys(PARTS, 0.0)
            start = max(cursor, attempt.training_from)
            own["startup" if index == 0 else "restarts"] = start - cursor
            span = max(0.0, attempt.last_report_at - start)
            self._split(attempt, span, own)
            cursor = start + span
            rows.append(own)
        if rows:
            rows[-1]["end"] = max(0.0, end_at - cursor)
        redone_steps = [0] * len(trained)
        for index in range(1, len(trained)):  # what the attempt before each restart trained and lost
            before, after = trained[index - 1], trained[index]
            steps = max(0, (before.last_step or 0) - (after.resumed_from_step or 0))
            redone = min(rows[index - 1]["training"], steps * self._step_time(before, rows[index - 1]))
            rows[index - 1]["training"] -= redone
            rows[index - 1]["redone"] += redone
            redone_steps[index - 1] = steps
        parts = {part: sum(row[part] for row in rows) for part in PARTS}
        if not rows:  # nothing reported: all of it was start-up (a run that failed before its first report)
            parts["startup"] = max(0.0, end_at - self.submitted_at)
        attempts = [{**attempt.to_json(), "steps_redone": steps, "parts_s": row}
                    for attempt, steps, row in zip(trained, redone_steps, rows)]
        causes = [before.ended_by for before in trained[:-1]]
        return Breakdown(parts, attempts, causes, any(attempt.timed for attempt in trained))

    @staticmethod
    def _split(attempt: Attempt, span: float, own: dict[str, float]) -> None:
        """An attempt's time from its start of training to its last report, by the loop's `time/*` sums (scaled
        down to the span when they sum to more: the reports' times bound them)."""
        measured = sum(attempt.time.values())
        if measured <= 0:
            own["training"] += span
            return
        scale = min(1.0, span / measured)
        sums = {key: seconds * scale for key, seconds in attempt.time.items()}
        own["training"] += sums["time/compute_s"]
        for part in ("data", "eval", "checkpoint", "other"):
            own[part] += sums[f"time/{part}_s"]
        own["other"] += sums["time/comm_s"]  # the loop's exchanges outside the steps: a report's hand-off, ...
        own["other"] += max(0.0, span - measured * scale)  # between the windows: none when they tile the span

    @staticmethod
    def _step_time(attempt: Attempt, own: dict[str, float]) -> float:
        """The attempt's own training time per step it trained."""
        steps = (attempt.last_step or 0) - attempt.start_step
        return own["training"] / steps if steps > 0 else 0.0
