"""The model a run logs predicts in eval mode: a sample's output never depends on the batch it came in."""

import pytest
import torch

from conftest import small_job

pytestmark = pytest.mark.slow


def test_the_logged_model_is_the_trained_model_in_eval_mode(ray_session, tmp_path, write_job, mlflow_uri,
                                                             monkeypatch):
    from mlflow import MlflowClient

    from orchestrator.cli.submit import main
    from orchestrator.config import load_job
    from orchestrator.tracking.tracker import RunTracker
    from orchestrator.train.checkpoint import read_checkpoint
    from orchestrator.train.data import build_datasets
    from orchestrator.train.models import build_model

    storage = tmp_path / "ray_results"
    job = write_job(small_job(model={"name": "resnet18"}, precision={"preset": "O0"},
                              run={"name": "logged", "max_steps_per_epoch": 3},
                              tracking={"uri": mlflow_uri, "experiment": "logged", "log_model": True},
                              checkpoint={"storage_path": str(storage)}))
    monkeypatch.chdir(tmp_path)
    assert main([str(job)]) == 0
    client = MlflowClient(tracking_uri=mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("logged").experiment_id])
    logged = RunTracker.open(mlflow_uri, run.info.run_id).load_model()

    cfg = load_job(job, [])
    trained = build_model(cfg.model)
    final = sorted(p for p in (storage / "logged").glob("checkpoint_*") if p.is_dir())[-1]
    trained.load_state_dict(read_checkpoint(final, rank=0).model)
    trained.eval()
    _, eval_set = build_datasets(cfg.data, cfg.model.num_classes)
    batch = torch.stack([eval_set[i][0] for i in range(6)])
    with torch.no_grad():
        expected, in_batch, alone = trained(batch), logged(batch), logged(batch[:1])
    torch.testing.assert_close(in_batch, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(alone, in_batch[:1], rtol=1e-4, atol=1e-5)  # no batch statistics
