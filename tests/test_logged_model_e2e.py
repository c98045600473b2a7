"""The model a run logs predicts in eval mode: a sample's output never depends on the batch it came in."""

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO, small_job

pytestmark = pytest.mark.slow


def test_the_logged_model_is_the_trained_model_in_eval_mode(ray_session, tmp_path, write_job, mlflow_uri,
                                                             monkeypatch, capsys):
    """Also: a registry that refuses `tracking.register_model` costs a warning, and the run still ends FINISHED
    with its model logged; `orchestrator.predict(run_id, batch)` gives the trained model's outputs.

    Long: a ResNet-18 trained through submit, exported and logged, then loaded back (ampflow's loader and
    `orchestrator.predict`) and compared with the model rebuilt from its last checkpoint."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from orchestrator import predict
    from orchestrator.cli.submit import main
    from orchestrator.config import load_job
    from orchestrator.tracking.tracker import RunTracker
    from orchestrator.checkpoint.files import read_checkpoint
    from orchestrator.train.data import build_datasets
    from orchestrator.train.models import build_model

    storage = tmp_path / "ray_results"
    job = write_job(small_job(model={"name": "resnet18"}, precision={"preset": "O0"},
                              run={"name": "logged", "max_steps_per_epoch": 3},
                              tracking={"uri": mlflow_uri, "experiment": "logged", "log_model": True,
                                        "register_model": "refused"},
                              checkpoint={"storage_path": str(storage)}))
    monkeypatch.chdir(tmp_path)

    def no_registry(*args, **kwargs):
        raise MlflowException("this tracking server has no model registry")

    monkeypatch.setattr(MlflowClient, "create_model_version", no_registry)
    assert main([str(job)]) == 0
    assert "could not register the model as 'refused'" in capsys.readouterr().err
    client = MlflowClient(tracking_uri=mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("logged").experiment_id])
    assert run.info.status == "FINISHED" and "registered_model" not in run.data.tags
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
    predicted = predict(run.info.run_id, batch, tracking_uri=mlflow_uri)  # as trained: fp32 (O0), eval mode
    torch.testing.assert_close(predicted, expected, rtol=1e-4, atol=1e-5)


def test_with_a_score_metric_the_best_checkpoint_not_the_last_is_logged(ray_session, tmp_path, write_job,
                                                                         mlflow_uri, monkeypatch):
    """Scored by the lowest eval/loss, evaluated every 2 steps (`run.eval_every_n_steps`) with a checkpoint every
    step, mid-epoch included, and a learning rate high enough that the last evaluation is not the best: the
    checkpoints without an evaluation never displace evaluated ones (storage ends with the 2 best evaluated and
    the newest, `num_to_keep` 2), the logged model has the best checkpoint's weights, not the final ones, and the
    run says from which step. With `tracking.register_model` that model is version 1 of the registered name,
    tagged with the preset, the run and its final metrics.

    The same run (one submit for both) carries the job's own callbacks: examples/callbacks's weight average (on
    every rank, evaluated at each epoch's end: a collective) and a rank-0-only one of this file's; what they add
    to the reports reaches MLflow as metrics, a tag and a JSON artifact, and the rank-0 one runs on rank 0
    alone."""
    from mlflow import MlflowClient

    from orchestrator.cli.submit import main
    from orchestrator.tracking.tracker import RunTracker
    from orchestrator.checkpoint.files import read_checkpoint

    storage = tmp_path / "ray_results"
    job = write_job(small_job(precision={"preset": "O0"},
                              run={"name": "best", "epochs": 3, "max_steps_per_epoch": 4, "eval_every_n_steps": 2},
                              tracking={"uri": mlflow_uri, "experiment": "best", "log_model": True,
                                        "register_model": "digits-best"},
                              checkpoint={"storage_path": str(storage), "num_to_keep": 2, "every_n_steps": 1,
                                          "score_metric": "eval/loss", "score_mode": "min"},
                              callbacks=[{"name": "ema:WeightAverage", "kwargs": {"decay": 0.9}},
                                         {"name": "test_logged_model_e2e:RankZeroNotes",
                                          "kwargs": {"directory": str(tmp_path)}}]))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO / "examples" / "callbacks"))  # shipped to the workers from there
    assert main([str(job)]) == 0
    client = MlflowClient(tracking_uri=mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("best").experiment_id])
    run_id = run.info.run_id
    losses = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval/loss")}
    best = min(losses, key=losses.get)
    assert sorted(losses) == [2, 4, 6, 8, 10, 12] and best != 12, f"the last evaluation must not be the best: {losses}"
    assert run.data.tags["best_checkpoint_step"] == str(best)

    checkpoints = {int(p.name.split("_")[1]): p for p in (storage / "best").glob("checkpoint_0*")}
    assert set(checkpoints) == {*sorted(losses, key=losses.get)[:2], 12}, f"kept {sorted(checkpoints)}: {losses}"
    logged = RunTracker.open(mlflow_uri, run.info.run_id).load_model().state_dict()
    chosen, last = read_checkpoint(checkpoints[best], rank=0).model, read_checkpoint(checkpoints[12], rank=0).model
    for name, weight in chosen.items():
        torch.testing.assert_close(logged[name], weight, rtol=0, atol=0, msg=name)
    assert any(not torch.equal(logged[name], last[name]) for name in last)

    version = client.get_model_version("digits-best", "1")
    assert run.data.tags["registered_model"] == "digits-best/1" and version.run_id == run.info.run_id
    assert version.tags["preset"] == "O0" and version.tags["run_id"] == run.info.run_id
    assert float(version.tags["eval/loss"]) == pytest.approx(losses[12], rel=1e-5)  # the run's final value

    # The callbacks: a report every step (a checkpoint each), epoch ends at 4, 8 and 12.
    seen = {m.step: m.value for m in client.get_metric_history(run_id, "notes/steps_seen")}
    assert seen == {step: float(step) for step in range(1, 13)}
    assert run.data.tags["notes.world_size"] == "2"
    steps = json.loads(Path(client.download_artifacts(run_id, "notes/steps.json")).read_text())
    assert steps == {"steps": list(range(1, 13))}
    assert sorted(p.name for p in tmp_path.glob("ran_on_rank_*")) == ["ran_on_rank_0"]
    averaged = {m.step: m.value for m in client.get_metric_history(run_id, "ema/eval/loss")}
    assert sorted(averaged) == [4, 8, 12] and all(averaged[step] != losses[step] for step in averaged)
    assert "ema/eval/accuracy" in run.data.metrics


class RankZeroNotes:
    """Rank 0 alone: leaves a file naming the rank it ran on, and reports a metric, a tag and a table."""

    rank_zero_only = True

    def __init__(self, directory: str):
        self.directory, self.steps = Path(directory), []

    def setup(self, loop):
        (self.directory / f"ran_on_rank_{loop.rank}").touch()

    def after_step(self, loop, step):
        self.steps.append(step.number)

    def collect(self, loop, report):
        report.metrics["notes/steps_seen"] = float(len(self.steps))
        report.tags["notes.world_size"] = str(loop.world_size)
        report.tables["notes/steps"] = {"steps": self.steps}
