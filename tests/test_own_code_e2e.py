"""A directory holding someone's own model, data, loss and metrics (examples/regression: not image
classification) trains with one command, and its own metrics, the training features and a model whose
signature has the data's shape reach MLflow."""

import shutil

import pytest
from mlflow import MlflowClient

from conftest import REPO
from test_submit_e2e import only_run

pytestmark = pytest.mark.slow


def test_the_regression_example_trains_through_submit_with_its_own_loss_metrics_and_shapes(
        ray_session, tmp_path, monkeypatch):
    from orchestrator.cli.submit import main

    example = tmp_path / "regression"
    shutil.copytree(REPO / "examples" / "regression", example)
    monkeypatch.chdir(example)  # as a user runs it: from the example's directory
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["job.yaml", "precision.preset=O0", "run.epochs=2", "data.kwargs.train_samples=512",
                 "data.kwargs.eval_samples=128", f"tracking.uri={uri}", "tracking.log_every_n_steps=2"]) == 0

    client, run = only_run(uri, "regression")
    metrics = run.data.metrics
    for key in ("eval/loss", "eval/mae", "eval/mse", "train/loss", "optim/lr", "train/grad_norm"):
        assert key in metrics, sorted(metrics)
    assert "eval/accuracy" not in metrics  # nothing assumes classification
    assert 0 < metrics["eval/mae"] < 2 and metrics["eval/mse"] > 0
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/mae")] == [4, 8]  # 2 ranks x 4 steps

    import mlflow

    logged = mlflow.models.get_model_info(f"runs:/{run.info.run_id}/model")
    (spec,) = logged.signature.inputs.inputs
    assert tuple(spec.shape) == (-1, 8), spec  # the data's shape, no image anywhere
