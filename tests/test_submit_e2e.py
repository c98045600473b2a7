"""End to end through `orchestrator.cli.submit`: real Ray workers, a real MLflow store."""

import os
import subprocess
import sys
from collections import defaultdict

import pytest
from mlflow import MlflowClient

from orchestrator.tracking.summary_values import values

from conftest import REPO, small_job

pytestmark = pytest.mark.slow

ISSUE_METRICS = [
    "train/loss", "eval/loss", "eval/accuracy", "amp/loss_scale", "amp/skipped_steps",
    "perf/samples_per_s", "memory/peak_bytes",
]
"""Charted at least once per epoch. `memory/params_bytes` never changes in a run: a summary tag, not a chart."""


def only_run(uri: str, experiment: str):
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"experiment {experiment} was not created"
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, f"expected exactly one MLflow run, found {len(runs)}"
    return client, runs[0]


def test_quickstart_two_workers_fp16_reaches_90_percent(new_store, tmp_path):
    """`make run`'s job as a user runs it: submit starts a local Ray, two DDP workers train simple_cnn under fp16
    autocast with a GradScaler to 90% eval accuracy, and every issue metric reaches the run in every epoch.

    Long: four real epochs (an accuracy means nothing before them), in fp16, which these CPUs run about 10x slower
    than fp32 (no native half precision): about 90 s on a quiet 2-core machine, several times that beside other tests."""
    uri = new_store(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.submit", "jobs/quickstart.yaml", "tracking.system_metrics_interval_s=1",
         f"tracking.uri={uri}", f"checkpoint.storage_path={tmp_path / 'ray_results'}"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env={**os.environ, "MLFLOW_TRACKING_URI": "sqlite:////nonexistent/should-not-be-used.db"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "epoch 4/4 | step " in out.stderr and "MLflow run " in out.stderr  # progress and where the run is
    assert "INFO mlflow" not in out.stderr and "Token authentication" not in out.stderr  # no chatter without -v
    client, run = only_run(uri, "quickstart")
    assert run.info.status == "FINISHED"
    assert run.info.run_id in out.stdout and "mlflow ui --backend-store-uri" in out.stdout

    # Every issue metric at least once per epoch, on the global-step axis.
    epochs = int(run.data.params["run.epochs"])
    steps_per_epoch = None
    for name in ISSUE_METRICS:
        history = client.get_metric_history(run.info.run_id, name)
        assert history, f"{name} was never logged"
        if name == "eval/accuracy":
            assert len(history) == epochs
            steps_per_epoch = history[0].step
    for name in ISSUE_METRICS:
        per_epoch = defaultdict(int)
        for point in client.get_metric_history(run.info.run_id, name):
            per_epoch[(point.step - 1) // steps_per_epoch] += 1
        assert sorted(per_epoch) == list(range(epochs)), f"{name} missing in some epoch: {dict(per_epoch)}"

    assert run.data.metrics["eval/accuracy"] >= 0.90
    # fp16 autocast on CPU with an active GradScaler: a real scale, not the 1.0 of "no scaler".
    scales = [m.value for m in client.get_metric_history(run.info.run_id, "amp/loss_scale")]
    assert all(scale > 1.0 for scale in scales)
    assert values(run.data.metrics, run.data.tags)["memory/params_bytes"] == 268_650 * 4  # simple_cnn in fp32
    assert run.data.tags["memory/params_bytes"] == "1.02 MiB (1074600 B)" and "memory/params_bytes" not in \
        run.data.metrics  # the same all run: read at a glance, not a flat chart

    assert run.data.params["model.name"] == "simple_cnn"
    assert run.data.params["precision.compute_dtype"] == "float16"
    assert run.data.tags["preset"] == "O1" and run.data.tags["world_size"] == "2"
    assert run.data.tags["device"] == "cpu"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "config")}
    assert artifacts == {"config/job.yaml"}
    logged = client.search_logged_models([run.info.experiment_id])
    assert len(logged) == 1 and logged[0].source_run_id == run.info.run_id

    # What MLflow's UI shows beside the metrics: who ran it from where, on which data, and each rank's system.
    assert run.data.tags["mlflow.user"] and run.data.tags["mlflow.source.name"] == "jobs/quickstart.yaml"
    assert "mlflow.source.git.commit" in run.data.tags or not (REPO / ".git").exists()
    contexts = {tag.value for item in run.inputs.dataset_inputs for tag in item.tags
                if tag.key == "mlflow.data.context"}
    assert contexts == {"train", "eval"} and all(item.dataset.digest for item in run.inputs.dataset_inputs)
    for rank in (0, 1):
        cpu = client.get_metric_history(run.info.run_id, f"system/rank_{rank}/cpu_utilization_percentage")
        rss = client.get_metric_history(run.info.run_id, f"system/rank_{rank}/memory_rss_megabytes")
        assert len(cpu) >= 2 and len(rss) >= 2, f"rank {rank} sampled {len(cpu)} time(s)"
        assert all(0 <= m.value <= 100 * os.cpu_count() for m in cpu) and all(m.value > 0 for m in rss)


CUSTOM_MODEL = """
import torch.nn as nn

class {name}(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x):
        {forward}
"""


def _submit_in(tmp_path, monkeypatch, capsys, write_job, module: str, job: dict):
    from orchestrator.cli.submit import main

    (tmp_path / f"{module}.py").write_text(job.pop("_source"))
    monkeypatch.chdir(tmp_path)
    rc = main([str(write_job(job))])
    return rc, capsys.readouterr()


def test_model_by_import_path_is_shipped_to_the_workers_and_what_it_prints_reaches_the_console(
        tmp_path, write_job, mlflow_uri):
    """A model by import path from the job's directory reaches the workers through the real CLI, and what it prints
    reaches the console once, from rank 0, with no other chatter under -q.

    Long: the CLI in a process of its own starts a Ray there (shipping the module is what the case is about), and
    the model trains in bf16, about 10x slower than fp32 on these CPUs."""
    # Through the real CLI in its own directory: Ray starts there and ships the module to the workers. The model
    # prints on every training forward; run.worker_output defaults to rank0. -q: no progress, no chatter.
    printing = "if self.training:\n            print(f'forward of {x.shape[0]} samples')\n        return self.body(x)"
    (tmp_path / "user_nets_ok.py").write_text(CUSTOM_MODEL.format(name="Net", forward=printing))
    job = small_job(model={"name": "user_nets_ok:Net"}, tracking={"uri": mlflow_uri, "experiment": "custom"},
                    precision={"preset": "bf16-mixed"})
    out = subprocess.run([sys.executable, "-m", "orchestrator.submit", str(write_job(job)), "-q"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    printed = [line for line in out.stderr.splitlines() if "forward of" in line]
    assert printed == ["[rank 0] forward of 32 samples"] * 4, out.stderr  # 4 steps, rank 0's, each once
    for chatter in ("epoch 1/1", "MLflow run ", "INFO", "Token authentication"):
        assert chatter not in out.stderr, chatter
    assert "Run finished:" in out.stdout
    client, run = only_run(mlflow_uri, "custom")
    assert run.info.status == "FINISHED"
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 2  # steps 2 and 4
    assert run.data.metrics["amp/loss_scale"] == 1.0  # bf16: no scaler
    assert run.data.tags["preset"] == "bf16-mixed"


def test_worker_exception_exits_1_reports_it_first_and_fails_the_run(
    ray_session, tmp_path, monkeypatch, capsys, write_job, mlflow_uri
):
    job = small_job(model={"name": "user_nets_bad:Net"}, tracking={"uri": mlflow_uri, "experiment": "broken"})
    # It fails only when training, on the workers: pre-flight's eval-mode forward of two samples passes.
    job["_source"] = CUSTOM_MODEL.format(
        name="Net", forward="if self.training:\n            raise ValueError('forward exploded on purpose')\n"
                            "        return self.body(x)")
    rc, out = _submit_in(tmp_path, monkeypatch, capsys, write_job, "user_nets_bad", job)
    assert rc == 1
    failure = out.err[out.err.index("training failed:"):]
    first = failure.splitlines()[0]
    assert first.startswith("training failed: worker rank ")
    assert first.endswith("raised ValueError: forward exploded on purpose")
    assert "user_nets_bad.py" in failure.splitlines()[1]  # where it was raised
    _, run = only_run(mlflow_uri, "broken")
    assert run.info.status == "FAILED"
