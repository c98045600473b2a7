"""On a Ray cluster of several nodes: a node lost mid-epoch costs the steps since the last checkpoint, in the same
MLflow run, and the console and the run say which node went, when, and how many steps were trained again.

The cluster is `ray.cluster_utils.Cluster` on this machine: a head without CPUs (the driver's relay and Ray Train's
controller live there) and three nodes of one CPU each, in the test's own Ray temp dir. `submit --address` runs as
a process of its own; the test removes the node of a rank (SIGKILL of its processes, as a lost spot node) while
that rank waits at a step, then stops exactly the nodes it started.
"""

import json
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

import pytest

from conftest import REPO, drill, own_ray_env, small_job
from test_resume_e2e import each_step_once
from test_submit_e2e import only_run

pytestmark = pytest.mark.slow

# Ray declares a node whose raylet stopped answering dead after its health checks fail: ~3 s here (15 s and more
# by default), so that the loss is known before the restarted worker group starts.
FAST_NODE_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000,
                   "health_check_timeout_ms": 1000, "health_check_failure_threshold": 2}


@contextmanager
def submitted_to_cluster(tmp_path, ray_tmpdir, job, nodes: int) -> Iterator[tuple[Any, subprocess.Popen]]:
    """A `ray.cluster_utils.Cluster` (a head without CPUs, `nodes` nodes of one CPU, fast node-death checks) in the
    test's Ray temp dir, and `submit JOB --address` to it writing to `tmp_path/console.txt`; (cluster, driver).
    Afterwards the driver is killed if it still runs, and exactly the cluster's nodes are stopped."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "temp_dir": str(ray_tmpdir / "ray"), "include_dashboard": False,  # no port 8265 to share
        "_system_config": FAST_NODE_DEATH})
    driver = None
    try:
        for _ in range(nodes):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        with open(tmp_path / "console.txt", "w") as console:
            driver = subprocess.Popen(
                [sys.executable, "-m", "orchestrator.submit", str(job), "--address", cluster.address],
                cwd=tmp_path, env=own_ray_env(ray_tmpdir, PYTHONPATH=f"{REPO}:{REPO / 'tests'}"),
                stdout=console, stderr=subprocess.STDOUT)
        yield cluster, driver
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
            driver.wait(timeout=30)
        cluster.shutdown()


def wait_for(path, process, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert process.poll() is None, f"submit ended (rc {process.returncode}) before the drill's step"
        assert time.monotonic() < deadline, f"the drill's step was not reached within {timeout_s:.0f} s"
        time.sleep(0.2)
    return path.read_text().strip()


def wait_for_step(uri: str, experiment: str, step: int, process, timeout_s: float) -> None:
    from mlflow import MlflowClient

    client, deadline = MlflowClient(tracking_uri=uri), time.monotonic() + timeout_s
    while True:
        experiment_found = client.get_experiment_by_name(experiment)
        runs = client.search_runs([experiment_found.experiment_id]) if experiment_found else []
        if runs and any(m.step >= step for m in client.get_metric_history(runs[0].info.run_id, "train/loss")):
            return
        assert process.poll() is None, f"submit ended (rc {process.returncode})"
        assert time.monotonic() < deadline, f"step {step} was not logged within {timeout_s:.0f} s"
        time.sleep(0.5)


def test_a_node_lost_mid_epoch_resumes_in_the_same_run_and_says_which_node_and_what_it_cost(
        tmp_path, monkeypatch, ray_tmpdir, write_job, new_store):
    """Rank 1's node is removed at step 7 (checkpoints every 4 steps, a report every step): the run restarts from
    step 4's checkpoint on the nodes left, ends FINISHED with every step logged once, its tags name the lost node,
    its rank and the 2 steps redone, the console says the same, and Ray's raylet state dumps stay off it.

    Long: a four-node Ray cluster starts on this machine, and the run trains twice from step 4."""
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmpdir))
    uri = new_store(tmp_path)
    marker = tmp_path / "node_of_rank_1"
    job = write_job(small_job(
        run={"epochs": 1, "max_steps_per_epoch": 8},
        tracking={"log_every_n_steps": 1, "uri": uri, "experiment": "node-loss"},
        checkpoint={"every_n_steps": 4, "storage_path": str(tmp_path / "storage")},
        failure={"max_failures": 1},
        callbacks=[drill("AwaitNodeLoss", rank=1, at_step=7, marker=str(marker))]))
    with submitted_to_cluster(tmp_path, ray_tmpdir, job, nodes=3) as (cluster, driver):
        node_id = wait_for(marker, driver, timeout_s=240)
        # The driver has step 6's report before the node goes (else it knows of 5 steps trained, and counts 1 redone)
        wait_for_step(uri, "node-loss", 6, driver, timeout_s=60)
        (node,) = [node for node in cluster.worker_nodes if node.node_id == node_id]
        lost_at = time.time()
        cluster.remove_node(node, allow_graceful=False)
        assert driver.wait(timeout=300) == 0, (tmp_path / "console.txt").read_text()[-4000:]

    output = (tmp_path / "console.txt").read_text()
    assert "[state-dump]" not in output, output[-4000:]
    assert "Raylet is terminated" not in output and "has been marked dead" not in output
    client, run = only_run(uri, "node-loss")
    assert run.info.status == "FINISHED" and run.data.tags["resumed_from_step"] == "4"
    assert each_step_once(client, run.info.run_id, "train/loss") == list(range(1, 9))
    lost = json.loads(run.data.tags["node_lost"])
    assert lost["node_id"] == node_id and lost["node_ip"] == node.node_ip_address and lost["ranks"] == [1]
    assert lost["last_step"] == 6 and lost["resumed_from_step"] == 4 and lost["steps_redone"] == 2
    assert run.data.tags["steps_redone"] == "2"
    assert json.loads(run.data.tags["node_losses"]) == [lost]
    seen = time.mktime(time.strptime(lost["at"], "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
    assert lost_at - 2 <= seen <= lost_at + 60
    assert (f"node {node.node_ip_address} (Ray node {node_id[:12]}) was lost at {lost['at']} with rank(s) 1, after "
            "step 6; training resumed from the checkpoint of step 4: 2 step(s) redone.") in output
