"""The run page at a glance, on a real SQLite MLflow store and without Ray: counters that stay put and values set
once are summary tags, not one-dot charts, while a counter that moves is charted under its own name; memory reads
in MiB; the experiment opens in MLflow's model-training view."""

import pytest
import torch
from mlflow import MlflowClient

from conftest import small_job
from orchestrator.config import load_job
from orchestrator.tracking.tracker import EXPERIMENT_KIND_TAG, TRAINING_KIND, RunTracker, view_hint
from orchestrator.tracking.writer import MlflowWriter
from orchestrator.common.report import Report


@pytest.fixture
def tracker(write_job, mlflow_uri):
    cfg = load_job(write_job(small_job(tracking={"uri": mlflow_uri, "experiment": "page"})))
    return RunTracker.start(mlflow_uri, cfg, run_name="page", tags={}, params={}, config_yaml="a: 1\n")


def history(tracker, key):
    return sorted((m.step, m.value) for m in MlflowClient(tracking_uri=tracker.uri).get_metric_history(
        tracker.run_id, key))


def test_counters_that_stay_put_end_as_summary_tags_and_a_counter_that_moves_is_charted_from_its_first_step(
        tracker):
    writer = MlflowWriter(relay=None, tracker=tracker)
    for step, skipped, peak in ((5, 0.0, 3 * 2**20), (10, 0.0, 3 * 2**20), (15, 2.0, 4 * 2**20), (20, 2.0, 4 * 2**20)):
        writer.enqueue(Report(step=step, metrics={
            "train/loss": 1.0 / step, "amp/nan_loss_steps": 0.0, "amp/growth_events": 0.0,
            "amp/skipped_steps": skipped, "system/world_size": 2.0,
            "memory/params_float32_bytes": 1_074_600.0, "memory/activations_float32_bytes": 1284.0,
            "memory/peak_bytes": peak,
            **({"perf/time_to_first_step_s": 12.5} if step == 5 else {})}))
    writer.close(timeout_s=5)

    run = MlflowClient(tracking_uri=tracker.uri).get_run(tracker.run_id)
    charted, tags = set(run.data.metrics), run.data.tags
    for key in ("amp/nan_loss_steps", "amp/growth_events", "system/world_size", "perf/time_to_first_step_s",
                "memory/params_float32_bytes"):
        assert key not in charted and key in tags, key
    assert (tags["amp/nan_loss_steps"], tags["system/world_size"], tags["perf/time_to_first_step_s"]) == \
        ("0", "2", "12.5")
    assert tags["memory/params_float32_bytes"] == "1.02 MiB (1074600 B)"
    assert tags["memory/activations_float32_bytes"] == "1.3 KiB (1284 B)"
    # It moved at step 15: charted from its first step, its held value kept until the step before.
    assert history(tracker, "amp/skipped_steps") == [(5, 0.0), (10, 0.0), (15, 2.0), (20, 2.0)]
    assert history(tracker, "memory/peak_bytes") == [(5, 3 * 2**20), (10, 3 * 2**20), (15, 4 * 2**20),
                                                     (20, 4 * 2**20)]
    assert history(tracker, "memory/peak_mib") == [(5, 3.0), (10, 3.0), (15, 4.0), (20, 4.0)]
    assert "memory/params_float32_mib" not in charted and "amp/skipped_steps" not in tags
    assert history(tracker, "train/loss") == [(5, 0.2), (10, 0.1), (15, 1 / 15), (20, 0.05)]
    # Read back as numbers by ampflow's own readers (the console's summary, a sweep's report).
    latest = tracker.latest_metrics()
    assert latest["amp/nan_loss_steps"] == 0.0 and latest["memory/params_float32_bytes"] == 1_074_600.0
    assert latest["amp/skipped_steps"] == 2.0
    assert [(m.step, m.value) for m in tracker.metric_history("system/world_size")] == [(0, 2.0)]


def test_a_resumed_run_charts_a_summary_value_that_moves_after_the_resume(tracker):
    first = MlflowWriter(relay=None, tracker=tracker)
    first.enqueue(Report(step=5, metrics={"amp/nan_loss_steps": 0.0, "amp/growth_events": 0.0}))
    first.close(timeout_s=5)

    resumed = MlflowWriter(relay=None, tracker=RunTracker.open(tracker.uri, tracker.run_id))
    resumed.resume_from_run()
    resumed.enqueue(Report(step=10, metrics={"amp/nan_loss_steps": 1.0, "amp/growth_events": 0.0}))
    resumed.close(timeout_s=5)
    assert [value for _, value in history(tracker, "amp/nan_loss_steps")][-1] == 1.0
    assert history(tracker, "amp/growth_events") == []
    assert "amp/nan_loss_steps" not in tracker.tags() and tracker.tags()["amp/growth_events"] == "0"
    assert tracker.latest_metrics()["amp/nan_loss_steps"] == 1.0


def test_a_held_value_that_mlflow_refused_is_logged_whole_on_the_retry(tracker, monkeypatch):
    writer = MlflowWriter(relay=None, tracker=tracker)
    writer.enqueue(Report(step=5, metrics={"amp/skipped_steps": 0.0}))
    assert writer._flush(force=True)
    real = RunTracker.log_metrics

    def refuses(self, metrics, step=0, timestamp_ms=None):
        raise ConnectionError("MLflow went away (injected)")

    monkeypatch.setattr(RunTracker, "log_metrics", refuses)
    writer.enqueue(Report(step=10, metrics={"amp/skipped_steps": 1.0}))
    assert not writer._flush(force=True)
    monkeypatch.setattr(RunTracker, "log_metrics", real)
    assert writer._flush(force=True)
    assert history(tracker, "amp/skipped_steps") == [(5, 0.0), (10, 1.0)]


def test_the_experiment_opens_in_mlflows_model_training_view_and_a_kind_its_owner_chose_is_kept(
        write_job, mlflow_uri):
    client = MlflowClient(tracking_uri=mlflow_uri)
    cfg = load_job(write_job(small_job(tracking={"uri": mlflow_uri, "experiment": "fresh"})))
    tracker = RunTracker.start(mlflow_uri, cfg, run_name="r", tags={}, params={}, config_yaml="a: 1\n")
    assert client.get_experiment(tracker.experiment_id).tags[EXPERIMENT_KIND_TAG] == TRAINING_KIND

    existing = client.create_experiment("made-elsewhere")  # an experiment ampflow did not create: tagged on use
    cfg = load_job(write_job(small_job(tracking={"uri": mlflow_uri, "experiment": "made-elsewhere"})))
    RunTracker.start(mlflow_uri, cfg, run_name="r", tags={}, params={}, config_yaml="a: 1\n")
    assert client.get_experiment(existing).tags[EXPERIMENT_KIND_TAG] == "custom_model_development"

    # MLflow 3.17 chooses the view from the URL: the links ampflow prints ask for the model-training one.
    assert view_hint("http://mlflow:5000/", "3", "abc") == \
        "http://mlflow:5000/#/experiments/3/runs/abc?workflowType=machine_learning"
    assert view_hint(mlflow_uri, "3", "abc").endswith("#/experiments/3/runs/abc?workflowType=machine_learning")

    chosen = client.create_experiment("genai", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    cfg = load_job(write_job(small_job(tracking={"uri": mlflow_uri, "experiment": "genai"})))
    RunTracker.start(mlflow_uri, cfg, run_name="r", tags={}, params={}, config_yaml="a: 1\n")
    assert client.get_experiment(chosen).tags[EXPERIMENT_KIND_TAG] == "genai_development"


def test_the_logged_model_carries_the_runs_metrics_at_its_checkpoint_with_the_datasets_they_were_measured_on(
        tracker, write_job):
    from orchestrator.runner.outputs import model_tags
    from orchestrator.tracking.lineage import DatasetLineage
    from orchestrator.tracking.logged_model import ModelInputs

    datasets = [DatasetLineage("digits", context, digest, "code", '{"tags": {}}', 100, [4], "float32", [], "int64",
                               ((None, "float32", [4]),)) for context, digest in (("train", "aaaa1111"),
                                                                               ("eval", "bbbb2222"))]
    tracker.log_datasets(datasets)
    for step, loss, accuracy in ((10, 0.9, 0.5), (20, 0.5, 0.8), (30, 0.4, 0.7)):
        tracker.log_metrics({"train/loss": loss, "eval/accuracy": accuracy, "perf/samples_per_s": 100.0}, step)
    tracker.log_model(torch.nn.Linear(4, 2).eval(), ModelInputs.from_shape([4]))
    tracker.describe_model("model", step=20, tags={"model": "linear", "weights": "float32, eval mode"})

    client = MlflowClient(tracking_uri=tracker.uri)
    (model,) = client.search_logged_models([tracker.experiment_id])
    linked = {m.key: (m.step, m.value, m.dataset_name, m.dataset_digest) for m in model.metrics}
    assert linked == {"train/loss": (20, 0.5, "digits", "aaaa1111"), "eval/accuracy": (20, 0.8, "digits", "bbbb2222")}
    assert model.name == "model" and model.tags["model"] == "linear"
    # The run's own histories are unchanged: no point added twice.
    assert history(tracker, "train/loss") == [(10, 0.9), (20, 0.5), (30, 0.4)]
    tuned = load_job(write_job(small_job(precision={"rules": [{"match": "fc*", "dtype": "bfloat16"}]})))
    tags = model_tags(tuned, "pt2")
    assert {key: tags[key] for key in ("model", "weights", "trained_with", "format")} == {
        "model": tuned.model.name, "weights": "float32, eval mode",
        "trained_with": "custom (compute float32; fc*=bfloat16)", "format": "pt2"}
    assert "fc*=bfloat16" in tags["mlflow.note.content"]  # the page's description


def test_a_held_value_is_in_the_run_as_soon_as_its_report_counts_as_logged(tracker):
    """The workers drop a report once the writer says it is logged: a driver dying after that must not take a
    held value with it, so its summary tag is written with its first report, and goes once the value moves."""
    told = []
    writer = MlflowWriter(relay=None, tracker=tracker, on_logged=told.append)
    writer.enqueue(Report(seq=1, step=5, metrics={"amp/nan_loss_steps": 0.0, "memory/params_bytes": 2048.0}))
    assert writer._flush(force=True)
    writer._tell_logged(force=True)
    assert told == [1]
    assert tracker.tags()["amp/nan_loss_steps"] == "0" and tracker.tags()["memory/params_bytes"] == "2.0 KiB (2048 B)"
    writer.enqueue(Report(seq=2, step=10, metrics={"amp/nan_loss_steps": 1.0, "memory/params_bytes": 2048.0}))
    assert writer._flush(force=True)
    assert "amp/nan_loss_steps" not in tracker.tags() and history(tracker, "amp/nan_loss_steps") == [(5, 0.0),
                                                                                                    (10, 1.0)]
    assert tracker.tags()["memory/params_bytes"] == "2.0 KiB (2048 B)"
