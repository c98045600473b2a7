"""Ctrl-C and SIGTERM end a training submit the way shells and schedulers expect: exit 130 (SIGINT) or 143
(SIGTERM), one line saying the run was interrupted and how to continue it, no traceback, and the MLflow run
closed KILLED. A real driver process, real signals, sent while Ray Train is training."""

import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from conftest import small_job
from test_submit_e2e import only_run

pytestmark = pytest.mark.slow


def _stop_ray_of(ray_temp_dir: str) -> None:
    """Whatever Ray processes of this test's own temp dir outlived the driver (none when it shut Ray down)."""
    ours = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(ray_temp_dir in part for part in (proc.info["cmdline"] or [])) \
                    or proc.environ().get("RAY_TMPDIR") == ray_temp_dir:
                ours.append(proc)
        except psutil.Error:
            continue
    for proc in ours:
        proc.kill()
    psutil.wait_procs(ours, timeout=30)


@pytest.mark.parametrize("signum, exit_code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_training_exits_128_plus_signum_with_one_line_and_the_run_killed(
        signum, exit_code, tmp_path, write_job, mlflow_uri):
    job = write_job(small_job(precision={"preset": "O0"}, run={"epochs": 200, "max_steps_per_epoch": 6},
                              tracking={"uri": mlflow_uri, "experiment": "signals", "log_every_n_steps": 1},
                              checkpoint={"every_n_steps": 2}))
    ray_temp = tempfile.mkdtemp(prefix="ampflow-rt-", dir="/tmp")  # short: Ray's socket paths are limited
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "w") as stderr:
        driver = subprocess.Popen([sys.executable, "-m", "orchestrator.submit", str(job)], cwd=tmp_path,
                                  env={**os.environ, "RAY_TMPDIR": ray_temp}, start_new_session=True,
                                  stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 240
        while not list(tmp_path.glob("ray_results/*/checkpoint_0*/train_state.pt")):  # training, inside fit()
            assert driver.poll() is None, stderr_path.read_text()
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.2)
        driver.send_signal(signum)
        returncode = driver.wait(timeout=90)
    finally:
        if driver.poll() is None:
            driver.kill()
        _stop_ray_of(ray_temp)
    err = stderr_path.read_text()
    assert returncode == exit_code, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("interrupted")]
    assert len(lines) == 1, err
    assert signal.Signals(signum).name in lines[0]
    assert f"python -m orchestrator.submit {job} --resume" in lines[0]
    _, run = only_run(mlflow_uri, "signals")
    assert run.info.status == "KILLED"
