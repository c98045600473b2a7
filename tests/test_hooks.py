"""Hooks around the training loop and the job's own callbacks (the same kind of object), on the Ray-free loop:
each hook method runs at its point, what a callback adds to a report is in the report, its state travels in
checkpoints, and a callback that raises fails the run naming it and the line. Bad callbacks are refused when
the job is loaded."""

import shutil
import traceback

import pytest
import torch

from conftest import REPO, small_job
from orchestrator.config import load_job
from orchestrator.errors import BadInput
from orchestrator.train.callbacks import CallbackFailed
from orchestrator.train.local import LocalSession
from orchestrator.train.loop import TrainingLoop

CPU = torch.device("cpu")


class Recorder:
    """Records every hook call; counts steps in its checkpoint state; reports a metric, a tag and a table."""

    def __init__(self, label: str = "x"):
        self.label, self.calls, self.steps = label, [], 0

    def setup(self, loop):
        self.calls.append("setup")

    def before_step(self, loop, step):
        self.calls.append(f"before_step {step.number}")

    def after_backward(self, loop, step):
        assert step.loss is not None and step.outcome is None  # between backward and the optimizer step
        assert any(p.grad is not None for p in loop.training.prepared.raw.parameters())
        self.calls.append(f"after_backward {step.number}")

    def after_step(self, loop, step):
        assert step.outcome is not None
        self.steps += 1
        self.calls.append(f"after_step {step.number}")

    def end_epoch(self, loop, report):
        assert "eval/loss" in report.metrics  # after evaluation
        self.calls.append(f"end_epoch {report.epoch}")

    def collect(self, loop, report):
        report.metrics["callback/steps"] = float(self.steps)
        report.tags["callback"] = self.label
        report.tables["callback/table"] = [{"steps": self.steps}]
        self.calls.append(f"collect {report.seq}")

    def on_checkpoint(self, loop, directory, name):
        assert (directory / "train_state.pt").exists() and name.startswith("checkpoint_")
        (directory / "callback.txt").write_text(str(self.steps))

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]

    def teardown(self, loop):
        self.calls.append("teardown")


class NothingLogged(LocalSession):
    """A driver that has logged nothing yet: the replay outbox keeps every report."""

    def logged_through(self):
        return 0


class Raises:
    torn_down = False

    def after_step(self, loop, step):
        if step.number == 2:
            raise ZeroDivisionError("the callback's own bug")

    def teardown(self, loop):
        Raises.torn_down = True
        raise RuntimeError("a teardown that assumed training ended well")


def job(write_job, **sections):
    return load_job(write_job(small_job(scaling={"num_workers": 1}, **sections)))


def test_a_callback_runs_at_each_point_and_what_it_collects_is_in_the_reports(write_job, tmp_path):
    cfg = job(write_job, run={"epochs": 1, "max_steps_per_epoch": 3}, tracking={"log_every_n_steps": 2})
    recorder = Recorder("given")
    session = LocalSession(0, 1, CPU, tmp_path / "checkpoints")
    TrainingLoop(cfg, session, hooks=[recorder]).run()
    assert recorder.calls == ["setup", "before_step 1", "after_backward 1", "after_step 1",
                              "before_step 2", "after_backward 2", "after_step 2", "collect 1",
                              "before_step 3", "after_backward 3", "after_step 3", "end_epoch 1", "collect 2",
                              "teardown"]
    assert [r.metrics["callback/steps"] for r in session.reports] == [2.0, 3.0]
    assert session.reports[-1].tags["callback"] == "given" and session.reports[-1].tables["callback/table"] == [
        {"steps": 3}]
    (checkpoint,) = (tmp_path / "checkpoints").iterdir()
    assert (checkpoint / "callback.txt").read_text() == "3"  # its own file in the checkpoint


def test_callbacks_from_the_job_run_after_the_built_in_hooks_and_their_state_resumes(write_job, tmp_path):
    cfg = job(write_job, run={"epochs": 2, "max_steps_per_epoch": 2},
              callbacks=[{"name": "test_hooks:Recorder", "kwargs": {"label": "from the job"}}])
    session = NothingLogged(0, 1, CPU, tmp_path / "checkpoints")
    first = TrainingLoop(cfg, session)
    callback = first.hooks.hooks[-2]  # the replay outbox is last: it keeps every report whole
    assert callback.name == "callbacks[0] test_hooks:Recorder"
    first.run()
    assert session.reports[-1].tags["callback"] == "from the job" and callback.target.steps == 4
    kept = first.outbox.unlogged[-1]  # the outbox saw the callback's additions
    assert kept["metrics"]["callback/steps"] == 4.0

    # A new loop over the same storage resumes from the last checkpoint, and the callback's state with it.
    resumed = TrainingLoop(cfg, LocalSession(0, 1, CPU, tmp_path / "checkpoints"))
    assert resumed.hooks.hooks[-2].target.steps == 4


def test_a_callback_that_raises_fails_the_run_naming_it_its_method_and_line(write_job, tmp_path):
    cfg = job(write_job, run={"max_steps_per_epoch": 3}, callbacks=["test_hooks:Raises"])
    with pytest.raises(CallbackFailed) as failed:
        TrainingLoop(cfg, LocalSession(0, 1, CPU, tmp_path / "checkpoints")).run()
    message = str(failed.value)
    assert message.startswith("callback callbacks[0] test_hooks:Raises raised in after_step: ZeroDivisionError: "
                              "the callback's own bug (at ")
    assert f"{__file__}:" in message
    # Its teardown ran, and raised too: the error the run reports is still the one that ended training, and the
    # traceback's last frame (what Ray Train's error shows) is the callback's own line.
    assert Raises.torn_down
    last = traceback.extract_tb(failed.value.__traceback__)[-1]
    assert (last.filename, last.name) == (__file__, "after_step") and message.endswith(f":{last.lineno})")


class Adds:
    def __init__(self, metrics=None, tags=None, tables=None, tensor_table=None):
        """`tensor_table`: the name of a table holding a tensor of 3 elements."""
        tables = {**(tables or {}), **({tensor_table: [torch.zeros(3)]} if tensor_table else {})}
        self.additions = {"metrics": metrics or {}, "tags": tags or {}, "tables": tables}

    def collect(self, loop, report):
        for kind, added in self.additions.items():
            getattr(report, kind).update(added)


@pytest.mark.parametrize("additions, message", [
    ({"metrics": {"mine/ratio": "high"}}, "report.metrics['mine/ratio'] = 'high' (str): a metric is a number"),
    ({"metrics": {"mine/norm (fc)": 1.0}}, "report.metrics['mine/norm (fc)']: MLflow takes names of"),
    ({"tables": {"../outside": [1]}}, "report.tables['../outside']: MLflow takes names of"),
    ({"tensor_table": "mine/weights"}, "report.tables['mine/weights']: not JSON"),
])
def test_what_a_callback_adds_that_mlflow_would_not_take_fails_the_run_naming_it_and_the_key(
        write_job, tmp_path, additions, message):
    """Found on the rank, naming the callback; reaching the driver it would stall the MLflow writer."""
    cfg = job(write_job, run={"max_steps_per_epoch": 2},
              callbacks=[{"name": "test_hooks:Adds", "kwargs": {"metrics": {"mine/ok": 1}, **additions}}])
    with pytest.raises(CallbackFailed) as failed:
        TrainingLoop(cfg, LocalSession(0, 1, CPU, tmp_path / "checkpoints")).run()
    assert str(failed.value).startswith("callback callbacks[0] test_hooks:Adds added to the report in collect what "
                                        "MLflow would not take: ")
    assert message in str(failed.value)


class FailsToBuild:
    def __init__(self, threshold):
        self.threshold = 1 / threshold

    def after_step(self, loop, step): ...


def test_a_callback_that_raises_when_built_fails_the_run_naming_it(write_job, tmp_path):
    cfg = job(write_job, callbacks=[{"name": "test_hooks:FailsToBuild", "kwargs": {"threshold": 0}}])
    with pytest.raises(CallbackFailed, match=r"callback callbacks\[0\] test_hooks:FailsToBuild raised when built: "
                                              r"ZeroDivisionError: division by zero \(at .*test_hooks.py:\d+\)"):
        TrainingLoop(cfg, LocalSession(0, 1, CPU, tmp_path / "checkpoints"))


def test_the_weight_average_example_evaluates_beside_the_model_and_resumes_exactly(write_job, tmp_path, monkeypatch):
    """examples/callbacks (its job and ema.py): `ema/eval/*` beside `eval/*` at each epoch's end, the average in
    every checkpoint; a run resumed from the first epoch's checkpoint ends with the same average as one that never
    stopped."""
    monkeypatch.syspath_prepend(str(REPO / "examples" / "callbacks"))
    cfg = load_job(REPO / "examples" / "callbacks" / "job.yaml",  # the example's own job, on one rank
                   ["scaling.num_workers=1", "run.epochs=2", "run.max_steps_per_epoch=3"])
    straight = LocalSession(0, 1, CPU, tmp_path / "straight")
    TrainingLoop(cfg, straight).run()
    ends = [r for r in straight.reports if "eval/loss" in r.metrics]
    assert [r.step for r in ends] == [3, 6]
    assert {"ema/eval/loss", "ema/eval/accuracy"} <= set(ends[-1].metrics)
    assert ends[-1].metrics["ema/eval/loss"] != ends[-1].metrics["eval/loss"]  # another model was scored

    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(max((tmp_path / "resumed").glob("checkpoint_*")))  # back to the end of epoch 1
    resumed = LocalSession(0, 1, CPU, tmp_path / "resumed")
    TrainingLoop(cfg, resumed).run()
    assert resumed.reports[-1].step == 6
    assert resumed.reports[-1].metrics["ema/eval/loss"] == ends[-1].metrics["ema/eval/loss"]


def test_a_rank_zero_only_hook_is_left_out_on_other_ranks():
    from orchestrator.train.hooks import Hooks

    class RankZero:
        rank_zero_only = True

    every, zero = Recorder(), RankZero()
    assert Hooks([every, zero], rank=0).hooks == [every, zero]
    assert Hooks([every, zero], rank=1).hooks == [every]


@pytest.mark.parametrize("callbacks, message", [
    (["test_hooks:NoHooks"], "callbacks[0].name: test_hooks:NoHooks has none of the training loop's hook methods"),
    ([{"name": "test_hooks:Recorder", "kwargs": {"colour": "red"}}], "callbacks[0].kwargs: test_hooks:Recorder does "
                                                                     "not take {'colour': 'red'}"),
    (["test_hooks:Absent"], "callbacks[0].name: module 'test_hooks' has no 'Absent'"),
    (["os:system"], "callbacks[0].name: 'os:system' is refused"),
    ("test_hooks:Recorder", "'callbacks' must be a list"),
])
def test_a_bad_callback_is_refused_when_the_job_is_loaded(write_job, callbacks, message):
    with pytest.raises(BadInput, match=None) as refused:
        job(write_job, callbacks=callbacks) if isinstance(callbacks, list) else \
            load_job(write_job({**small_job(), "callbacks": callbacks}))
    assert message in str(refused.value)


class NoHooks:
    def __init__(self):
        pass
