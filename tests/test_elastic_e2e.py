"""An elastic run on a Ray cluster whose nodes come and go: it starts with the one node there is, grows when a
second joins and shrinks when one is lost, each time going on from its newest checkpoint with the same global
batch; each epoch trains every sample once, and MLflow shows the world size over the steps.

The cluster is `ray.cluster_utils.Cluster` on this machine, as in tests/test_cluster_e2e.py: a head without CPUs
(the driver's relay and Ray Train's controller) and nodes of one CPU each, one worker fitting on each.
"""

import json
import re
from pathlib import Path

import pytest

from conftest import drill, small_job
from indexed_data import trained_steps
from test_cluster_e2e import submitted_to_cluster, wait_for, wait_for_step
from test_resume_e2e import each_step_once
from test_submit_e2e import only_run

pytestmark = pytest.mark.slow

TRAIN_SAMPLES = 96  # batches of 8 on [1, 2] workers: a step is 16 samples, 6 steps an epoch


def test_an_elastic_run_grows_when_a_node_joins_shrinks_when_one_is_lost_and_trains_each_sample_once_an_epoch(
        tmp_path, monkeypatch, ray_tmpdir, write_job, new_store):
    """One node at first: the run starts on one worker. At step 3 (checkpoint of step 2) a node joins, and the run
    goes on from step 2 on two workers. At step 5 (checkpoint of step 4, mid-epoch: 6 steps an epoch) rank 1's node
    is removed, and the run goes on from step 4 on one worker. Every step is logged once, `system/world_size` goes
    1, 2, 1, each epoch's samples are each trained once by the attempts that kept them, and the run is FINISHED.

    Long: a Ray cluster starts on this machine, nodes join and leave, and the worker group starts three times."""
    from mlflow import MlflowClient

    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmpdir))
    uri = new_store(tmp_path)
    grown, lost = tmp_path / "grown_at", tmp_path / "node_of_rank_1"
    job = write_job(small_job(
        data={"name": "indexed_data:digits_with_ids", "kwargs": {"train_samples": TRAIN_SAMPLES}},
        scaling={"num_workers": [1, 2], "resize_check_s": 1},
        run={"epochs": 2, "batch_size": 8, "max_steps_per_epoch": None},
        tracking={"log_every_n_steps": 1, "uri": uri, "experiment": "elastic"},
        checkpoint={"every_n_steps": 2, "storage_path": str(tmp_path / "storage")},
        failure={"max_failures": 1},
        callbacks=[drill("AwaitResize", world_size=1, at_step=3, marker=str(grown)),
                   drill("AwaitNodeLoss", rank=1, at_step=5, marker=str(lost)),
                   {"name": "indexed_data:RecordSamples", "kwargs": {"path": str(tmp_path / "samples")}}]))
    with submitted_to_cluster(tmp_path, ray_tmpdir, job, nodes=1) as (cluster, driver):
        wait_for(grown, driver, timeout_s=240)
        cluster.add_node(num_cpus=1)
        node_id = wait_for(lost, driver, timeout_s=240)
        # Ray Train has step 4's report before the node goes (else it knows of 3 steps trained when it tells the loss)
        wait_for_step(uri, "elastic", 4, driver, timeout_s=60)
        (node,) = [node for node in cluster.worker_nodes if node.node_id == node_id]
        cluster.remove_node(node, allow_graceful=False)
        assert driver.wait(timeout=300) == 0, (tmp_path / "console.txt").read_text()[-4000:]

    output = (tmp_path / "console.txt").read_text()
    client, run = only_run(uri, "elastic")
    assert run.info.status == "FINISHED", output[-4000:]
    assert "elastic: the run goes on with 2 worker(s) (was 1) from step 3, with the same global batch." in output
    assert "elastic: the run goes on with 1 worker(s) (was 2) from step 5, with the same global batch." in output
    assert ("with rank(s) 1, after step 4; training resumed from the checkpoint of step 4: 0 step(s) redone."
            in output), output[-4000:]
    assert each_step_once(client, run.info.run_id, "train/loss") == list(range(1, 13))
    world = {m.step: m.value for m in MlflowClient(uri).get_metric_history(run.info.run_id, "system/world_size")}
    assert [world[step] for step in range(1, 13)] == [1, 1, 2, 2] + [1] * 8, world

    # The run's goodput: three attempts, the first ended by the resize, the second by the node loss.
    breakdown = json.loads(Path(client.download_artifacts(run.info.run_id, "perf/time_breakdown.json")).read_text())
    assert [(a["ended_by"], a["resumed_from_step"], a["world_size"]) for a in breakdown["attempts"]] == \
        [("elastic resize", None, 1), ("node loss", 2, 2), (None, 4, 1)], breakdown["attempts"]
    assert breakdown["restart_causes"] == ["elastic resize", "node loss"]
    assert sum(breakdown["parts_s"].values()) == pytest.approx(run.data.metrics["goodput/wall_s"])
    assert run.data.metrics["goodput/restarts_s"] > 0
    assert re.search(r"^  time: .*restarts after an elastic resize and a node loss", output, re.M), output[-2000:]

    steps = trained_steps(tmp_path / "samples")
    assert list(steps) == list(range(1, 13))
    assert [len(steps[step]) for step in steps] == [1, 1, 2, 2] + [1] * 8  # ranks that trained each step
    for epoch in (0, 1):
        ids = sorted(i for records in steps.values() for r in records if r["epoch"] == epoch
                     for micro_batch in r["ids"] for i in micro_batch)
        assert ids == list(range(TRAIN_SAMPLES)), epoch
