""""Local" means local, and a cluster that does not answer is waited for within a bound, interruptibly.

Without `--address` and `$RAY_ADDRESS`, submit, sweep and `run()` start a Ray of their own: a
`ray_current_cluster` file that a `ray start` left in Ray's temp dir, naming a cluster long gone, is never
joined (submit, end to end; sweep and `run()` give `ray.init` the same "local"). A cluster named explicitly is
waited for at most `ray_start.CLUSTER_WAIT_S`; `run()` then returns a FAILED result, and Ctrl-C or SIGTERM end the
wait at once (the run KILLED). Each process case has Ray's temp dir (`RAY_TMPDIR`) of its own, so the Ray it
starts shares nothing with any other. A Ray of submit's own runs no actor a single node has no use for.
"""

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from conftest import own_ray_env, ray_actor_names, ray_sessions, small_job
from ray_head import free_ports

STALE_CLUSTER = "192.0.2.2:36943"  # TEST-NET-1: nothing answers there, ever


@pytest.fixture
def stale_ray_tmpdir(ray_tmpdir):
    """Ray's temp dir for the case's processes, holding a `ray_current_cluster` that names a cluster long gone."""
    (ray_tmpdir / "ray" / "ray_current_cluster").write_text(STALE_CLUSTER)
    return ray_tmpdir


def tiny_job(workdir: Path, experiment: str) -> Path:
    job = workdir / "job.yaml"
    job.write_text(yaml.safe_dump(small_job(
        precision={"preset": "O0"}, scaling={"num_workers": 1}, run={"epochs": 1, "max_steps_per_epoch": 2},
        tracking={"uri": f"sqlite:///{workdir / 'mlflow.db'}", "experiment": experiment})))
    return job


def statuses(workdir: Path) -> list[str]:
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    return sorted(run.info.status for run in client.search_runs(
        [e.experiment_id for e in client.search_experiments()]))


@pytest.mark.slow
def test_without_an_address_a_stale_current_cluster_file_is_never_joined(stale_ray_tmpdir, tmp_path):
    """Without an address, a `ray_current_cluster` naming a cluster long gone is never joined: submit starts a Ray
    of its own and finishes, without a preemption watcher or a dataset manager.

    Long: what is tested is that Ray's own start in Ray's temp dir, so it cannot use the tests' shared head."""
    job = tiny_job(tmp_path, "local")
    try:
        done = subprocess.run([sys.executable, "-m", "orchestrator.submit", str(job)], cwd=tmp_path,
                              env=own_ray_env(stale_ray_tmpdir), capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"submit did not finish in 300 s (joining {STALE_CLUSTER}?): {exc.stderr}")
    assert done.returncode == 0, done.stderr
    assert STALE_CLUSTER not in done.stdout + done.stderr
    assert len(ray_sessions(stale_ray_tmpdir)) == 1, "it started a Ray of its own, in Ray's temp dir"
    assert set(statuses(tmp_path)) == {"FINISHED"}
    # On a Ray of its own (one node, which nothing drains) and without Ray Datasets, Ray Train starts neither its
    # preemption watcher nor its dataset manager: a process each, for nothing.
    actors = ray_actor_names(stale_ray_tmpdir)
    assert {"TrainController", "RayTrainWorker", "ReportRelay"} <= actors, actors
    assert not actors & {"PreemptionWatcher", "DatasetManager"}, actors


class RayInitCalled(Exception):
    pass


@pytest.mark.parametrize("command", ["sweep", "run"])
def test_sweep_and_run_start_ray_as_submit_does(command, tmp_path, monkeypatch):
    """Without an address, sweep and `run()` give `ray.init` "local" as submit does (whose start beside a stale
    `ray_current_cluster` the test above runs), never None or "auto"."""
    import ray

    from orchestrator import run
    from orchestrator.cli.sweep import main as sweep

    calls = []

    def init(*args, **kwargs):
        calls.append(kwargs.get("address", args[0] if args else None))
        raise RayInitCalled()

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    job = tiny_job(tmp_path, "local")
    monkeypatch.chdir(tmp_path)
    if command == "sweep":
        assert sweep([str(job), "--presets", "O0"]) == 1
    else:
        assert run(str(job)).status == "FAILED"
    assert calls == ["local"]


UNANSWERED_FROM_PYTHON = textwrap.dedent("""
    import sys, time
    from orchestrator import run
    from orchestrator.runner import ray_start

    ray_start.CLUSTER_WAIT_S = 5
    began = time.monotonic()
    result = run(sys.argv[1], address=sys.argv[2])
    print("RESULT", None if result is None else result.status, round(time.monotonic() - began))
    print("ERROR", None if result is None else result.error)
""")


def test_run_returns_a_failed_result_once_the_wait_for_an_unanswering_cluster_ends(ray_tmpdir, tmp_path):
    address = f"127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
    job = tiny_job(tmp_path, "unanswered")
    done = subprocess.run([sys.executable, "-c", UNANSWERED_FROM_PYTHON, str(job), address], cwd=tmp_path,
                          env=own_ray_env(ray_tmpdir), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("RESULT", "ERROR")))
    status, seconds = result["RESULT"].split()
    assert status == "FAILED", done.stdout + done.stderr
    assert f"no Ray cluster answered at {address} within 5 s" in result["ERROR"]
    assert int(seconds) < 60
    assert statuses(tmp_path) == ["FAILED"]
    assert ray_sessions(ray_tmpdir) == [], "no Ray was started in its place"


@pytest.mark.parametrize("signum, exit_code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_the_wait_for_a_cluster_at_once(signum, exit_code, ray_tmpdir, tmp_path):
    job = tiny_job(tmp_path, "waiting")
    MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}").create_experiment("waiting")  # no store to create
    with open(tmp_path / "stderr.txt", "w") as stderr:
        driver = subprocess.Popen([sys.executable, "-m", "orchestrator.submit", str(job), "--address", STALE_CLUSTER],
                                  cwd=tmp_path, env=own_ray_env(ray_tmpdir), stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 180
        while not statuses(tmp_path):  # the run exists: the driver is waiting for the cluster
            assert driver.poll() is None, (tmp_path / "stderr.txt").read_text()
            assert time.monotonic() < deadline, "the run was never created"
            time.sleep(0.5)
        time.sleep(2)
        assert driver.poll() is None, (tmp_path / "stderr.txt").read_text()
        driver.send_signal(signum)
        sent = time.monotonic()
        returncode = driver.wait(timeout=60)
        waited = time.monotonic() - sent
    finally:
        if driver.poll() is None:
            driver.kill()
    err = (tmp_path / "stderr.txt").read_text()
    assert returncode == exit_code, err
    assert waited < 30, f"{waited:.0f} s after the signal\n{err}"
    assert statuses(tmp_path) == ["KILLED"]
    assert "Traceback" not in err

