"""`scaling.strategy: fsdp` through submit: 2 Ray Train workers shard the model with FSDP2; a killed worker resumes
from the sharded checkpoint in the same MLflow run (restarted by Ray Train, or continued by `submit --resume`), and
the logged model and the export come from the full weights, read on the driver from the shards. Real Ray, a real
MLflow store."""

import json
from pathlib import Path

import pytest
import torch

from orchestrator.cli.export import main as export_main
from orchestrator.tracking.tracker import RunTracker

from conftest import REPO, drill, small_job
from test_resume_e2e import each_step_once
from test_submit_e2e import only_run

pytestmark = pytest.mark.slow
SIMPLE_CNN_PARAMS = 268_650


class Directory:
    def __init__(self, path: Path):
        self.path = path

    def as_directory(self):
        from contextlib import nullcontext

        return nullcontext(str(self.path))


def test_quickstart_on_two_fsdp_workers_survives_a_killed_worker_and_logs_the_full_model(
        ray_session, tmp_path, monkeypatch, mlflow_uri):

    from orchestrator.cli.submit import main
    from orchestrator.config import load_job
    from orchestrator.train.data import build_datasets
    from orchestrator.train.models import build_model
    from orchestrator.train.strategy import load_trained_weights

    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "killed"
    kill = drill("KillRank", rank=1, at_step=6, marker=str(marker))
    overrides = ["scaling.strategy=fsdp", "run.name=fsdp", "run.epochs=2", "run.max_steps_per_epoch=6",
                 "checkpoint.every_n_steps=4", f"checkpoint.storage_path={tmp_path / 'runs'}",
                 "failure.max_failures=1", "tracking.log_model=true", "tracking.experiment=fsdp",
                 f"tracking.uri={mlflow_uri}", "export.dtype=bfloat16", "export.max_accuracy_drop=1.0",
                 f"callbacks=[{json.dumps(kill)}]"]
    quickstart = REPO / "jobs" / "quickstart.yaml"
    assert main([str(quickstart), *overrides]) == 0
    assert marker.exists(), "the worker was never killed"

    client, run = only_run(mlflow_uri, "fsdp")  # one run: the restarted workers went on in it
    assert run.info.status == "FINISHED" and run.data.tags["resumed_from_step"] == "4"
    # Each step's metrics once: those the killed attempt made and those after the resume at step 4.
    assert each_step_once(client, run.info.run_id, "train/loss") == [5, 6, 10, 12]
    assert each_step_once(client, run.info.run_id, "amp/loss_scale") == [4, 5, 6, 8, 10, 12]
    assert each_step_once(client, run.info.run_id, "eval/accuracy") == [6, 12]
    metrics = run.data.metrics
    assert metrics["memory/params_float32_bytes"] == SIMPLE_CNN_PARAMS * 2  # each worker holds half (O1: fp32 shards)
    assert metrics["memory/rank0_state_bytes"] == metrics["memory/rank1_state_bytes"] > 0

    checkpoints = sorted(p for p in (tmp_path / "runs" / "fsdp").glob("checkpoint_*") if p.is_dir())
    final = checkpoints[-1]
    assert final.name.startswith("checkpoint_000000012_") and (final / "sharded" / ".metadata").is_file()
    assert json.loads((final / "manifest_rank1.json").read_text())["strategy"] == "fsdp"
    assert torch.load(final / "train_state.pt", weights_only=True)["model"] == {}  # the shards hold the weights

    # The logged model is the trained one: the final checkpoint's shards, whole, in eval mode.
    cfg = load_job(quickstart, overrides)
    trained = build_model(cfg.model)
    load_trained_weights(Directory(final), trained)
    logged = RunTracker.open(mlflow_uri, run.info.run_id).load_model()  # its pt2 program, nothing unpickled
    _, eval_set = build_datasets(cfg.data, cfg.model.num_classes)
    batch = torch.stack([eval_set[i][0] for i in range(6)])
    with torch.no_grad():
        torch.testing.assert_close(logged(batch), trained.eval()(batch), rtol=1e-4, atol=1e-5)

    # The export at the end of training, and orchestrator.export from the logged model.
    assert run.data.tags["export_status"] == "logged" and "export/accuracy_delta" in metrics
    assert export_main([run.info.run_id, "--dtype", "float16", "--tracking-uri", mlflow_uri]) == 0
    names = {m.name for m in client.search_logged_models([run.info.experiment_id])}
    assert names == {"model", "model_bfloat16", "model_float16"}


def test_an_o2_fsdp_run_whose_worker_died_continues_with_resume_and_logs_the_full_model_and_memory_per_rank(
        ray_session, tmp_path, monkeypatch, write_job, mlflow_uri):
    """O2 (fp16 units, fp32 shards, a loss scale) with one fp32 layer, 2 FSDP workers, 4 steps. Rank 1 dies at step 3
    with no restarts left: the run fails, its sharded checkpoint of step 2 kept; `submit --resume` continues it
    from that checkpoint in the same MLflow run, which ends with the model read whole from the final shards, the
    audit of each layer's dtypes, and the memory each rank holds (half the model's parameters)."""
    from orchestrator.cli.submit import main
    from orchestrator.config import load_job
    from orchestrator.train.data import build_datasets
    from orchestrator.train.models import build_model
    from orchestrator.train.strategy import load_trained_weights
    from test_guardrails_e2e import artifact_json

    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "killed"
    job = write_job(small_job(
        scaling={"strategy": "fsdp"},
        precision={"preset": "O2", "rules": [{"match": "classifier.3", "dtype": "float32"}]},
        run={"epochs": 1, "max_steps_per_epoch": 4}, checkpoint={"every_n_steps": 2},
        tracking={"uri": mlflow_uri, "experiment": "fsdp-o2", "log_every_n_steps": 1, "log_model": True},
        failure={"max_failures": 0}, callbacks=[drill("KillRank", rank=1, at_step=3, marker=str(marker))]))
    assert main([str(job)]) == 1  # no restart left: the run fails, resumable
    assert marker.exists(), "the worker was never killed"
    client, failed = only_run(mlflow_uri, "fsdp-o2")
    assert failed.info.status == "FAILED" and not client.search_logged_models([failed.info.experiment_id])
    (kept,) = tmp_path.glob("ray_results/*/checkpoint_000000002_*")
    assert (kept / "sharded" / ".metadata").is_file()
    facts = json.loads((kept / "ampflow_checkpoint.json").read_text())  # what --resume is checked against
    assert facts["model_shapes"]["classifier.1.weight"] == [128, 2048]  # the whole weight's shape, not a shard's

    assert main([str(job), "--resume"]) == 0
    client, run = only_run(mlflow_uri, "fsdp-o2")  # the same run, continued
    assert run.info.run_id == failed.info.run_id and run.info.status == "FINISHED"
    assert run.data.tags["resumed_from_step"] == "2"
    assert each_step_once(client, run.info.run_id, "train/loss") == [1, 2, 3, 4]
    assert each_step_once(client, run.info.run_id, "amp/loss_scale") == [1, 2, 3, 4]

    # Memory per rank: each holds half of every parameter, gradient and momentum buffer (fp32 shards: O2's masters).
    metrics = run.data.metrics
    for category in ("params", "grads", "optimizer"):
        assert metrics[f"memory/{category}_float32_bytes"] == SIMPLE_CNN_PARAMS * 2, category
    assert metrics["memory/rank0_state_bytes"] == metrics["memory/rank1_state_bytes"] == 3 * SIMPLE_CNN_PARAMS * 2
    assert metrics["memory/params_bytes"] == SIMPLE_CNN_PARAMS * 2
    assert metrics["memory/activations_float16_bytes"] > 0  # the units compute in fp16
    # The audit: the rule's layer a unit of its own computing in fp32 (handing on fp16, the dtype around it), the
    # others gathered to fp16; every layer stored, computed and output what it promised.
    audit = {e["name"]: e for e in artifact_json(client, run.info.run_id, "precision/audit.json")}
    assert (audit["classifier.3"]["param_dtype"], audit["classifier.3"]["output_dtype"]) == ("float32", "float16")
    assert audit["classifier.3"]["unit"] == "classifier.3"
    assert all(e["output_dtype"] == e["promised_output_dtype"] for e in audit.values() if e["promised_output_dtype"])
    assert (audit["classifier.1"]["param_dtype"], audit["classifier.1"]["output_dtype"]) == ("float16", "float16")
    assert {e["storage_dtype"] for e in audit.values() if e["storage_dtype"]} == {"float32"}

    # The logged model is the final checkpoint's shards, whole: the trained weights, fp32, in eval mode.
    (final,) = tmp_path.glob("ray_results/*/checkpoint_000000004_*")
    assert json.loads((final / "manifest_rank1.json").read_text())["strategy"] == "fsdp"
    cfg = load_job(job)
    trained = build_model(cfg.model)
    load_trained_weights(Directory(final), trained)
    logged = RunTracker.open(mlflow_uri, run.info.run_id).load_model()
    assert {p.dtype for p in logged.parameters()} == {torch.float32}
    _, eval_set = build_datasets(cfg.data, cfg.model.num_classes)
    batch = torch.stack([eval_set[i][0] for i in range(6)])
    with torch.no_grad():
        torch.testing.assert_close(logged(batch), trained.eval()(batch), rtol=1e-4, atol=1e-5)


def test_the_text_example_trains_on_two_fsdp_workers_through_submit_and_logs_a_model_taking_token_ids(
        ray_session, tmp_path, monkeypatch):
    """The text example (token ids and a mask batched by its collate function, bf16-mixed with fp32 embeddings) as its
    job file says, but sharded: two steps, the embeddings' rule honoured in units of their own, and the logged model
    read whole from the shards, taking the int64 ids."""
    import shutil
    import sys

    import mlflow

    from orchestrator.cli.submit import main
    from test_guardrails_e2e import artifact_json

    example = tmp_path / "text-classification"
    shutil.copytree(REPO / "examples" / "text-classification", example)
    monkeypatch.chdir(example)  # as a user runs it: from the example's directory
    monkeypatch.delitem(sys.modules, "textcls", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["job.yaml", "scaling.strategy=fsdp", "run.epochs=1", "run.max_steps_per_epoch=2",
                 "data.kwargs.train_samples=128", "data.kwargs.eval_samples=32", f"tracking.uri={uri}",
                 "tracking.log_every_n_steps=1", "tracking.system_metrics_interval_s=0"]) == 0

    client, run = only_run(uri, "text-classification")
    metrics = run.data.metrics
    assert 0 < metrics["eval/f1_macro"] <= 1 and metrics["memory/rank0_state_bytes"] > 0
    audit = {e["name"]: e for e in artifact_json(client, run.info.run_id, "precision/audit.json")}
    for name in ("tokens", "positions"):  # the rule's layers: units of their own, stored in fp32
        assert audit[name]["unit"] == name and audit[name]["param_dtype"] == "float32", audit[name]
    (final,) = (example / "ray_results").glob("*/checkpoint_000000002_*")
    assert json.loads((final / "manifest_rank0.json").read_text())["strategy"] == "fsdp"

    model_uri = f"runs:/{run.info.run_id}/model"
    specs = [(s.name, str(s.type)) for s in mlflow.models.get_model_info(model_uri).signature.inputs.inputs]
    assert specs == [("input_ids", "int64"), ("attention_mask", "bool")]
    sys.path.insert(0, str(example))
    try:
        import textcls
    finally:
        sys.path.remove(str(example))
    _, evaluation = textcls.make_datasets(16, 6)
    batch = textcls.pad_collate([evaluation[i] for i in range(6)])
    with torch.no_grad():
        assert mlflow.pytorch.load_model(model_uri)(batch["input_ids"], batch["attention_mask"]).shape == (6, 4)
