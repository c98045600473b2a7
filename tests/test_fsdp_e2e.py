"""`scaling.strategy: fsdp` through submit: 2 Ray Train workers shard the model with FSDP2; a killed worker resumes
from the sharded checkpoint in the same MLflow run, and the logged model and the export come from the full weights,
read on the driver from the shards. Real Ray, a real MLflow store."""

import json
from pathlib import Path

import pytest
import torch

from orchestrator.cli.export import main as export_main
from orchestrator.tracking.summary_values import values
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


def test_an_o2_fsdp_run_survives_a_killed_worker_from_its_shards_and_logs_and_exports_the_full_model(
        ray_session, tmp_path, monkeypatch, write_job, mlflow_uri):
    """O2 (fp16 units, fp32 shards, a loss scale) with one fp32 layer on 2 FSDP workers, 4 steps. Rank 1 is killed at
    step 3; Ray Train restarts the workers from the sharded checkpoint of step 2 in the same MLflow run. The run ends
    with each step's metrics once, the memory each rank holds (half of the model), the audit of each layer's dtypes,
    the model read whole from the final shards, and its exports (at the end of training and by
    `orchestrator.export`). (`submit --resume` loads a sharded checkpoint as the restart does: tests/test_fsdp_loop.py
    and tests/test_resume_checks.py.)

    Long: two attempts of two FSDP workers (the second from the shards), then the model read whole and exported.
    """
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
        export={"dtype": "bfloat16", "max_accuracy_drop": 1.0},
        failure={"max_failures": 1}, callbacks=[drill("KillRank", rank=1, at_step=3, marker=str(marker))]))
    assert main([str(job)]) == 0
    assert marker.exists(), "the worker was never killed"

    client, run = only_run(mlflow_uri, "fsdp-o2")  # one run: the restarted workers went on in it
    assert run.info.status == "FINISHED" and run.data.tags["resumed_from_step"] == "2"
    assert each_step_once(client, run.info.run_id, "train/loss") == [1, 2, 3, 4]
    assert each_step_once(client, run.info.run_id, "amp/loss_scale") == [1, 2, 3, 4]

    # Memory per rank: each holds half of every parameter, gradient and momentum buffer (fp32 shards: O2's masters).
    metrics = values(run.data.metrics, run.data.tags)  # a value that never changed is a summary tag
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

    # The checkpoints hold shards; what --resume is checked against names the whole weights' shapes.
    (final,) = tmp_path.glob("ray_results/*/checkpoint_000000004_*")
    assert (final / "sharded" / ".metadata").is_file()
    assert json.loads((final / "manifest_rank1.json").read_text())["strategy"] == "fsdp"
    assert torch.load(final / "train_state.pt", weights_only=True)["model"] == {}  # the shards hold the weights
    facts = json.loads((final / "ampflow_checkpoint.json").read_text())
    assert facts["model_shapes"]["classifier.1.weight"] == [128, 2048]  # the whole weight's shape, not a shard's

    # The logged model is the final checkpoint's shards, whole: the trained weights, fp32, in eval mode.
    cfg = load_job(job)
    trained = build_model(cfg.model)
    load_trained_weights(Directory(final), trained)
    logged = RunTracker.open(mlflow_uri, run.info.run_id).load_model()  # its pt2 program, nothing unpickled
    assert {p.dtype for p in logged.parameters()} == {torch.float32}
    _, eval_set = build_datasets(cfg.data, cfg.model.num_classes)
    batch = torch.stack([eval_set[i][0] for i in range(6)])
    with torch.no_grad():
        torch.testing.assert_close(logged(batch), trained.eval()(batch), rtol=1e-4, atol=1e-5)

    # The export at the end of training, and orchestrator.export from the logged model.
    assert run.data.tags["export_status"] == "logged" and "export/accuracy_delta" in metrics
    assert export_main([run.info.run_id, "--dtype", "float16", "--tracking-uri", mlflow_uri]) == 0
    names = {m.name for m in client.search_logged_models([run.info.experiment_id])}
    assert names == {"model", "model_bfloat16", "model_float16"}


def test_the_text_example_trains_on_two_fsdp_workers_through_submit_and_logs_a_model_taking_token_ids(new_store, 
        ray_session, tmp_path, monkeypatch):
    """The text example (token ids and a mask batched by its collate function, bf16-mixed with fp32 embeddings) as its
    job file says, but sharded: two steps, the embeddings' rule honoured in units of their own, and the logged model
    read whole from the shards, taking the int64 ids.

    Long: two FSDP workers in bf16 (about 10x slower than fp32 on these CPUs), then the model read whole.
    """
    import shutil
    import sys

    import mlflow

    from orchestrator.cli.submit import main
    from test_guardrails_e2e import artifact_json

    example = tmp_path / "text-classification"
    shutil.copytree(REPO / "examples" / "text-classification", example)
    monkeypatch.chdir(example)  # as a user runs it: from the example's directory
    monkeypatch.delitem(sys.modules, "textcls", raising=False)
    uri = new_store(tmp_path)
    assert main(["job.yaml", "scaling.strategy=fsdp", "run.epochs=1", "run.max_steps_per_epoch=2",
                 "data.kwargs.train_samples=128", "data.kwargs.eval_samples=32", f"tracking.uri={uri}",
                 "tracking.log_every_n_steps=1", "tracking.system_metrics_interval_s=0"]) == 0

    client, run = only_run(uri, "text-classification")
    metrics = values(run.data.metrics, run.data.tags)
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
