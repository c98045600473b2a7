"""Nothing non-finite is ever checkpointed, logged as a model or exported, and a run that trained nothing does
not end as if it had: on the Ray-free loop (one process, or two gloo ranks), MLflow in a SQLite file.

The drills (`tests/drills.py`) make the failures: a NaN loss, an inf gradient, a NaN weight.
"""

import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import drill, small_job
from orchestrator.config import load_job
from orchestrator.precision import LossScaleCollapsed, NonFiniteGradients, NothingTrained
from orchestrator.checkpoint.files import FACTS_FILE, NonFiniteState, STATE_FILE
from orchestrator.train.local import LocalSession, spawn
from orchestrator.train.loop import TrainingLoop

CPU = torch.device("cpu")


def job(write_job, **sections):
    sections.setdefault("scaling", {"num_workers": 1})
    sections["precision"] = {"preset": "O0", **sections.get("precision", {})}
    sections["run"] = {"max_steps_per_epoch": 4, **sections.get("run", {})}
    return load_job(write_job(small_job(**sections)))


def train(cfg, directory: Path) -> LocalSession:
    session = LocalSession(0, 1, CPU, directory)
    TrainingLoop(cfg, session).run()
    return session


def finite(state: dict) -> bool:
    return all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())


def checkpoints(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


# -- gradients without a scaler ---------------------------------------------------------------------------


def test_fp32_nonfinite_gradients_are_skipped_by_default_and_never_reach_the_weights(write_job, tmp_path):
    """The loss is finite, one gradient is not: the step is skipped and counted, the layer is recorded, and the
    run's checkpoint is finite."""
    cfg = job(write_job, callbacks=[drill("Overflow", at_steps=[2])])
    session = train(cfg, tmp_path / "run")
    last = session.reports[-1]
    assert last.metrics["amp/nonfinite_grad_steps"] == 1.0 and last.metrics["amp/skipped_steps"] == 1.0
    records = [r for report in session.reports for r in report.overflow_records]
    assert [(r["step"], r["event"], r["action"], r["kind"]) for r in records] == [(2, "nonfinite_grads", "skip", "inf")]
    (checkpoint,) = checkpoints(tmp_path / "run")
    assert finite(torch.load(tmp_path / "run" / checkpoint / STATE_FILE, weights_only=True))


def test_nonfinite_gradients_fail_the_run_or_only_warn_as_configured(write_job, tmp_path):
    failing = job(write_job, precision={"on_nonfinite_grads": "fail"}, callbacks=[drill("Overflow", at_steps=[2])])
    with pytest.raises(NonFiniteGradients, match=r"at step 2 on rank\(s\) \[0\] \(first: classifier.3.bias, inf\)"):
        train(failing, tmp_path / "failing")

    # `warn`: the step is taken, the report says so; the weights are no longer finite, so no checkpoint is made.
    warning = job(write_job, precision={"on_nonfinite_grads": "warn"}, checkpoint={"every_n_steps": 2},
                  callbacks=[drill("Overflow", at_steps=[2])])
    session = LocalSession(0, 1, CPU, tmp_path / "warning")
    with pytest.raises(NonFiniteState, match="not finite at step 2 .*rank 0: classifier.3.bias"):
        TrainingLoop(warning, session).run()
    (report,) = session.reports  # the report goes out, the checkpoint does not
    assert report.step == 2 and any("precision.on_nonfinite_grads: warn" in w for w in report.warnings)
    assert report.metrics["amp/nonfinite_grad_steps"] == 1.0
    assert "amp/skipped_steps" not in report.metrics  # nothing was skipped: a counter is logged once it moves
    assert checkpoints(tmp_path / "warning") == []


@pytest.mark.slow  # trains in processes of its own
def test_one_rank_s_nonfinite_gradients_skip_the_step_on_both_and_its_nonfinite_weights_stop_the_checkpoint(
        write_job, tmp_path):
    """Two gloo ranks. Step 2: an inf in rank 1's gradient only (after DDP's all-reduce, so rank 0's are finite):
    one all-reduced flag skips the step on both ranks, and the checkpoint of step 2 (every rank's state checked
    finite first) counts it. After step 4 rank 1's weights turn NaN and a checkpoint is due: neither rank stages
    anything, both fail naming rank 1 and the tensor, and the checkpoint of step 2 stays the newest."""
    cfg = job(write_job, scaling={"num_workers": 2}, run={"max_steps_per_epoch": 6}, checkpoint={"every_n_steps": 2},
              callbacks=[drill("Overflow", at_steps=[2], rank=1), drill("NanWeight", at_step=4, rank=1)])
    with pytest.raises(Exception, match=r"NonFiniteState: the train state is not finite at step 4 \(rank 1: "
                                        r"features.0.weight: 1 of 432 values not finite \(nan\)\)"):
        spawn(OmegaConf.to_container(cfg, resolve=True), world_size=2, directory=tmp_path)
    stored = checkpoints(tmp_path / "checkpoints")
    assert len(stored) == 1 and stored[0].startswith("checkpoint_000000002_")
    state = torch.load(tmp_path / "checkpoints" / stored[0] / STATE_FILE, weights_only=True)
    assert state["counters"]["nonfinite_grad_steps"] == 1 and state["counters"]["skipped_steps"] == 1
    assert finite(state)
    facts = json.loads((tmp_path / "checkpoints" / stored[0] / FACTS_FILE).read_text())
    assert facts["finite"] and facts["global_step"] == 2 and facts["layout"]["world_size"] == 2


# -- skipped steps ----------------------------------------------------------------------------------------


def test_skipped_nan_losses_count_toward_max_consecutive_skips(write_job, tmp_path):
    cfg = job(write_job, precision={"scaler": {"on_nan_loss": "skip", "max_consecutive_skips": 2}},
              run={"max_steps_per_epoch": 8}, callbacks=[drill("NanLoss", from_step=2)])
    with pytest.raises(LossScaleCollapsed, match="at step 4: 3 consecutive skipped steps, the last with the loss "
                                                 r"not finite \(max_consecutive_skips=2\)"):
        train(cfg, tmp_path / "run")


def test_an_epoch_that_skipped_every_step_fails_and_reports_no_loss_it_did_not_compute(write_job, tmp_path):
    cfg = job(write_job, precision={"scaler": {"on_nan_loss": "skip", "max_consecutive_skips": None}},
              callbacks=[drill("NanLoss", from_step=1)])
    session = LocalSession(0, 1, CPU, tmp_path / "run")
    with pytest.raises(NothingTrained, match="every one of the 4 optimizer steps of epoch 1 was skipped"):
        TrainingLoop(cfg, session).run()
    assert session.reports and not any("train/loss" in r.metrics for r in session.reports)
    assert session.reports[-1].metrics["amp/skip_rate"] == 1.0 and session.reports[-1].metrics["amp/nan_loss_steps"] == 4
    assert checkpoints(tmp_path / "run") == []


# -- the logged model and exports -------------------------------------------------------------------------


class Directory:
    """A checkpoint as the driver gets one (anything with `as_directory()`)."""

    def __init__(self, path: Path):
        self.path = path

    @contextmanager
    def as_directory(self):
        yield str(self.path)


def test_a_model_that_is_not_finite_is_never_logged_and_no_export_is_either(write_job, tmp_path, mlflow_uri, capsys):
    from mlflow import MlflowClient

    from orchestrator.runner.export import ExportRefused, export
    from orchestrator.runner.outputs import log_trained_model
    from orchestrator.tracking.tracker import RunTracker
    from orchestrator.train import rng
    from orchestrator.checkpoint.files import write_checkpoint_files
    from orchestrator.train.models import build_model
    from orchestrator.checkpoint.state import TrainState

    cfg = job(write_job, tracking={"uri": mlflow_uri, "experiment": "finite"})
    tracker = RunTracker.start(mlflow_uri, cfg, run_name="finite", tags={}, params={}, config_yaml="")
    weights = build_model(cfg.model).state_dict()
    weights["classifier.3.weight"][0, 0] = float("nan")  # what a version without the checkpoint check could keep
    state = TrainState(model=weights, optimizer={}, scheduler={}, scaler=None, counters={}, sample_shape=[3, 32, 32])
    (tmp_path / "checkpoint").mkdir()
    write_checkpoint_files(tmp_path / "checkpoint", 0, state.to_files()[0], {"rng": rng.capture(), "window": {}})
    assert log_trained_model(cfg, Directory(tmp_path / "checkpoint"), tracker) is None
    assert "classifier.3.weight: 1 of 1280 values not finite (nan)" in capsys.readouterr().err

    big = build_model(cfg.model)  # finite in fp32, beyond float16's range
    with torch.no_grad():
        big.classifier[3].bias[0] = 1e5
    with pytest.raises(ExportRefused, match="exported weights are not finite .*classifier.3.bias"):
        export(big, cfg, "float16", tracker, max_drop=1.0)
    client = MlflowClient(tracking_uri=mlflow_uri)
    assert client.search_logged_models([tracker.experiment_id]) == []
    assert client.get_run(tracker.run_id).data.tags["export_status"] == "refused"
    tracker.finish("FINISHED")
