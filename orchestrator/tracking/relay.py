"""From the Ray Train controller to the driver: every report, in order.

`RelayCallback` runs on the controller and only forwards (a non-blocking actor call), so a slow
or unreachable MLflow can never hold up training; the driver drains the relay and does all MLflow
I/O (`orchestrator.tracking.writer`). What the user's code prints on the workers comes the same way
(`forwarded_output`), for the driver's console. Workers never talk to MLflow, and a restarted worker group
reports into the same relay, hence the same run.
"""

import contextlib
import io
import logging
import sys
from typing import Any, TextIO

import ray
from ray.train import UserCallback

from orchestrator.common.report import Report


@ray.remote(num_cpus=0)
class ReportRelay:
    def __init__(self) -> None:
        self.queue: list[Report] = []
        self.lines: list[str] = []

    def push(self, report) -> None:
        """A report (`Report`), a node the run lost between two (`orchestrator.tracking.nodes.NodeLost`), or an
        attempt the controller ended (`orchestrator.tracking.goodput.AttemptEnded`)."""
        self.queue.append(report)

    def write(self, lines: list[str]) -> None:
        """Lines the user's code printed on a worker (`RankOutput`), already prefixed by rank."""
        self.lines.extend(lines)

    def take(self) -> tuple[list[Report], list[str]]:
        """(the reports, the printed lines) since the last call."""
        queue, lines, self.queue, self.lines = self.queue, self.lines, [], []
        return queue, lines


def start_relay():
    """The run's relay, on the driver's node, where Ray Train puts its controller: on a cluster, a relay placed on
    a worker node (where Ray may place an actor that needs no CPU) would be lost with that node, and with it the
    run's reports."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ReportRelay.options(scheduling_strategy=here).remote()


class RankOutput(io.TextIOBase):
    """A worker's sys.stdout / sys.stderr while `run.worker_output` forwards its rank: every complete line goes
    to the relay as `[rank R] line` (no wait: a remote call returns at once) and to the stream it replaces,
    which Ray keeps in the worker's log file.

    Writes from `logging` handlers are passed through only: Ray Train's own log lines (and Ray's worker stdout
    capture, which logs what is printed and so comes back here) stay in the worker's logs, and a printed line
    reaches the console once."""

    def __init__(self, relay, rank: int, replaced: TextIO):
        self.relay, self.prefix, self.replaced = relay, f"[rank {rank}] ", replaced
        self._partial = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.replaced.write(text)
        if sys._getframe(1).f_code.co_filename == logging.__file__:  # a log handler, not the user's print
            return len(text)
        *complete, self._partial = (self._partial + text).split("\n")
        if complete:
            self.relay.write.remote([self.prefix + line for line in complete])
        return len(text)

    def flush(self) -> None:
        self.replaced.flush()

    def close_line(self) -> None:
        """Send what is left of an unfinished last line."""
        if self._partial:
            self.relay.write.remote([self.prefix + self._partial])
            self._partial = ""


@contextlib.contextmanager
def forwarded_output(relay, rank: int, which: str):
    """Forward what the code inside prints (stdout and stderr) when `which` (`run.worker_output`: rank0 | all |
    none) covers this rank."""
    if relay is None or which == "none" or (which == "rank0" and rank != 0):
        yield
        return
    outputs = RankOutput(relay, rank, sys.stdout), RankOutput(relay, rank, sys.stderr)
    with contextlib.redirect_stdout(outputs[0]), contextlib.redirect_stderr(outputs[1]):
        try:
            yield
        finally:
            for output in outputs:
                output.close_line()


class RelayCallback(UserCallback):
    """Forwards each report merged over the ranks: rank 0's (its metrics are already reduced over all ranks)
    with every rank's system samples and overflow records."""

    def __init__(self, relay):
        self.relay = relay

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        self.relay.push.remote(Report.merged([Report.from_wire(wire) for wire in metrics]))
