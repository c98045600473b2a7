"""A stuck or stopped rank through submit (2 Ray workers, real MLflow): the run ends within
`failure.step_timeout_s` + 60 s, FAILED, exit 1, with the stopped rank named on the console; a rank stuck in its
forward has every rank's stack logged under `diagnostics/stacks/` and, with `failure.max_failures: 1`, its attempt
is restarted from the newest checkpoint and the run finishes. (A stuck rank failing the run, without a restart,
is `tests/test_watchdog.py`'s, on the Ray-free loop.)"""

import time

import pytest

from conftest import drill, small_job
from test_submit_e2e import only_run

pytestmark = pytest.mark.slow

TIMEOUT_S = 10.0  # a step on a busy 2-core machine can take seconds: the hang must be told apart


def submit(tmp_path, monkeypatch, write_job, mlflow_uri, experiment, **sections) -> int:
    from orchestrator.cli.submit import main

    monkeypatch.chdir(tmp_path)
    sections["tracking"] = {"uri": mlflow_uri, "experiment": experiment}
    job = small_job(model={"name": "tiny_nets:MLP"}, precision={"preset": "O0"},
                    run={"max_steps_per_epoch": 8},
                    failure={"step_timeout_s": TIMEOUT_S, **sections.pop("failure", {})}, **sections)
    return main([str(write_job(job, f"{experiment}.yaml"))])


def stacks(client, run_id, folder="diagnostics/stacks"):
    return {a.path.rpartition("/")[2]: a for a in client.list_artifacts(run_id, folder) if not a.is_dir}


def test_a_sigstopped_rank_fails_the_run_within_the_bound_named_as_the_rank_without_a_stack(
        ray_session, tmp_path, monkeypatch, write_job, mlflow_uri, capsys):
    marker = tmp_path / "stopped"
    rc = submit(tmp_path, monkeypatch, write_job, mlflow_uri, "stopped",
                callbacks=[drill("SigStop", rank=1, at_step=3, marker=str(marker))])
    assert rc == 1
    assert time.time() - marker.stat().st_mtime < TIMEOUT_S + 60
    err = capsys.readouterr().err
    assert "training failed: rank 1 made no progress and wrote no stack (stopped, killed, or holding the GIL)" in err
    client, run = only_run(mlflow_uri, "stopped")
    assert run.info.status == "FAILED"
    assert sorted(stacks(client, run.info.run_id)) == ["rank0.txt"]


def test_with_max_failures_a_stalled_attempt_restarts_from_the_newest_checkpoint_and_the_run_finishes(
        ray_session, tmp_path, monkeypatch, write_job, mlflow_uri, capsys):
    """A rank that stalls with `failure.max_failures: 1`: the watchdog ends the attempt with every rank's stack, Ray
    Train restarts it from the newest checkpoint, and the run finishes.

    Long: the stall must last the watchdog's bound before the restart, then a second attempt of both workers trains."""
    marker = tmp_path / "stalled"  # the stall happens on the first attempt only
    rc = submit(tmp_path, monkeypatch, write_job, mlflow_uri, "restarted", failure={"max_failures": 1},
                checkpoint={"every_n_steps": 2},
                callbacks=[drill("StallForward", rank=1, from_step=5, marker=str(marker))])
    assert rc == 0
    err = capsys.readouterr().err
    assert "warning: an attempt stalled: rank 1 made no progress for " in err
    assert "in blocked_forward (stacks: diagnostics/stacks/); Ray Train restarted it from the newest checkpoint" in err
    assert "drills.py:" in err
    client, run = only_run(mlflow_uri, "restarted")
    assert run.info.status == "FINISHED"
    assert sorted(stacks(client, run.info.run_id)) == ["rank0.txt", "rank1.txt"]
    rank1 = client.download_artifacts(run.info.run_id, "diagnostics/stacks/rank1.txt", str(tmp_path))
    text = open(rank1).read()
    assert '"in_collective": false' in text.splitlines()[0] and "in blocked_forward" in text
    assert "(training):" in text and "orchestrator/train/loop.py" in text
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in losses] == [2, 4, 6, 8]  # resumed at step 4's checkpoint, every step once
