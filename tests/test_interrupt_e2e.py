"""Real driver processes against one real Ray cluster (a head started here, token auth on):

- Ctrl-C and SIGTERM end a training submit the way shells and schedulers expect: exit 130 (SIGINT) or
  143 (SIGTERM), one line saying the run was interrupted and how to continue it, no traceback, the MLflow
  run closed KILLED. The signals are sent while Ray Train is training.
- Two submits of one job started at the same moment get two runs: their own name, their own run
  directory and record, one experiment that either of them created.

And a driver on a local Ray of its own (its own Ray temp dir) with a rank stuck in forward: Ctrl-C and SIGTERM
end it within the 25 s the README promises (`errors.INTERRUPT_DEADLINE_S`), whatever else the machine runs
(these tests run beside others), the run KILLED, its Ray's processes gone, no second Ray session started.
"""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from mlflow import MlflowClient

from conftest import own_ray_env, ray_sessions, small_job
from orchestrator.errors import INTERRUPT_DEADLINE_S
from ray_head import RayHead
from test_submit_e2e import only_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def head():
    """The module's Ray head, token auth on; the drivers join it by its GCS address, so no dashboard (its dozen
    processes would cost CPU all the module long: 4.6 s a minute idle with it, 2.0 s without)."""
    with RayHead(num_cpus=4, dashboard=False) as ray_head:
        yield ray_head


def submit(head: RayHead, job: Path, workdir: Path, stderr_path: Path) -> subprocess.Popen:
    with open(stderr_path, "w") as stderr:
        return subprocess.Popen([sys.executable, "-m", "orchestrator.submit", str(job), "--address", head.gcs_address],
                                cwd=workdir, env=head.client_env(), stdout=subprocess.DEVNULL, stderr=stderr)


def test_a_signal_during_training_exits_128_plus_signum_with_one_line_and_the_run_killed(new_store, head, tmp_path):
    """SIGINT and SIGTERM, each to a driver of its own while it trains: exit 128 + signum, one `interrupted` line
    naming the signal and the `--resume` command, the run KILLED, and its Ray Train actors gone from the cluster.

    Long: two drivers in processes of their own (one per signal, side by side), each signalled only once it has
    written a checkpoint, then given time for its actors to leave the cluster."""
    # SIGINT and SIGTERM each to a driver of its own, both training at once (one worker each) on the test's head.
    signums = {signal.SIGINT: 130, signal.SIGTERM: 143}
    drivers = {}
    for signum in signums:
        workdir = tmp_path / signal.Signals(signum).name
        workdir.mkdir()
        uri = new_store(workdir)
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
    # Their Ray Train controllers and workers on the cluster went with them.
    deadline = time.monotonic() + 30
    while train_actors(head):
        assert time.monotonic() < deadline, f"still on the cluster: {train_actors(head)}"
        time.sleep(1)


def train_actors(head: RayHead) -> list[str]:
    """The Ray Train controller and worker processes on the test's head."""
    found = []
    for process in psutil.Process(head.process.pid).children(recursive=True):
        try:
            title = " ".join(process.cmdline())
        except psutil.Error:
            continue
        if "RayTrainWorker" in title or "TrainController" in title:
            found.append(title[:80])
    return found


def test_two_submits_of_one_job_at_the_same_moment_get_two_runs_of_their_own(head, tmp_path, write_job, mlflow_uri):
    """Started in the same second, each takes a run name of its own (a name from the job and the second alone
    would be the same for both), so its own run directory and record, and neither fails on the experiment the
    other has just created.

    Long: two submits in processes of their own, started together on the test's head, both to the end of training.
    """
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


STUCK_NETS = '''
import os, time
import torch.distributed as dist
import torch.nn as nn


class Net(nn.Module):
    """Rank 1's forward blocks for good from its 4th training step (rank 0 then waits in the gradients'
    all-reduce): a stuck rank, as a hung data loader or collective leaves one."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))
        self.steps = 0

    def forward(self, x):
        if self.training:
            self.steps += 1
            if self.steps >= 4 and dist.is_initialized() and dist.get_rank() == 1:
                open(os.environ["STUCK_MARKER"], "w").close()
                while True:
                    time.sleep(1)
        return self.fc(x)
'''


# SIGTERM here (what Kubernetes sends), SIGINT during the final logging below (where Ray Train's handler swallowed
# Ctrl-C): each path is taken by one signal end to end; both signals reach the same handler (tests/test_signals.py).
@pytest.mark.parametrize("signum, exit_code", [(signal.SIGTERM, 143)])
def test_a_signal_while_a_rank_is_stuck_ends_the_driver_within_25_s_with_the_run_killed_and_its_ray_gone(
        new_store, signum, exit_code, ray_tmpdir, tmp_path):
    """A driver on a local Ray of its own, one of its two ranks stuck in forward: the signal ends it within 25 s
    with 128 + signum and one `interrupted` line, the run KILLED, every process of its Ray (workers included)
    gone, and no second Ray session started on the way out.

    Long: a Ray of the driver's own (the signal must end its processes, which a shared head would not show), two
    ranks that must train before one hangs, then up to the 25 s the driver is given and 15 s for its processes.
    """
    (tmp_path / "stuck_nets.py").write_text(STUCK_NETS)
    uri = new_store(tmp_path)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(small_job(
        model={"name": "stuck_nets:Net"}, precision={"preset": "O0"}, run={"epochs": 1, "max_steps_per_epoch": 20},
        tracking={"uri": uri, "experiment": "stuck", "log_every_n_steps": 1})))
    marker = tmp_path / "stuck"
    with open(tmp_path / "stderr.txt", "w") as stderr:
        driver = subprocess.Popen([sys.executable, "-m", "orchestrator.submit", str(job)], cwd=tmp_path,
                                  env=own_ray_env(ray_tmpdir, STUCK_MARKER=str(marker)),
                                  stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert driver.poll() is None, (tmp_path / "stderr.txt").read_text()
            assert time.monotonic() < deadline, "rank 1 never got stuck"
            time.sleep(0.5)
        time.sleep(3)  # rank 0 waits in the all-reduce, the driver in fit()
        started = psutil.Process(driver.pid).children(recursive=True)
        assert any("RayTrainWorker" in " ".join(p.cmdline()) or p.name().startswith("ray::") for p in started)
        driver.send_signal(signum)
        sent = time.monotonic()
        returncode = driver.wait(timeout=120)
        waited = time.monotonic() - sent
    finally:
        if driver.poll() is None:
            driver.kill()
    err = (tmp_path / "stderr.txt").read_text()
    assert returncode == exit_code, err
    assert waited < INTERRUPT_DEADLINE_S, f"{waited:.0f} s after the signal\n{err}"
    assert len([line for line in err.splitlines() if line.startswith("interrupted")]) == 1, err
    assert "Traceback" not in err and "not the main thread" not in err, err
    _, run = only_run(uri, "stuck")
    assert run.info.status == "KILLED"
    assert len(ray_sessions(ray_tmpdir)) == 1, "the dying driver started a second Ray"
    _, alive = psutil.wait_procs(started, timeout=15)
    assert not alive, f"still running: {[(p.pid, p.name()) for p in alive]}"


SLOW_TO_LOG_NETS = '''
import glob, os, sys, time
import torch.nn as nn


class Net(nn.Sequential):
    """Built once more by the driver to log the trained model (after training: a checkpoint exists); that build
    blocks, so the driver is in its final logging when the test signals it."""

    def __init__(self, num_classes=10):
        super().__init__(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))
        in_the_driver = sys.argv[0].endswith(os.path.join("orchestrator", "submit.py"))
        if in_the_driver and glob.glob("ray_results/*/checkpoint_*"):
            open("logging", "w").close()
            while True:
                time.sleep(1)
'''


def start_driver(tmp_path: Path, ray_tmpdir: Path, job: dict, **env: str) -> subprocess.Popen:
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    with open(tmp_path / "stderr.txt", "w") as stderr:
        return subprocess.Popen([sys.executable, "-m", "orchestrator.submit", str(tmp_path / "job.yaml")],
                                cwd=tmp_path, env=own_ray_env(ray_tmpdir, **env), stdout=subprocess.DEVNULL,
                                stderr=stderr)


def signal_when(driver: subprocess.Popen, ready, signum: int, stderr: Path) -> tuple[int, float, list]:
    """Once `ready()`, send `signum`; (exit code, seconds it took, the driver's descendants when signalled)."""
    try:
        deadline = time.monotonic() + 300
        while not ready():
            assert driver.poll() is None, stderr.read_text()
            assert time.monotonic() < deadline, f"never ready\n{stderr.read_text()}"
            time.sleep(0.1)
        started = psutil.Process(driver.pid).children(recursive=True)
        driver.send_signal(signum)
        sent = time.monotonic()
        returncode = driver.wait(timeout=120)
        return returncode, time.monotonic() - sent, started
    finally:
        if driver.poll() is None:
            driver.kill()


@pytest.mark.parametrize("signum, exit_code", [(signal.SIGINT, 130)])
def test_a_signal_during_the_final_logging_ends_the_driver_with_the_run_killed(new_store, signum, exit_code, ray_tmpdir,
                                                                              tmp_path):
    """After fit() returned, while the driver logs the model: the signal still ends it (Ray Train's own SIGINT
    handler, left installed after fit(), used to swallow Ctrl-C here).

    Long: a whole submit (its own Ray, a worker group, two steps) runs up to its final logging before the signal."""
    (tmp_path / "slow_to_log.py").write_text(SLOW_TO_LOG_NETS)
    uri = new_store(tmp_path)
    driver = start_driver(tmp_path, ray_tmpdir, small_job(
        model={"name": "slow_to_log:Net"}, precision={"preset": "O0"}, scaling={"num_workers": 1},
        run={"epochs": 1, "max_steps_per_epoch": 2}, tracking={"uri": uri, "experiment": "logging", "log_model": True}))
    returncode, waited, started = signal_when(driver, (tmp_path / "logging").exists, signum, tmp_path / "stderr.txt")
    err = (tmp_path / "stderr.txt").read_text()
    assert returncode == exit_code, err
    assert waited < INTERRUPT_DEADLINE_S, f"{waited:.0f} s after the signal\n{err}"
    assert only_run(uri, "logging")[1].info.status == "KILLED"
    assert len(ray_sessions(ray_tmpdir)) == 1
    _, alive = psutil.wait_procs(started, timeout=15)
    assert not alive, f"still running: {[(p.pid, p.name()) for p in alive]}"


@pytest.mark.parametrize("signum, exit_code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_while_ray_starts_ends_the_driver_and_leaves_nothing_running(new_store, signum, exit_code, ray_tmpdir,
                                                                             tmp_path):
    """As the local Ray's session appears: the driver ends within 25 s, its run (created meanwhile) KILLED, no Ray
    process of its left behind, no second session."""
    uri = new_store(tmp_path)
    MlflowClient(tracking_uri=uri).create_experiment("starting")  # the store exists: creating the run is quick
    driver = start_driver(tmp_path, ray_tmpdir, small_job(
        precision={"preset": "O0"}, scaling={"num_workers": 1}, tracking={"uri": uri, "experiment": "starting"}))
    returncode, waited, _ = signal_when(driver, lambda: bool(ray_sessions(ray_tmpdir)), signum,
                                        tmp_path / "stderr.txt")
    err = (tmp_path / "stderr.txt").read_text()
    assert returncode == exit_code, err
    assert waited < INTERRUPT_DEADLINE_S, f"{waited:.0f} s after the signal\n{err}"
    assert "Traceback" not in err, err
    assert {run.info.status for run in runs(uri)} <= {"KILLED"}, "a run created is closed KILLED"
    assert len(ray_sessions(ray_tmpdir)) == 1
    time.sleep(5)
    left = [p for p in psutil.process_iter(["cmdline"]) if str(ray_tmpdir) in " ".join(p.info["cmdline"] or [])]
    assert not left, f"still running: {[(p.pid, p.name()) for p in left]}"


def runs(uri: str) -> list:
    client = MlflowClient(tracking_uri=uri)
    return client.search_runs([e.experiment_id for e in client.search_experiments()])
