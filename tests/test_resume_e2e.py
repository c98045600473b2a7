"""Killing a worker or the driver costs at most the work since the last checkpoint, and nothing else.

2 Ray workers, a real MLflow store. Exactness is proven as Composer and torchtitan prove it: the
resumed run's final state is compared with an uninterrupted run's, bit for bit (atol=0).
"""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import torch

from orchestrator.checkpoint.stored import newest as newest_complete
from orchestrator.tracking.goodput import PARTS

from conftest import drill, small_job
from test_submit_e2e import only_run

pytestmark = pytest.mark.slow

# fp16 autocast with a dynamic GradScaler that grows every 3 steps, Adam: every piece of state moves.
EXACT_JOB = small_job(
    precision={"preset": "O1", "init_scale": 1024, "growth_interval": 3},
    optim={"name": "adam", "lr": 0.002},
    run={"epochs": 2, "max_steps_per_epoch": 6},
    tracking={"log_every_n_steps": 5},
    checkpoint={"every_n_steps": 4},
)


def final_state(storage: Path) -> dict:
    (final,) = storage.glob("*/checkpoint_000000012_*/train_state.pt")
    return torch.load(final, weights_only=True)


def assert_bit_identical(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where  # atol=0
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_bit_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bit_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def each_step_once(client, run_id, key) -> list[int]:
    steps = Counter(m.step for m in client.get_metric_history(run_id, key))
    assert set(steps.values()) == {1}, f"{key} logged twice at some step: {steps}"
    return sorted(steps)


def test_killed_worker_resumes_at_its_checkpoint_bit_identical_and_logs_each_step_once(
        ray_session, tmp_path, monkeypatch, write_job, mlflow_uri):
    """A rank killed mid-epoch: Ray Train restarts the attempt from the newest checkpoint, and the final model,
    optimizer, scaler, scheduler and counters are bit-identical to a run never interrupted, each step logged once.

    Long: two whole runs (the reference and the interrupted one), the second with a restart of its workers."""
    from orchestrator.cli.submit import main

    monkeypatch.chdir(tmp_path)
    job = write_job(EXACT_JOB)
    common = [f"tracking.uri={mlflow_uri}"]
    assert main([str(job), *common, "tracking.experiment=straight", f"checkpoint.storage_path={tmp_path / 'a'}"]) == 0
    # Rank 1 dies (os._exit) at the start of step 6; the newest checkpoint is step 4's, mid-epoch.
    marker = tmp_path / "killed"
    kill = f"callbacks=[{{name: 'drills:KillRank', kwargs: {{rank: 1, at_step: 6, marker: '{marker}'}}}}]"
    assert main([str(job), *common, "tracking.experiment=killed", f"checkpoint.storage_path={tmp_path / 'b'}",
                 kill, "failure.max_failures=1"]) == 0
    assert marker.exists(), "the worker was never killed"

    straight, resumed = final_state(tmp_path / "a"), final_state(tmp_path / "b")
    for part in ("model", "optimizer", "scaler", "counters", "scheduler"):
        assert_bit_identical(straight[part], resumed[part], part)
    assert resumed["scaler"]["scale"] > 1024.0 and resumed["scaler"]["_growth_tracker"] == \
        straight["scaler"]["_growth_tracker"]

    client, run = only_run(mlflow_uri, "killed")
    _, reference = only_run(mlflow_uri, "straight")
    assert run.info.status == "FINISHED" and run.data.tags["resumed_from_step"] == "4"
    for key in ("train/loss", "amp/loss_scale", "eval/accuracy"):
        assert each_step_once(client, run.info.run_id, key) == each_step_once(client, reference.info.run_id, key)
    assert run.data.metrics["train/loss"] == reference.data.metrics["train/loss"]

    # Its goodput: two attempts, the first ended by a failure. Step 5's report reaches the driver only when Ray
    # Train's controller takes it before it sees rank 1 dead: then step 5, trained again from the checkpoint of
    # step 4, is redone at the killed attempt's own time per step; else it is lost in the restart's time.
    breakdown = json.loads(Path(client.download_artifacts(run.info.run_id, "perf/time_breakdown.json")).read_text())
    killed, restarted = breakdown["attempts"]
    assert killed["ended_by"] == "failure" and killed["last_step"] in (4, 5)
    assert killed["steps_redone"] == killed["last_step"] - 4
    assert (restarted["resumed_from_step"], restarted["last_step"], restarted["ended_by"]) == (4, 12, None)
    goodput = run.data.metrics
    assert (goodput["goodput/redone_s"] > 0) == (killed["steps_redone"] > 0) and goodput["goodput/restarts_s"] > 0
    assert sum(goodput[f"goodput/{part}_s"] for part in PARTS) == pytest.approx(goodput["goodput/wall_s"])


def _kill_tree_of(process: subprocess.Popen, ray_temp_dir: str) -> None:
    """SIGKILL the driver's process group, then every Ray process of its own temp dir (and nothing else).

    Ray's worker processes rename themselves (`ray::RayTrainWorker...`), so their command line does not
    name the temp dir; their environment does (RAY_TMPDIR). Left alive, they would go on writing
    checkpoints after the "crash"."""
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    ours = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(ray_temp_dir in part for part in (proc.info["cmdline"] or [])) \
                    or proc.environ().get("RAY_TMPDIR") == ray_temp_dir:
                ours.append(proc)
        except psutil.Error:  # gone already, or not ours to read
            continue
    for proc in ours:
        proc.kill()
    psutil.wait_procs(ours, timeout=30)


def test_driver_killed_holding_unlogged_reports_then_resumed_in_the_same_run_past_a_corrupt_checkpoint(
        ray_session, tmp_path, monkeypatch, write_job, mlflow_uri, capsys):
    """A driver SIGKILLed while its MLflow store is locked (it holds reports it could not log), its newest checkpoint
    then truncated: `--resume` falls back to the previous one and finishes the same run with every step once.

    Long: the driver must be a process of its own with a Ray of its own (it is killed, with its workers), and it
    trains to step 8 before the kill; the resume then trains the rest."""
    from orchestrator.cli.submit import main

    job = write_job(small_job(precision={"preset": "O0"}, run={"epochs": 4, "max_steps_per_epoch": 6},
                              tracking={"uri": mlflow_uri, "experiment": "driver", "log_every_n_steps": 1},
                              checkpoint={"every_n_steps": 2, "num_to_keep": 3}))
    ray_temp = tempfile.mkdtemp(prefix="ampflow-rt-", dir="/tmp")  # short: Ray's socket paths are limited
    driver = subprocess.Popen([sys.executable, "-m", "orchestrator.submit", str(job)], cwd=tmp_path,
                              env={**os.environ, "RAY_TMPDIR": ray_temp}, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    database = sqlite3.connect(mlflow_uri.removeprefix("sqlite:///"), timeout=60, isolation_level=None)
    try:
        deadline = time.monotonic() + 300

        def wait_for_checkpoint(step: int) -> None:
            while not any(stored.facts.global_step >= step for run_dir in tmp_path.glob("ray_results/*/")
                          for stored in [newest_complete(str(run_dir.parent), run_dir.name)] if stored is not None):
                assert driver.poll() is None, "the driver ended before it could be killed"
                assert time.monotonic() < deadline, f"no checkpoint of step {step} appeared"
                time.sleep(0.1)

        wait_for_checkpoint(2)
        # From here MLflow takes nothing (its database is locked): the driver holds every report it gets.
        database.execute("BEGIN EXCLUSIVE")
        wait_for_checkpoint(8)
    finally:
        _kill_tree_of(driver, ray_temp)
        if database.in_transaction:
            database.execute("ROLLBACK")
        database.close()
    client, run = only_run(mlflow_uri, "driver")
    assert run.info.status == "RUNNING"  # what a dead driver leaves behind
    logged = [m.step for m in client.get_metric_history(run.info.run_id, "amp/loss_scale")]
    assert max(logged, default=0) < 6, f"the dead driver must have held unlogged reports: logged {logged}"

    checkpoints = sorted(tmp_path.glob("ray_results/*/checkpoint_0*"))
    newest, previous = checkpoints[-1], checkpoints[-2]
    with open(newest / "train_state.pt", "r+b") as state:  # the newest one is damaged too
        state.truncate(200)

    monkeypatch.chdir(tmp_path)
    assert main([str(job), "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"Resuming {run.info.run_id}" in err
    assert newest.name in err and "falling back" in err, err

    client, resumed = only_run(mlflow_uri, "driver")  # the same run, not a second one
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED"
    assert resumed.data.tags["resumed_from_step"] == str(int(previous.name.split("_")[1]))
    for key in ("train/loss", "amp/loss_scale"):  # every step once: none lost with the dead driver, none twice
        assert each_step_once(client, run.info.run_id, key) == list(range(1, 25)), key
    assert each_step_once(client, run.info.run_id, "eval/accuracy") == [6, 12, 18, 24]
    assert main([str(job), "--resume"]) == 2  # finished: nothing left to resume
    assert "no interrupted run" in capsys.readouterr().err


def test_a_disk_that_fills_up_during_rays_copy_leaves_no_partial_checkpoint_and_the_previous_one_loads(
        ray_session, tmp_path, monkeypatch, write_job, mlflow_uri, capsys):
    """ENOSPC while Ray copies the staged checkpoint of step 4 to storage (half of a file written): the run fails
    with ampflow's disk-full message naming the checkpoint and the space it needs, the half-written directory is
    gone, and the checkpoint of step 2 is the newest and loads."""
    from orchestrator.cli.submit import main
    from orchestrator.checkpoint.files import load_newest_valid, local_candidates

    job = write_job(small_job(precision={"preset": "O0"}, run={"epochs": 1, "max_steps_per_epoch": 6},
                              tracking={"uri": mlflow_uri, "experiment": "full"},
                              checkpoint={"every_n_steps": 2}, callbacks=[drill("DiskFull", at_step=4)]))
    monkeypatch.chdir(tmp_path)
    assert main([str(job)]) == 1
    err = capsys.readouterr().err
    assert "CheckpointWriteError" in err and "The disk is full (this part of the checkpoint needs" in err, err
    assert "checkpoint_000000004_" in err and "--resume" in err
    (run_dir,) = (tmp_path / "ray_results").iterdir()
    assert not list(run_dir.glob("checkpoint_000000004_*")), "a half-copied checkpoint was left in storage"
    state, warnings = load_newest_valid(local_candidates(run_dir), rank=0)
    assert state.global_step == 2 and warnings == []
    _, run = only_run(mlflow_uri, "full")
    assert run.info.status == "FAILED"
