"""Precision policies: every preset trains and is audited (Ray-free loop); through submit the audit is logged and
weights stay fp32; export."""

import json
from pathlib import Path

import mlflow
import pytest
import torch
import yaml
from mlflow import MlflowClient

from conftest import REPO, small_job
from test_submit_e2e import only_run

pytestmark = pytest.mark.slow

PRESETS = ["O0", "O1", "O2", "O3", "bf16-mixed", "bf16-true"]


def submit(write_job, job: dict, *overrides) -> int:
    from orchestrator.cli.submit import main

    return main([str(write_job(job)), *overrides])


def audit_of(client, run_id):
    path = client.download_artifacts(run_id, "precision/audit.json")
    return {entry["name"]: entry for entry in json.loads(Path(path).read_text())}


EXPECTED_PARAM_DTYPE = {"O2": "float16", "O3": "float16", "bf16-true": "bfloat16"}


def check_audit(audit: dict, preset: str) -> None:
    for entry in audit.values():
        assert {"name", "type", "param_dtype", "output_dtype"} <= set(entry)
    assert audit["features.0"]["param_dtype"] == EXPECTED_PARAM_DTYPE.get(preset, "float32")


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_trains_the_quickstart_model_and_audits_it(tmp_path, preset):
    """Each preset on the Ray-free loop (the loop the Ray Train worker runs, test_one_core): it trains to the end,
    and its first report holds the audit of what each layer stored. Through Ray and MLflow: the next test."""
    from orchestrator.config import load_job
    from orchestrator.train.local import LocalSession
    from orchestrator.train.loop import TrainingLoop

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(small_job(precision={"preset": preset}, run={"max_steps_per_epoch": 2},
                                            scaling={"num_workers": 1})))
    session = LocalSession(0, 1, torch.device("cpu"), tmp_path / "checkpoints")
    TrainingLoop(load_job(job), session).run()
    assert session.reports[-1].step == 2 and "eval/loss" in session.reports[-1].metrics
    (audit,) = [report.tables["precision/audit"] for report in session.reports if "precision/audit" in report.tables]
    check_audit({entry["name"]: entry for entry in audit}, preset)


def test_submit_logs_the_audit_and_keeps_checkpoints_and_the_logged_model_in_fp32(
    ray_session, tmp_path, monkeypatch, write_job, mlflow_uri
):
    """O2 (float16 weights) through submit: the audit is a run artifact, and the checkpoint and the logged model
    hold fp32 weights, whatever the training precision."""
    monkeypatch.chdir(tmp_path)
    job = small_job(precision={"preset": "O2"}, run={"max_steps_per_epoch": 2}, scaling={"num_workers": 1},
                    tracking={"uri": mlflow_uri, "experiment": "O2", "log_model": True})
    assert submit(write_job, job) == 0
    client, run = only_run(mlflow_uri, "O2")
    assert run.info.status == "FINISHED" and run.data.tags["preset"] == "O2"
    check_audit(audit_of(client, run.info.run_id), "O2")

    storage = tmp_path / "ray_results"
    (checkpoint_file,) = storage.glob("*/checkpoint_*/train_state.pt")
    state = torch.load(checkpoint_file, weights_only=True)
    assert {v.dtype for v in state["model"].values() if v.is_floating_point()} == {torch.float32}
    mlflow.set_tracking_uri(mlflow_uri)
    (logged,) = client.search_logged_models([run.info.experiment_id])
    model = mlflow.pytorch.load_model(logged.model_uri)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_lint_error_stops_before_ray_and_names_the_fix(tmp_path, monkeypatch, write_job, capsys):
    monkeypatch.chdir(tmp_path)
    job = small_job(model={"name": "resnet18"}, precision={"preset": "O2", "keep_norm_fp32": False})
    assert submit(write_job, job) == 2
    err = capsys.readouterr().err
    assert "normalisation layers in float16" in err and "keep_norm_fp32: true" in err
    assert not (tmp_path / "mlflow.db").exists()


def test_export_on_digits_keeps_accuracy_within_half_a_point(ray_session, tmp_path, monkeypatch, write_job,
                                                             mlflow_uri, capsys):
    from orchestrator.cli.export import main as export_main

    monkeypatch.chdir(tmp_path)
    job = small_job(precision={"preset": "O0"}, optim={"schedule": "onecycle", "lr": 0.05},
                    run={"epochs": 6, "max_steps_per_epoch": None},
                    tracking={"uri": mlflow_uri, "experiment": "export", "log_model": True, "log_every_n_steps": 20},
                    export={"dtype": "float16", "max_accuracy_drop": 0.005})
    assert submit(write_job, job) == 0, capsys.readouterr().err
    client, run = only_run(mlflow_uri, "export")
    assert run.data.metrics["eval/accuracy"] >= 0.9
    assert abs(run.data.metrics["export/accuracy_delta"]) <= 0.005
    assert run.data.tags["export_status"] == "logged"
    names = {m.name for m in client.search_logged_models([run.info.experiment_id])}
    assert names == {"model", "model_float16"}

    # The same through the CLI on the finished run, in bfloat16.
    assert export_main([run.info.run_id, "--dtype", "bfloat16", "--tracking-uri", mlflow_uri]) == 0
    names = {m.name for m in client.search_logged_models([run.info.experiment_id])}
    assert "model_bfloat16" in names
    mlflow.set_tracking_uri(mlflow_uri)
    exported = next(m for m in client.search_logged_models([run.info.experiment_id]) if m.name == "model_bfloat16")
    model = mlflow.pytorch.load_model(exported.model_uri)
    assert model(torch.zeros(5, 3, 32, 32)).shape == (5, 10)  # any batch size, not the example's


def test_export_refuses_past_the_allowed_drop_and_logs_no_model(tmp_path, mlflow_uri):
    from orchestrator.config import flatten, load_job, to_yaml
    from orchestrator.train.data import build_datasets
    from orchestrator.runner.export import ExportRefused, export
    from orchestrator.train.models import build_model
    from orchestrator.tracking.tracker import RunTracker

    cfg = load_job(REPO / "jobs" / "quickstart.yaml", ["precision.preset=O0"])
    train, _ = build_datasets(cfg.data, 10)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(3):
        for inputs, targets in torch.utils.data.DataLoader(train, batch_size=64, shuffle=True):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
    # Logits scaled far past fp16's range: fp32's argmax is unchanged, fp16's logits become inf.
    with torch.no_grad():
        model.classifier[3].weight.mul_(1e6)
        model.classifier[3].bias.mul_(1e6)

    tracker = RunTracker.start(mlflow_uri, cfg, run_name="refuse", tags={}, params=flatten(cfg),
                               config_yaml=to_yaml(cfg))
    with pytest.raises(ExportRefused, match="export to float16 refused.*export.max_accuracy_drop=0.005"):
        export(model, cfg, "float16", tracker, max_drop=0.005)
    client = MlflowClient(tracking_uri=mlflow_uri)
    run = client.get_run(tracker.run_id)
    assert run.data.metrics["export/fp32_accuracy"] >= 0.9
    assert run.data.metrics["export/accuracy_delta"] < -0.005
    assert run.data.tags["export_status"] == "refused"
    assert client.search_logged_models([run.info.experiment_id]) == []
    tracker.finish("FINISHED")
