"""What a lost node cost, as the driver tells it: the console line and the run's tags, from the reports and the
losses the controller relays in order (`orchestrator.tracking.nodes`), on a real SQLite MLflow store without Ray;
and Ray's node-death reports (the dead raylet's `[state-dump]` lines) kept off the console."""

import json

import pytest

from conftest import small_job
from orchestrator.config import load_job
from orchestrator.tracking.nodes import NodeLost
from orchestrator.tracking.tracker import RunTracker
from orchestrator.tracking.writer import MlflowWriter
from orchestrator.common.report import Report


@pytest.fixture
def tracker(write_job, mlflow_uri):
    cfg = load_job(write_job(small_job(tracking={"uri": mlflow_uri, "experiment": "nodes"})))
    return RunTracker.start(mlflow_uri, cfg, run_name="nodes", tags={}, params={}, config_yaml="a: 1\n")


def test_each_lost_node_is_told_once_the_restarted_attempt_reports_with_the_steps_it_redoes(tracker, capsys):
    writer = MlflowWriter(relay=None, tracker=tracker)
    # Two nodes lost at once after step 6 (checkpoint of step 4), then one more after step 11 (checkpoint of 8).
    writer.accept([Report(seq=1, step=5, metrics={"train/loss": 0.5}),
                   Report(seq=2, step=6, metrics={"train/loss": 0.4}),
                   NodeLost("a" * 56, "10.0.0.2", [1], 1_790_000_000.0),
                   NodeLost("b" * 56, "10.0.0.3", [2, 3], 1_790_000_000.5)])
    assert "lost" not in capsys.readouterr().err  # told with what it cost, once the run goes on
    writer.accept([Report(seq=2, step=4, tags={"resumed_from_step": "4"}), Report(seq=3, step=11),
                   NodeLost("c" * 56, "10.0.0.4", [0], 1_790_000_100.0),
                   Report(seq=4, step=8, tags={"resumed_from_step": "8"})])
    # Ray declared a node dead only after the restarted attempt had reported its resume: the controller says
    # which step the loss came after and which checkpoint the restart took; it is told at once.
    writer.accept([Report(seq=5, step=13), Report(seq=6, step=12, tags={"resumed_from_step": "12"}),
                   NodeLost("d" * 56, "10.0.0.5", [1], 1_790_000_200.0, last_step=14, resumed_from_step=12)])
    assert writer._flush(force=True)

    err = capsys.readouterr().err
    assert ("warning: node 10.0.0.2 (Ray node aaaaaaaaaaaa) was lost at 2026-09-21T14:13:20Z with rank(s) 1, after "
            "step 6; training resumed from the checkpoint of step 4: 2 step(s) redone.") in err
    assert "node 10.0.0.3 (Ray node bbbbbbbbbbbb) was lost at 2026-09-21T14:13:20Z with rank(s) 2, 3, after step 6" \
        in err
    assert "after step 11; training resumed from the checkpoint of step 8: 3 step(s) redone." in err
    assert "node 10.0.0.5 (Ray node dddddddddddd) was lost at 2026-09-21T14:16:40Z with rank(s) 1, after step 14; " \
           "training resumed from the checkpoint of step 12: 2 step(s) redone." in err
    tags = tracker.tags()
    losses = json.loads(tags["node_losses"])
    assert [(lost["node_ip"], lost["last_step"], lost["resumed_from_step"], lost["steps_redone"]) for lost in losses] \
        == [("10.0.0.2", 6, 4, 2), ("10.0.0.3", 6, 4, 2), ("10.0.0.4", 11, 8, 3), ("10.0.0.5", 14, 12, 2)]
    assert json.loads(tags["node_lost"]) == losses[-1]
    assert tags["steps_redone"] == "7"  # the two nodes lost together cost the steps once


def test_ray_reports_of_a_dead_node_stay_off_the_console_and_others_are_printed(monkeypatch, capsys, caplog):
    import ray._private.worker as ray_worker

    from orchestrator.runner.ray_start import keep_raylet_dumps_off_console

    monkeypatch.setattr(ray_worker, "print_to_stdstream", ray_worker.print_to_stdstream)  # put back after
    keep_raylet_dumps_off_console()
    keep_raylet_dumps_off_console()  # once is enough: a second call does not wrap it again
    dump = ("Raylet is terminated. Termination is unexpected. Possible reasons include: ... Last 20 lines of the "
            "Raylet logs:\n    [2026-11-28 00:47:53,001 I 1 1] (raylet) [state-dump] NodeManager:\n    [state-dump] "
            "Node ID: 0495\n")
    dead = "The node with node id: 0495 and address: 10.0.0.2 and node name: 10.0.0.2 has been marked dead because"
    with caplog.at_level("DEBUG", logger="ray"):
        for message in (dump, dead, "A worker died or was killed while executing a task."):
            ray_worker.print_to_stdstream({"lines": [message], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    out = capsys.readouterr().out
    assert "[state-dump]" not in out and "marked dead" not in out
    assert "A worker died or was killed while executing a task." in out
    assert "[state-dump] Node ID: 0495" in caplog.text  # in Ray's log, not lost


def test_a_loss_after_an_earlier_restart_waits_for_its_own_restart_s_resume(monkeypatch):
    """The controller's watch: a worker group that resumed from step 2 (an elastic grow, a crash) later loses a node.
    The loss goes to the relay without a resume (the driver completes it with the next group's first report), never
    with the failed group's step 2."""
    from types import SimpleNamespace

    from orchestrator.tracking import nodes

    pushed = []
    relay = SimpleNamespace(push=SimpleNamespace(remote=pushed.append))
    worker = lambda node: SimpleNamespace(metadata=SimpleNamespace(node_id=node, node_ip="10.0.0.9"))  # noqa: E731
    monkeypatch.setattr(nodes, "dead_nodes", lambda suspects: {"lost-node"} & set(suspects))
    watch = nodes.NodeLossWatch(relay)
    watch.after_worker_group_start(SimpleNamespace(get_workers=lambda: [worker("kept-node"), worker("lost-node")]))
    watch.after_report(None, [{"tags": {"resumed_from_step": "2"}, "step": 2}])
    watch.after_report(None, [{"step": 6}])
    watch.after_worker_group_poll_status(SimpleNamespace(errors={1: RuntimeError("gone")}))
    (lost,) = pushed
    assert (lost.node_id, lost.ranks, lost.last_step, lost.resumed_from_step) == ("lost-node", [1], 6, None)
