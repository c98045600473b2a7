"""A preemption notice: Kubernetes sends SIGTERM to a pod it evicts, and SIGKILL after its grace period. A worker
that gets it checkpoints at the next step boundary, within `failure.preemption_grace_s`, and the attempt restarts
from that checkpoint: nothing trained is redone."""

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from conftest import drill, small_job
from orchestrator.tracking.goodput import PARTS
from test_resume_e2e import each_step_once
from test_submit_e2e import only_run

pytestmark = pytest.mark.slow


def test_a_sigterm_to_one_worker_checkpoints_at_the_next_step_boundary_and_the_restart_redoes_nothing(
        ray_session, tmp_path, monkeypatch, write_job, mlflow_uri, capsys):
    """Rank 1's process gets SIGTERM in the middle of step 5 (checkpoints every 4 steps): every rank checkpoints at
    the end of step 5, the attempt restarts from it (not from step 4), and the run ends FINISHED with steps 1-8
    logged once; the checkpoint is written within the grace period. Its goodput counts two attempts, the restart
    after a preemption, and no step redone; its parts sum to the wall time from submit to the end.

    Long: one run with a restart of its workers (a minute and more under load)."""
    import threading

    from orchestrator.cli.submit import main

    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "rank1.pid"
    job = write_job(small_job(
        run={"epochs": 1, "max_steps_per_epoch": 8},
        tracking={"uri": mlflow_uri, "experiment": "notice", "log_every_n_steps": 1},
        checkpoint={"every_n_steps": 4},
        failure={"max_failures": 1, "preemption_grace_s": 20},
        callbacks=[drill("AwaitPreemption", rank=1, at_step=5, marker=str(marker))]))
    sent = {}

    def preempt() -> None:
        deadline = time.monotonic() + 300
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if marker.exists():
            sent["at"] = time.time()
            os.kill(int(marker.read_text()), signal.SIGTERM)

    notice = threading.Thread(target=preempt, daemon=True)
    notice.start()
    began = time.time()
    assert main([str(job)]) == 0
    ended = time.time()
    notice.join(timeout=1)
    assert "at" in sent, "rank 1 never reached step 5"

    (checkpoint,) = (tmp_path / "ray_results").glob("*/checkpoint_000000005_*/ampflow_checkpoint.json")
    assert checkpoint.stat().st_mtime - sent["at"] < 20  # within failure.preemption_grace_s
    client, run = only_run(mlflow_uri, "notice")
    assert run.info.status == "FINISHED" and run.data.tags["resumed_from_step"] == "5"
    assert each_step_once(client, run.info.run_id, "train/loss") == list(range(1, 9))

    goodput = run.data.metrics
    parts = [goodput[f"goodput/{part}_s"] for part in PARTS]
    assert min(parts) >= 0 and sum(parts) == pytest.approx(goodput["goodput/wall_s"])
    # From when submit started Ray to the end the driver measured: within the command's own time.
    assert 0 < goodput["goodput/wall_s"] <= ended - began
    assert goodput["goodput/startup_s"] > 0 and goodput["goodput/end_s"] > 0 and goodput["goodput/restarts_s"] > 0
    assert goodput["goodput/redone_s"] == 0 and goodput["goodput/attempts"] == 2
    assert 0 < goodput["goodput/fraction"] < 1
    breakdown = client.download_artifacts(run.info.run_id, "perf/time_breakdown.json")
    attempts = json.loads(Path(breakdown).read_text())["attempts"]
    assert [(a["ended_by"], a["resumed_from_step"], a["last_step"]) for a in attempts] == \
        [("preemption", None, 5), (None, 5, 8)]
    assert "time_breakdown.png" in {a.path.rpartition("/")[2] for a in client.list_artifacts(run.info.run_id, "perf")}
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  time: ")]
    assert re.search(r"\b\d+% training\b", line) and re.search(r"\b\d+% restarts after a preemption\b", line)
