"""A run that fails on non-finite state names what it can be continued from, through submit (2 Ray workers, real
MLflow): the newest finite checkpoint, never a NaN checkpoint. (A run that fails before any checkpoint says there is
nothing to resume: tests/test_guardrails_e2e.py's bf16 NaN loss.)"""

import pytest
import torch

from conftest import drill, small_job
from test_submit_e2e import only_run

pytestmark = pytest.mark.slow


def submit(tmp_path, monkeypatch, write_job, mlflow_uri, experiment, **sections) -> int:
    from orchestrator.cli.submit import main

    monkeypatch.chdir(tmp_path)
    sections["tracking"] = {"uri": mlflow_uri, "experiment": experiment}
    return main([str(write_job(small_job(precision={"preset": "O0"}, **sections), f"{experiment}.yaml"))])


def test_a_failed_run_names_its_newest_finite_checkpoint_and_never_writes_a_nan_one(
        ray_session, tmp_path, monkeypatch, write_job, mlflow_uri, capsys):
    # Rank 1's weights turn NaN after step 4, where a checkpoint is due: none is written, step 2's is named.
    rc = submit(tmp_path, monkeypatch, write_job, mlflow_uri, "nan-weight", run={"max_steps_per_epoch": 6},
                checkpoint={"every_n_steps": 2}, callbacks=[drill("NanWeight", at_step=4, rank=1)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "raised NonFiniteState: the train state is not finite at step 4 (rank 1: features.0.weight" in err
    (checkpoint,) = sorted(tmp_path.glob("ray_results/nan-weight-*/checkpoint_0*"))
    assert checkpoint.name.startswith("checkpoint_000000002_")
    assert f"The newest finite checkpoint is {checkpoint} (step 2); once the cause is fixed, continue from it " \
           "with: python -m orchestrator.submit" in err
    state = torch.load(checkpoint / "train_state.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())
    _, run = only_run(mlflow_uri, "nan-weight")
    assert run.info.status == "FAILED"

