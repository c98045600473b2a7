"""Which node a run lost, when, and how many steps it trained again: told on the console and tagged on the run.

`NodeLossWatch` runs on the Ray Train controller. It knows which node each rank of the worker group runs on;
when ranks fail, it asks Ray which of their nodes are gone (then, or once the next worker group has started:
Ray may take a few seconds to declare a node dead) and sends one `NodeLost` per lost node through the report
relay, in order with the reports. The driver's writer (`orchestrator.tracking.writer`) holds it until the restarted
attempt's first report says which checkpoint it resumed from, then prints one line and tags the run:
`node_lost` (the newest loss, JSON), `node_losses` (every loss of the run, JSON list) and `steps_redone` (in
all). A rank that fails on a node that lives on (a crash, an out-of-memory kill) is no node loss. A node Ray
declares dead only after the next worker group started elsewhere (its health checks time out: by default about
15 s after the node stopped answering) is not told.
"""

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import ray
from ray.train.v2._internal.execution.callback import WorkerGroupCallback  # DeveloperAPI (Ray 2.60)

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


class NodeLossWatch(WorkerGroupCallback):
    """On the controller: each lost node of the run's worker group, once, to the relay (`NodeLost`)."""

    def __init__(self, relay):
        self.relay = relay
        self.placement: dict[int, tuple[str, str]] = {}
        """rank -> (node ID, node IP) of the running worker group."""
        self.suspects: dict[str, NodeLost] = {}
        """Nodes whose ranks failed and that Ray still counted alive when they did."""

    def after_worker_group_start(self, worker_group) -> None:
        self._tell(list(self.suspects.values()))  # Ray has declared them dead meanwhile, or they live on
        self.suspects = {}
        self.placement = {rank: (worker.metadata.node_id, worker.metadata.node_ip)
                          for rank, worker in enumerate(worker_group.get_workers())}

    def after_worker_group_poll_status(self, worker_group_status) -> None:
        if not worker_group_status.errors or not self.placement:
            return
        # A rank on a lost node may not be the one that fails first (its peers' collectives fail with it): every
        # node of the failing group is checked.
        for rank, (node_id, node_ip) in sorted(self.placement.items()):
            lost = self.suspects.setdefault(node_id, NodeLost(node_id, node_ip, [], time.time()))
            lost.ranks = sorted({*lost.ranks, rank})
        self.placement = {}
        self._tell(list(self.suspects.values()))

    def _tell(self, candidates: list[NodeLost]) -> None:
        if not candidates:
            return
        try:
            dead = dead_nodes(lost.node_id for lost in candidates)
        except Exception:  # noqa: BLE001 - Ray's node table unreadable: nothing is said rather than a guess
            return
        for lost in candidates:
            if lost.node_id in dead:
                self.suspects.pop(lost.node_id, None)
                self.relay.push.remote(lost)


@dataclass
class NodeLosses:
    """On the driver: the losses told so far, each completed by the first report after it."""

    waiting: list[NodeLost] = field(default_factory=list)
    """Told, not yet followed by a resumed report."""
    done: list[NodeLost] = field(default_factory=list)

    def lost(self, lost: NodeLost, newest_step: Optional[int]) -> None:
        lost.last_step = newest_step
        self.waiting.append(lost)

    def resumed(self, resumed_from_step: int) -> tuple[list[str], dict[str, str]]:
        """The restarted attempt's first report came: the lines to print and the tags to set."""
        if not self.waiting:
            return [], {}
        for lost in self.waiting:
            lost.resumed_from_step = resumed_from_step
            lost.steps_redone = max(0, (lost.last_step or 0) - resumed_from_step)
        # Several nodes lost at once cost the steps once.
        told, self.waiting = self.waiting, []
        self.done += told
        newest = told[-1]
        redone = sum(max(lost.steps_redone for lost in group) for group in _by_restart(self.done))
        tags = {"node_lost": json.dumps(newest.to_tag()),
                NODE_LOSSES_TAG: json.dumps([lost.to_tag() for lost in self.done]),
                "steps_redone": str(redone)}
        return [lost.describe() for lost in told], tags


def _by_restart(losses: list[NodeLost]) -> list[list[NodeLost]]:
    groups: dict[tuple, list[NodeLost]] = {}
    for lost in losses:
        groups.setdefault((lost.last_step, lost.resumed_from_step), []).append(lost)
    return list(groups.values())
