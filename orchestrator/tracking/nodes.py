"""Which node a run lost, when, and how many steps it trained again: told on the console and tagged on the run.

`NodeLossWatch` runs on the Ray Train controller. It knows which node each rank of the worker group runs on and
the newest step reported; when ranks fail, it asks Ray which of their nodes are gone (then, and for
`SUSPECT_S` after: Ray declares a node that stopped answering dead only once its health checks time out, by
default some 15 s later, possibly after the next worker group started elsewhere) and sends one `NodeLost` per
lost node through the report relay. The driver's writer (`orchestrator.tracking.writer`) completes it with the
checkpoint the restarted attempt resumed from (its first report says which; a loss told after that report
comes with it), then prints one line and tags the run:
`node_lost` (the newest loss, JSON), `node_losses` (every loss of the run, JSON list) and `steps_redone` (in
all). A rank that fails on a node that lives on (a crash, an out-of-memory kill) is no node loss.
"""

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import ray
from ray.train.v2._internal.execution.callback import ReportCallback, WorkerGroupCallback  # DeveloperAPI (Ray 2.60)

SUSPECT_S = 120.0
"""How long after its ranks failed a node is still watched for Ray to declare it dead."""

CHECK_EVERY_S = 1.0
"""How often, at most, Ray's node table is read while nodes are watched."""

NODE_LOSSES_TAG = "node_losses"
"""The run's tag listing every node loss: [{node_id, node_ip, ranks, at, last_step, resumed_from_step,
steps_redone}]."""


@dataclass
class NodeLost:
    """A node of the run's worker group that Ray declared dead while ranks on it failed."""

    node_id: str
    """Ray's node ID (hex)."""
    node_ip: str
    """The node's IP address."""
    ranks: list[int]
    """The ranks that ran on it."""
    at: float
    """When its ranks' failure was seen (wall clock, seconds)."""
    last_step: Optional[int] = None
    """The newest step reported before the loss (filled in on the driver)."""
    resumed_from_step: Optional[int] = None
    """The step of the checkpoint the restarted attempt resumed from (filled in on the driver)."""
    steps_redone: Optional[int] = None
    """Steps trained again: `last_step - resumed_from_step` (at least that many: steps after the newest report
    are not known on the driver; with `tracking.log_every_n_steps: 1`, exactly)."""

    def at_utc(self) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.at))

    def to_tag(self) -> dict[str, Any]:
        return {**asdict(self), "at": self.at_utc()}

    def complete(self, resumed_from_step: int) -> None:
        self.resumed_from_step = resumed_from_step
        self.steps_redone = max(0, (self.last_step or 0) - resumed_from_step)

    def describe(self) -> str:
        ranks = ", ".join(str(rank) for rank in self.ranks)
        said = (f"node {self.node_ip} (Ray node {self.node_id[:12]}) was lost at {self.at_utc()} with rank(s) "
                f"{ranks}")
        if self.last_step is not None:
            said += f", after step {self.last_step}"
        if self.resumed_from_step is None:
            return said + "; the restarted attempt reported nothing yet."
        return (f"{said}; training resumed from the checkpoint of step {self.resumed_from_step}: "
                f"{self.steps_redone} step(s) redone.")


def dead_nodes(node_ids) -> set[str]:
    """Which of `node_ids` Ray no longer counts alive (gone from its table, or marked dead)."""
    alive = {node["NodeID"] for node in ray.nodes() if node.get("Alive")}
    return {node_id for node_id in node_ids if node_id not in alive}


class NodeLossWatch(WorkerGroupCallback, ReportCallback):
    """On the controller: each lost node of the run's worker group, once, to the relay (`NodeLost`)."""

    def __init__(self, relay):
        self.relay = relay
        self.placement: dict[int, tuple[str, str]] = {}
        """rank -> (node ID, node IP) of the running worker group."""
        self.suspects: dict[str, tuple[NodeLost, float]] = {}
        """Nodes whose ranks failed and that Ray still counted alive then, with when they stop being watched."""
        self.newest_step: Optional[int] = None
        """The newest step reported by the failed worker group, and since."""
        self.resumed_from: Optional[int] = None
        """The step the running worker group resumed from, once its first report said so."""
        self.checked_at = 0.0

    def after_report(self, training_report, metrics: list[dict[str, Any]]) -> None:
        wire = metrics[0] if metrics else {}
        resumed = (wire.get("tags") or {}).get("resumed_from_step")
        if resumed is not None:
            self.resumed_from = int(resumed)
        elif isinstance(wire.get("step"), int) and wire["step"] > 0:
            self.newest_step = wire["step"]

    def after_worker_group_start(self, worker_group) -> None:
        self.resumed_from = None  # this group's resume is not reported yet
        self._tell(force=True)
        self.placement = {rank: (worker.metadata.node_id, worker.metadata.node_ip)
                          for rank, worker in enumerate(worker_group.get_workers())}

    def after_worker_group_poll_status(self, worker_group_status) -> None:
        if worker_group_status.errors and self.placement:
            # A rank on a lost node may not be the one that fails first (its peers' collectives fail with it):
            # every node of the failing group is checked.
            until = time.monotonic() + SUSPECT_S
            for rank, (node_id, node_ip) in sorted(self.placement.items()):
                lost, _ = self.suspects.setdefault(
                    node_id, (NodeLost(node_id, node_ip, [], time.time(), last_step=self.newest_step), until))
                lost.ranks = sorted({*lost.ranks, rank})
            self.placement = {}
            self.resumed_from = None  # the failed group's: the next group's resume is not reported yet
            self._tell(force=True)
        elif self.suspects:
            self._tell()

    def _tell(self, force: bool = False) -> None:
        if not self.suspects or (not force and time.monotonic() - self.checked_at < CHECK_EVERY_S):
            return
        self.checked_at = time.monotonic()
        try:
            dead = dead_nodes(self.suspects)
        except Exception:  # noqa: BLE001 - Ray's node table unreadable: nothing is said rather than a guess
            return
        for node_id, (lost, until) in list(self.suspects.items()):
            if node_id in dead:
                if self.resumed_from is not None:  # told late: the restarted attempt reported its resume already
                    lost.complete(self.resumed_from)
                self.relay.push.remote(lost)
            if node_id in dead or time.monotonic() > until:
                del self.suspects[node_id]


@dataclass
class NodeLosses:
    """On the driver: the losses told so far, each completed by the first report after it."""

    waiting: list[NodeLost] = field(default_factory=list)
    """Told, not yet followed by a resumed report."""
    done: list[NodeLost] = field(default_factory=list)

    def lost(self, lost: NodeLost, newest_step: Optional[int]) -> tuple[list[str], dict[str, str]]:
        """A loss relayed: the lines to print and the tags to set now (for a loss told after the restarted
        attempt's resume), else nothing until `resumed`."""
        if lost.last_step is None:
            lost.last_step = newest_step
        if lost.resumed_from_step is None:
            self.waiting.append(lost)
            return [], {}
        lost.complete(lost.resumed_from_step)
        return self._told([lost])

    def resumed(self, resumed_from_step: int) -> tuple[list[str], dict[str, str]]:
        """The restarted attempt's first report came: the lines to print and the tags to set."""
        if not self.waiting:
            return [], {}
        for lost in self.waiting:
            lost.complete(resumed_from_step)
        told, self.waiting = self.waiting, []
        return self._told(told)

    def _told(self, told: list[NodeLost]) -> tuple[list[str], dict[str, str]]:
        self.done += told
        # Several nodes lost at once cost the steps once.
        redone = sum(max(lost.steps_redone for lost in group) for group in _by_restart(self.done))
        tags = {"node_lost": json.dumps(told[-1].to_tag()),
                NODE_LOSSES_TAG: json.dumps([lost.to_tag() for lost in self.done]),
                "steps_redone": str(redone)}
        return [lost.describe() for lost in told], tags


def _by_restart(losses: list[NodeLost]) -> list[list[NodeLost]]:
    groups: dict[tuple, list[NodeLost]] = {}
    for lost in losses:
        groups.setdefault((lost.last_step, lost.resumed_from_step), []).append(lost)
    return list(groups.values())
