"""Real driver processes against one real Ray cluster (a head started here, token auth on):

- Ctrl-C and SIGTERM end a training submit the way shells and schedulers expect: exit 130 (SIGINT) or
  143 (SIGTERM), one line saying the run was interrupted and how to continue it, no traceback, the MLflow
  run closed KILLED. The signals are sent while Ray Train is training.
- Two submits of one job started at the same moment get two runs: their own name, their own run
  directory and record, one experiment that either of them created.
"""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from conftest import small_job
from ray_head import RayHead
from test_submit_e2e import only_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def head():
    with RayHead(num_cpus=4) as ray_head:
        yield ray_head


def submit(head: RayHead, job: Path, workdir: Path, stderr_path: Path) -> subprocess.Popen:
    with open(stderr_path, "w") as stderr:
        return subprocess.Popen([sys.executable, "-m", "orchestrator.submit", str(job), "--address", head.gcs_address],
                                cwd=workdir, env=head.client_env(), stdout=subprocess.DEVNULL, stderr=stderr)


def test_a_signal_during_training_exits_128_plus_signum_with_one_line_and_the_run_killed(head, tmp_path):
    # SIGINT and SIGTERM each to a driver of its own, both training at once (one worker each) on the test's head.
    signums = {signal.SIGINT: 130, signal.SIGTERM: 143}
    drivers = {}
    for signum in signums:
        workdir = tmp_path / signal.Signals(signum).name
        workdir.mkdir()
        uri = f"sqlite:///{workdir / 'mlflow.db'}"
        job = workdir / "job.yaml"
        job.write_text(yaml.safe_dump(small_job(
            precision={"preset": "O0"}, scaling={"num_workers": 1}, run={"epochs": 200, "max_steps_per_epoch": 6},
            tracking={"uri": uri, "experiment": "signals", "log_every_n_steps": 1}, checkpoint={"every_n_steps": 2})))
        drivers[signum] = (submit(head, job, workdir, workdir / "stderr.txt"), workdir, job, uri)
    try:
        deadline = time.monotonic() + 240
        waiting = dict(drivers)
        while waiting:
            for signum, (driver, workdir, _, _) in list(waiting.items()):
                assert driver.poll() is None, (workdir / "stderr.txt").read_text()
                if list(workdir.glob("ray_results/*/checkpoint_0*/train_state.pt")):  # training, inside fit()
                    driver.send_signal(signum)
                    del waiting[signum]
            assert time.monotonic() < deadline, f"no checkpoint appeared for {sorted(waiting)}"
            time.sleep(0.2)
        returncodes = {signum: driver.wait(timeout=90) for signum, (driver, *_) in drivers.items()}
    finally:
        for driver, *_ in drivers.values():
            if driver.poll() is None:
                driver.kill()
    for signum, (driver, workdir, job, uri) in drivers.items():
        err = (workdir / "stderr.txt").read_text()
        assert returncodes[signum] == signums[signum], err
        assert "Traceback" not in err, err
        lines = [line for line in err.splitlines() if line.startswith("interrupted")]
        assert len(lines) == 1, err
        assert signal.Signals(signum).name in lines[0]
        assert f"python -m orchestrator.submit {job} --resume" in lines[0]
        _, run = only_run(uri, "signals")
        assert run.info.status == "KILLED"


def test_two_submits_of_one_job_at_the_same_moment_get_two_runs_of_their_own(head, tmp_path, write_job, mlflow_uri):
    """Before: both took the name `<job>-<second>`, wrote into one run directory (one record for two MLflow
    runs), and one of them could die creating the experiment the other had just created."""
    job = write_job(small_job(precision={"preset": "O0"}, scaling={"num_workers": 1},
                              run={"epochs": 1, "max_steps_per_epoch": 2},
                              tracking={"uri": mlflow_uri, "experiment": "twice"}), name="same.yaml")
    drivers = [submit(head, job, tmp_path, tmp_path / f"stderr{i}.txt") for i in range(2)]
    codes = [driver.wait(timeout=300) for driver in drivers]
    assert codes == [0, 0], [(tmp_path / f"stderr{i}.txt").read_text() for i in range(2)]

    client = MlflowClient(tracking_uri=mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name("twice").experiment_id])
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}
    names = {r.info.run_name for r in runs}
    assert len(names) == 2 and all(name.startswith("same-") for name in names), names
    for run in runs:  # each run directory is one run's: its record names its MLflow run, one attempt wrote it
        run_dir = tmp_path / "ray_results" / run.info.run_name
        assert json.loads((run_dir / "ampflow_run.json").read_text())["run_id"] == run.info.run_id
        attempts = {path.name.rsplit("_", 1)[1] for path in run_dir.glob("checkpoint_0*")}
        assert len(attempts) == 1, sorted(p.name for p in run_dir.glob("checkpoint_0*"))
