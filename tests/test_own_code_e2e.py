"""A directory holding someone's own model, data, loss and metrics (examples/regression: not image
classification; examples/text-classification: token ids batched by a collate function) trains with one command
and from Python, and its own metrics, the training features and a model whose signature has the data's shapes and
dtypes reach MLflow."""

import json
import shutil
import sys
from pathlib import Path

import pytest

from conftest import REPO
from orchestrator.tracking.summary_values import values
from test_submit_e2e import only_run

pytestmark = pytest.mark.slow


def test_the_regression_example_trains_from_python_with_a_dict_job_and_its_own_loss_metrics_and_shapes(
        ray_session, tmp_path, monkeypatch):
    """`from orchestrator import run` with the example's job as a dict: a RunResult naming the MLflow run, its
    final metrics, its checkpoints and a model that loads; Ray (initialised by the caller) is left running. The
    example's own loss and metrics reach MLflow, nothing assumes classification, and the logged model's signature
    has the data's shape. (The text example below trains from its directory through submit.)

    Long: a whole run through Ray Train (a worker group, training, evaluation, the logged model) and a load of it."""
    import mlflow
    import torch
    import yaml

    from orchestrator import run

    example = tmp_path / "regression"
    shutil.copytree(REPO / "examples" / "regression", example)
    monkeypatch.chdir(example)  # as a user runs it: from the example's directory
    monkeypatch.delitem(sys.modules, "regression", raising=False)  # this copy's module, not another test's
    job = yaml.safe_load((example / "job.yaml").read_text())
    job["tracking"]["uri"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = run(job, ["precision.preset=O0", "run.epochs=2", "data.kwargs.train_samples=512",
                       "data.kwargs.eval_samples=128", "tracking.log_every_n_steps=2"])
    assert result.status == "FINISHED" and result.error is None
    client, logged_run = only_run(job["tracking"]["uri"], "regression")
    assert result.run_id == logged_run.info.run_id
    assert result.metrics["eval/mae"] == pytest.approx(logged_run.data.metrics["eval/mae"])
    assert sorted(p.name for p in Path(result.checkpoint_path).glob("checkpoint_0*"))
    model = mlflow.pytorch.load_model(result.model_uri, map_location="cpu")
    assert model(torch.zeros(3, 8)).shape == (3,)
    assert ray_session.is_initialized()

    metrics = logged_run.data.metrics
    for key in ("eval/loss", "eval/mae", "eval/mse", "train/loss", "optim/lr", "train/grad_norm"):
        assert key in metrics, sorted(metrics)
    assert "eval/accuracy" not in metrics  # nothing assumes classification
    assert 0 < metrics["eval/mae"] < 2 and metrics["eval/mse"] > 0
    history = client.get_metric_history(logged_run.info.run_id, "eval/mae")
    assert [m.step for m in history] == [4, 8]  # 2 ranks x 4 steps
    (spec,) = mlflow.models.get_model_info(result.model_uri).signature.inputs.inputs
    assert tuple(spec.shape) == (-1, 8), spec  # the data's shape, no image anywhere


def test_the_text_classification_example_trains_through_submit_and_logs_a_model_taking_its_token_ids(new_store, 
        ray_session, tmp_path, monkeypatch, capsys):
    """Variable-length int64 token ids through a collate function, named inputs, bf16-mixed with the embeddings
    kept fp32 by a rule, a torchmetrics F1 on 2 workers: the logged model takes the batch in its dtypes, through
    `mlflow.pytorch.load_model` and the pyfunc; the UI's summary pages are there, and a clean run's amp counters
    are logged once, at its end.

    Long: two workers in bf16 (about 10x slower than fp32 on these CPUs), then the logged model loaded both ways.
    """
    import mlflow
    import torch

    from orchestrator.cli.submit import main

    example = tmp_path / "text-classification"
    shutil.copytree(REPO / "examples" / "text-classification", example)
    monkeypatch.chdir(example)
    monkeypatch.delitem(sys.modules, "textcls", raising=False)
    uri = new_store(tmp_path)
    assert main(["job.yaml", "run.epochs=2", "data.kwargs.train_samples=256", "data.kwargs.eval_samples=64",
                 f"tracking.uri={uri}", "tracking.system_metrics_interval_s=0"]) == 0
    client, run = only_run(uri, "text-classification")
    run_id, metrics = run.info.run_id, values(run.data.metrics, run.data.tags)  # summary tags too
    assert f"Model:    runs:/{run_id}/model" in capsys.readouterr().out
    assert 0 < metrics["eval/f1_macro"] <= 1 and 0 < metrics["eval/accuracy"] <= 1
    assert metrics["memory/params_float32_bytes"] > 0 and metrics["memory/rank1_peak_bytes"] > 0
    # Reported once, at the end, and 0: a summary tag, not a one-dot chart.
    assert client.get_metric_history(run_id, "amp/skipped_steps") == [] and run.data.tags["amp/skipped_steps"] == "0"

    summary = json.loads(open(client.download_artifacts(run_id, "precision/audit_summary.json")).read())
    assert {"rule": "Embedding", "layers": 2, "types": "Embedding x2"} in summary["by_rule"]
    assert {row["layer"] for row in summary["fell_back"]} >= {"tokens", "positions"}
    assert {"precision/audit_summary.html", "memory/breakdown.html"} <= {
        a.path for folder in ("precision", "memory") for a in client.list_artifacts(run_id, folder)}

    model_uri = f"runs:/{run_id}/model"
    specs = [(s.name, str(s.type), s.shape) for s in mlflow.models.get_model_info(model_uri).signature.inputs.inputs]
    assert specs == [("input_ids", "int64", (-1, -1)), ("attention_mask", "bool", (-1, -1))]
    sys.path.insert(0, str(example))
    try:
        import textcls
    finally:
        sys.path.remove(str(example))
    _, evaluation = textcls.make_datasets(16, 6)
    batch = textcls.pad_collate([evaluation[i] for i in range(6)])
    loaded = mlflow.pytorch.load_model(model_uri)
    with torch.no_grad():
        logits = loaded(batch["input_ids"], batch["attention_mask"])
    predicted = mlflow.pyfunc.load_model(model_uri).predict(
        {"input_ids": batch["input_ids"].numpy(), "attention_mask": batch["attention_mask"].numpy()})
    assert logits.shape == (6, 4) and predicted.shape == (6, 4)
    torch.testing.assert_close(torch.from_numpy(predicted), logits)
