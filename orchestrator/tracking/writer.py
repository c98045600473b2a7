"""The driver's one writer to MLflow: every report logged once, in order, retried until MLflow takes it.

A thread drains the report relay every second and applies what it got to the run: metrics
(each metric at most once per step: repeats after a restart, or an epoch-end report at the step
of the report before it, are dropped; counters and values set once are summary tags until they change,
`orchestrator.tracking.summary_values`), every rank's system samples (each at its own time, at most
once), tags, JSON artifacts, and the merged overflow log. When
MLflow is down the records wait in memory (training never waits) and are backfilled, with their
original timestamps, once it answers again. With `tracking.required: false` the run itself may
be created late the same way. Everything goes through the run's `RunTracker`, which redacts it.
"""

import json
import logging
import sys
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

import ray

from orchestrator.errors import was_interrupted
from orchestrator.tracking.goodput import AttemptEnded, RunClock
from orchestrator.tracking.nodes import NodeLost, NodeLosses
from orchestrator.tracking.refusals import Refusals, describe
from orchestrator.tracking.summary_values import Held
from orchestrator.tracking.tables import RENDERED
from orchestrator.common.report import Report

logger = logging.getLogger("ampflow.tracking")

OVERFLOW_LOG = "amp/overflow_log.json"
"""The artifact holding every rank's skipped-step records, merged."""

LOGGED_EVERY_S = 2.0
"""How often, at most, the writer tells storage how far it has logged (`on_logged`)."""

RELAY_TIMEOUT_S = 30.0
"""How long one read of the report relay may take (a busy cluster answers slowly)."""


def retry(action: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Call `action` until it succeeds or `timeout_s` has passed (then raise its last error)."""
    deadline, delay, said = time.monotonic() + timeout_s, 0.5, False
    while True:
        try:
            return action()
        except Exception as exc:
            if time.monotonic() + delay > deadline:
                raise
            if not said:  # once: the refusals' summary counts the rest
                logger.warning("ampflow: %s failed (%s); retrying for up to %.0fs.", what, describe(exc), timeout_s)
                said = True
            time.sleep(delay)
            delay = min(delay * 2, 15.0)


class MlflowWriter:
    def __init__(self, relay, tracker=None, start_run: Optional[Callable[[], Any]] = None, poll_s: float = 1.0,
                 on_logged: Optional[Callable[[int], None]] = None, refusals: Optional[Refusals] = None):
        """`tracker`: the run's RunTracker, or None with `start_run` creating it once MLflow answers.
        `on_logged(seq)`: told (every few seconds, and at the end) the `seq` of the newest report MLflow has
        taken with all before it, so the workers stop keeping those for a resumed run to send again.
        `refusals`: where the writes MLflow refused and the records it never took are counted (the tracker's
        own, shared, by default)."""
        self.relay, self.tracker, self._start_run, self.poll_s = relay, tracker, start_run, poll_s
        self.refusals = refusals or (tracker.refusals if tracker is not None else Refusals())
        if tracker is not None:
            tracker.refusals = self.refusals
        self.on_logged, self.logged_seq, self._told_seq, self._told_at = on_logged, 0, 0, 0.0
        self.pending: deque[tuple[str, Any]] = deque()
        self.last_step: dict[str, int] = {}
        self.last_time: dict[str, int] = {}
        """Each system metric's newest logged timestamp (ms): its samples are logged once, by time."""
        self.held = Held()
        """The counters and set-once values not charted while they keep their first value."""
        self.overflow_log: list[dict[str, Any]] = []
        self.newest: dict[str, Any] = {}
        """The newest value of every plain (number or text) key reported so far: the console line reads it."""
        self.node_losses = NodeLosses()
        """The nodes the run lost (`orchestrator.tracking.nodes`), told once the restarted attempt reports."""
        self.clock = RunClock()
        """The run's attempts and where their time went (`orchestrator.tracking.goodput`); the driver sets when
        submit began."""
        self.printed: deque[str] = deque()
        """What the workers printed (`run.worker_output`), not yet shown on the console."""
        self.world_size: Optional[float] = None
        """The number of workers of the newest report (`system/world_size`): an elastic run's changes are told."""
        self.outage_since: Optional[float] = None
        self._retry_at, self._backoff = 0.0, 1.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ampflow-mlflow-writer", daemon=True)

    # -- lifecycle --------------------------------------------------------------------------------

    def resume_from_run(self) -> None:
        """Continue a run: its metrics' last steps and its overflow log, so nothing is logged twice."""
        self.last_step, self.last_time = self.tracker.metric_ends()
        self.held.resume(self.last_step, self.tracker.tags())
        self.overflow_log = self.tracker.load_json(OVERFLOW_LOG) or []

    def start(self) -> "MlflowWriter":
        self._thread.start()
        return self

    def close(self, timeout_s: float) -> int:
        """Stop the thread, take the last reports, and flush, each for up to `timeout_s`; returns records left
        unsent. Call it while Ray is up: the last reports are read from the relay."""
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout_s)
            if self._thread.is_alive():  # stuck in a call to MLflow or Ray: what it holds cannot be taken safely
                print(f"error: the MLflow writer did not stop within {timeout_s:g}s.", file=sys.stderr)
                return self._count_lost()
        try:
            self._drain(timeout_s=min(RELAY_TIMEOUT_S, timeout_s))
        except Exception as exc:  # the relay went down with the workers (an interrupt): log what was taken already
            logger.warning("ampflow: the last reports could not be read from the relay (%s).", exc)
        deadline = time.monotonic() + timeout_s
        while not self._flush(force=True) and time.monotonic() < deadline:
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
        self._tell_logged(force=True)
        return self._count_lost()

    def _count_lost(self) -> int:
        """Count what MLflow never took (`refusals.lost`: metric values, tags, artifacts); returns the records."""
        unsent = 0
        for kind, payload in list(self.pending):
            if kind in ("metrics", "system"):
                self.refusals.lose("metric values", len(payload[2]))
            elif kind == "tags":
                self.refusals.lose("tags", len(payload))
            elif kind != "logged":
                self.refusals.lose("artifacts")
            unsent += kind != "logged"
        return unsent

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self._drain()
            except Exception as exc:  # the relay is on this machine; a hiccup here must not kill the thread
                if not was_interrupted():  # after Ctrl-C or SIGTERM the relay goes down with the workers
                    logger.warning("ampflow: could not read reports from the relay (%s).", exc)
            self._flush()
            self._tell_logged()

    def _tell_logged(self, force: bool = False) -> None:
        if self.on_logged is None or self.logged_seq == self._told_seq:
            return
        if not force and time.monotonic() - self._told_at < LOGGED_EVERY_S:
            return
        try:
            self.on_logged(self.logged_seq)
            self._told_seq, self._told_at = self.logged_seq, time.monotonic()
        except Exception as exc:  # the workers then keep more reports than needed; nothing is lost
            logger.warning("ampflow: could not record how far the run is logged (%s).", exc)

    # -- reports -> records -----------------------------------------------------------------------

    def _drain(self, timeout_s: float = RELAY_TIMEOUT_S) -> None:
        if not ray.is_initialized():  # shut down: any Ray call would start a new local Ray (Ray's auto-init)
            raise RuntimeError("Ray is shut down")
        reports, lines = ray.get(self.relay.take.remote(), timeout=timeout_s)
        self.accept(reports)
        self.printed.extend(lines)

    def accept(self, taken: list) -> None:
        """What the relay held, in order: reports, the nodes lost between them (`NodeLost`) and the attempts the
        controller ended (`AttemptEnded`); every item is timed on the run's clock (`clock`)."""
        for item in taken:
            if isinstance(item, AttemptEnded):  # the controller restarts the worker group: only timed
                self.clock.ended(item)
            elif isinstance(item, NodeLost):  # the newest step before it, when the controller had none
                self.clock.node_lost(item.at)
                self._tell_node_losses(*self.node_losses.lost(item, self.newest.get("step")))
            else:
                self.clock.report(item)
                self._tell_resize(item)
                self.enqueue(item)

    def _tell_resize(self, report: Report) -> None:
        """A report from a worker group of another size than the last one's: an elastic run resized (the first
        report of a restarted attempt is the one it resumed from, sent again: the group before it)."""
        size = report.metrics.get("system/world_size")
        if size is None:
            return
        if self.world_size is not None and size != self.world_size:
            print(f"elastic: the run goes on with {int(size)} worker(s) (was {int(self.world_size)}) from step "
                  f"{report.step}, with the same global batch.", file=sys.stderr)
        self.world_size = size

    def _tell_node_losses(self, lines: list[str], tags: dict[str, str]) -> None:
        for line in lines:
            print(f"warning: {line}", file=sys.stderr)
        if tags:
            self.pending.append(("tags", tags))

    def take_printed(self) -> list[str]:
        """The lines the workers printed (`run.worker_output`) since the last call: the console shows them."""
        return [self.printed.popleft() for _ in range(len(self.printed))]

    def enqueue(self, report: Report) -> None:
        if "resumed_from_step" in report.tags:  # the first report of a restarted attempt: what a lost node cost
            self._tell_node_losses(*self.node_losses.resumed(int(report.tags["resumed_from_step"])))
        for resent in report.replay:  # a resumed run's reports the previous driver may have lost
            self.enqueue(resent)
        timestamp = int(time.time() * 1000)
        self.newest = {**self.newest, **report.progress()}
        metrics = {key: float(value) for key, value in report.metrics.items()}
        self.pending.append(("metrics", (report.step, timestamp, metrics)))
        for sample in report.system_samples:
            self.pending.append(("system", (int(sample["step"]), int(sample["t"]), sample["m"])))
        if report.tags:
            self.pending.append(("tags", report.tags))
        for name, value in report.tables.items():
            self.pending.append(("json", (f"{name}.json", value)))
            if name in RENDERED:  # a page the UI renders, beside the JSON
                path, render, summarize = RENDERED[name]
                self.pending.append(("text", (f"{path}.html", render(value))))
                if summarize is not None:
                    self.pending.append(("json", (f"{path}.json", summarize(value))))
        if report.overflow_records:
            self.pending.append(("overflow", report.overflow_records))
        for warning in report.warnings:
            print(f"warning: {warning}", file=sys.stderr)
            self.pending.append(("tags", {"warning.resume": warning}))
        # Last: the report counts as logged (and the workers may drop it) only once all of its records are in.
        self.pending.append(("logged", report.seq))

    # -- records -> MLflow ------------------------------------------------------------------------

    def _flush(self, force: bool = False) -> bool:
        """Apply pending records in order; True when nothing is left. Backs off while MLflow is down."""
        if not force and time.monotonic() < self._retry_at:
            return False
        try:
            if self.tracker is None and self._start_run is not None:
                self.tracker = self._start_run()
                self.tracker.refusals = self.refusals
                logger.info(f"MLflow is reachable: created run {self.tracker.run_id}; backfilling.")
            while self.pending and self.tracker is not None:
                self._apply(*self.pending[0])
                self.pending.popleft()
        except Exception as exc:
            if self.outage_since is None:
                self.outage_since = time.monotonic()
                print(f"warning: MLflow is not answering ({describe(exc)}); training goes on and metrics are "
                      "kept to be logged when it is back.", file=sys.stderr)
            self._retry_at, self._backoff = time.monotonic() + self._backoff, min(self._backoff * 2, 30.0)
            return False
        if self.outage_since is not None:
            logger.info(f"MLflow is back after {time.monotonic() - self.outage_since:.0f}s; the metrics held "
                        "meanwhile are logged.")
            self.outage_since, self._backoff = None, 1.0
        return not self.pending

    def _apply(self, kind: str, payload: Any) -> None:
        if kind == "metrics":
            step, timestamp, metrics = payload
            self.refusals.step = step
            fresh = {key: value for key, value in metrics.items() if step > self.last_step.get(key, -1)}
            held = self.held.copy()
            try:
                for at_step, at_time, batch in self.held.split(step, timestamp, fresh):
                    self.tracker.log_metrics(batch, at_step, timestamp_ms=at_time)
                if self.held.untagged():
                    self.tracker.set_tags(self.held.untagged())
                for key in self.held.stale():
                    self.tracker.delete_tag(key)
            except Exception:  # retried as a whole: the held values as they were
                self.held = held
                raise
            self.held.tagged = (self.held.tagged | set(self.held.constants())) - self.held.moved
            self.last_step.update(dict.fromkeys(fresh, step))
        elif kind == "logged":
            self.logged_seq = max(self.logged_seq, payload)
        elif kind == "system":
            step, timestamp, metrics = payload
            fresh = {key: value for key, value in metrics.items() if timestamp > self.last_time.get(key, -1)}
            if fresh:
                self.tracker.log_metrics(fresh, step, timestamp_ms=timestamp)
            self.last_time.update(dict.fromkeys(fresh, timestamp))
        elif kind == "tags":
            self.tracker.set_tags(payload)
        elif kind == "json":
            path, value = payload
            self.tracker.log_dict(value, path)
        elif kind == "text":
            path, text = payload
            self.tracker.log_text(text, path)
        elif kind == "overflow":
            known = {json.dumps(record, sort_keys=True) for record in self.overflow_log}
            fresh = [record for record in payload if json.dumps(record, sort_keys=True) not in known]
            if not fresh:  # all sent again by a resumed run, and logged already
                return
            # By step, then rank; a collapse comes after the overflows of its step, which caused it.
            merged = sorted(self.overflow_log + fresh,
                            key=lambda r: (r["step"], r.get("event") == "collapse", r.get("rank", -1)))
            self.tracker.log_dict(merged, OVERFLOW_LOG)
            self.overflow_log = merged
