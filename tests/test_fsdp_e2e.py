"""The quickstart under `scaling.strategy: fsdp` through submit: 2 Ray Train workers shard the model with FSDP2, a
killed worker resumes from the sharded checkpoint in the same MLflow run, and the logged model and the export
come from the full weights, read on the driver from the shards. Real Ray, a real MLflow store."""

from pathlib import Path

import pytest
import torch

from conftest import REPO, drill
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
    import json

    from orchestrator.cli.export import main as export_main
    from orchestrator.cli.submit import main
    from orchestrator.config import load_job
    from orchestrator.tracking.tracker import RunTracker
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
    assert metrics["memory/params/float32"] == SIMPLE_CNN_PARAMS * 2  # each worker holds half (O1: fp32 shards)
    assert metrics["memory/state_bytes/rank0"] == metrics["memory/state_bytes/rank1"] > 0

    checkpoints = sorted(p for p in (tmp_path / "runs" / "fsdp").glob("checkpoint_*") if p.is_dir())
    final = checkpoints[-1]
    assert final.name.startswith("checkpoint_000000012_") and (final / "sharded" / ".metadata").is_file()
    assert json.loads((final / "manifest_rank1.json").read_text())["strategy"] == "fsdp"
    assert torch.load(final / "train_state.pt", weights_only=True)["model"] == {}  # the shards hold the weights

    # The logged model is the trained one: the final checkpoint's shards, whole, in eval mode.
    cfg = load_job(quickstart, overrides)
    trained = build_model(cfg.model)
    load_trained_weights(Directory(final), trained)
    logged = RunTracker.open(mlflow_uri, run.info.run_id).load_model()
    _, eval_set = build_datasets(cfg.data, cfg.model.num_classes)
    batch = torch.stack([eval_set[i][0] for i in range(6)])
    with torch.no_grad():
        torch.testing.assert_close(logged(batch), trained.eval()(batch), rtol=1e-4, atol=1e-5)

    # The export at the end of training, and orchestrator.export from the logged model.
    assert run.data.tags["export_status"] == "logged" and "export/accuracy_delta" in metrics
    assert export_main([run.info.run_id, "--dtype", "float16", "--tracking-uri", mlflow_uri]) == 0
    names = {m.name for m in client.search_logged_models([run.info.experiment_id])}
    assert names == {"model", "model_bfloat16", "model_float16"}
