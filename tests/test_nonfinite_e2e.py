"""A run that fails on non-finite state names what it can be continued from, through submit (2 Ray workers, real
MLflow): the newest finite checkpoint, or that there is none; never a `--resume` of nothing, never a NaN
checkpoint."""

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


def test_a_failed_run_names_its_newest_finite_checkpoint_or_says_there_is_none(
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

    # fp32, the loss NaN from step 3, checkpoints every 4 steps: the run fails at step 3, before any checkpoint.
    rc = submit(tmp_path, monkeypatch, write_job, mlflow_uri, "nan-loss", checkpoint={"every_n_steps": 4},
                run={"max_steps_per_epoch": 8}, callbacks=[drill("NanLoss", from_step=3)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "raised NonFiniteLoss: the loss was not finite at step 3" in err
    assert "No finite checkpoint was written: there is nothing to resume." in err
    assert "orchestrator.submit" not in err  # no command to resume what does not exist
    assert not list(tmp_path.glob("ray_results/nan-loss-*/checkpoint_0*"))
