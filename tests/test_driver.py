"""The driver closes the MLflow run it created whatever fails after it: Ray unreachable, and a failure injected
at each stage (with Ray faked) ends FAILED; an interrupt ends KILLED. The run is created while Ray starts, and
what is refused then still leaves nothing behind."""

import signal
import threading
import time
from types import SimpleNamespace

import pytest
from mlflow import MlflowClient

from orchestrator.errors import BadInput, Interrupted
from orchestrator.runner import driver, ray_start, records
from orchestrator.runner.preflight import RunChoice
from orchestrator.config import load_job
from orchestrator.common.report import Report

from conftest import small_job


def test_ray_unreachable_closes_the_run_failed_and_says_what_to_do(new_store, write_job, tmp_path, monkeypatch, capsys):
    uri = new_store(tmp_path)
    job = write_job(small_job(tracking={"uri": uri, "experiment": "unreachable"},
                              checkpoint={"storage_path": str(tmp_path / "ray_results")}))
    plan = driver.plan_run(load_job(job), job, "10.255.255.1:6379", RunChoice("unreachable"))

    def no_cluster(address, module_sources):
        raise ConnectionError(f"could not connect to {address}")

    monkeypatch.setattr(ray_start, "init_ray", no_cluster)
    assert driver.execute(plan) == driver.EXIT_FAILED
    run = MlflowClient(tracking_uri=uri).get_run(plan.tracker.run_id)
    assert run.info.status == "FAILED"
    err = capsys.readouterr().err
    assert "10.255.255.1:6379" in err and "--address" in err


# -- every driver-side failure after the run exists closes it FAILED ------------------------------------------

class _FakeRelay:
    """The report relay without Ray: nothing reported (the stages under test fail around training)."""

    class _Call:
        def __init__(self, value):
            self.value = value

        def remote(self, *args):
            return self.value

    def __init__(self):
        self.take, self.push = self._Call(([], [])), self._Call(None)


class _FakeResult:
    checkpoint, metrics, path = None, {}, "fake-storage"


class _FakeTrainer:
    def __init__(self, fail: bool):
        self.fail = fail

    def fit(self):
        if self.fail:
            raise RuntimeError("injected: fit")
        return _FakeResult()


def _raise(what):
    def fail(*args, **kwargs):
        raise RuntimeError(f"injected: {what}")

    return fail


STAGES = ["write_record", "relay", "writer_start", "build_trainer", "fit", "writer_close", "log_plots"]


@pytest.fixture
def fake_ray(new_store, write_job, tmp_path, monkeypatch):
    """A job (`.job`, MLflow in `.uri`) whose Ray is faked: no cluster, a relay that reports nothing, and the trainer
    `use_trainer(trainer)` says (by default one whose fit() returns a run without checkpoints)."""
    import orchestrator.runner.launch as launch
    import orchestrator.tracking.relay as relay
    import orchestrator.tracking.writer as writer

    uri = new_store(tmp_path)
    job = write_job(small_job(tracking={"uri": uri, "experiment": "stages"},
                              checkpoint={"storage_path": str(tmp_path / "ray_results")}))
    monkeypatch.setattr(ray_start, "init_ray", lambda address, module_sources: (False, None))
    monkeypatch.setattr(writer, "ray", type("FakeRay", (), {"get": staticmethod(lambda value, timeout=None: value),
                                                           "is_initialized": staticmethod(lambda: True)}))
    monkeypatch.setattr(relay, "start_relay", _FakeRelay)

    def use_trainer(trainer) -> None:
        monkeypatch.setattr(launch, "build_trainer", lambda *a, **k: trainer)

    use_trainer(_FakeTrainer(False))
    status = lambda run_id: MlflowClient(tracking_uri=uri).get_run(run_id).info.status  # noqa: E731
    return SimpleNamespace(job=job, uri=uri, use_trainer=use_trainer, status=status)


@pytest.fixture
def planned(fake_ray):
    """A planned run (`.plan`, its MLflow run created by `plan_run`) of the `fake_ray` job."""
    plan = driver.plan_run(load_job(fake_ray.job), fake_ray.job, None, RunChoice("stages"))
    return SimpleNamespace(plan=plan, use_trainer=fake_ray.use_trainer,
                           status=lambda: fake_ray.status(plan.tracker.run_id))


@pytest.mark.parametrize("stage", STAGES)
def test_a_failure_at_any_driver_stage_closes_the_run_failed(stage, planned, monkeypatch):
    """Stage by stage after plan_run created the MLflow run: the error propagates (the CLI turns it into exit 1)
    and the run, with its record in storage once written, ends FAILED, never RUNNING."""
    import orchestrator.runner.launch as launch
    import orchestrator.tracking.relay as relay
    import orchestrator.tracking.writer as writer
    from orchestrator.runner import records
    from orchestrator.tracking.tracker import RunTracker

    if stage == "relay":
        monkeypatch.setattr(relay, "start_relay", _raise("relay"))
    if stage == "build_trainer":
        monkeypatch.setattr(launch, "build_trainer", _raise("build_trainer"))
    if stage == "fit":
        planned.use_trainer(_FakeTrainer(True))
    if stage == "write_record":
        monkeypatch.setattr(records, "write_record", _raise("write_record"))
    if stage == "writer_start":
        monkeypatch.setattr(writer.MlflowWriter, "start", _raise("writer_start"))
    if stage == "writer_close":  # it stops its thread, then fails
        real_close = writer.MlflowWriter.close

        def failing_close(self, timeout_s):
            real_close(self, timeout_s)
            raise RuntimeError("injected: writer_close")

        monkeypatch.setattr(writer.MlflowWriter, "close", failing_close)
    if stage == "log_plots":
        monkeypatch.setattr(RunTracker, "log_plots", _raise("log_plots"))

    with pytest.raises(RuntimeError, match=f"injected: {stage}"):
        driver.execute(planned.plan)
    assert planned.status() == "FAILED"
    if stage != "write_record":
        assert records.read_record(planned.plan.cfg.checkpoint.storage_path, "stages")["status"] == "FAILED"


def test_a_record_that_cannot_be_written_at_the_end_still_closes_the_run(planned, monkeypatch):
    """Storage lost while the run closes (its record exists, the final write fails): the error is raised, and the
    MLflow run is marked FAILED rather than left RUNNING or claimed FINISHED."""
    from orchestrator.runner import records

    real_write = records.write_record

    def fails_when_closing(storage_path, run_name, **fields):
        if fields.get("status") not in (None, "RUNNING"):
            raise OSError(28, "No space left on device (injected)")
        real_write(storage_path, run_name, **fields)

    monkeypatch.setattr(records, "write_record", fails_when_closing)
    with pytest.raises(OSError, match="injected"):
        driver.execute(planned.plan)
    assert planned.status() == "FAILED"


def test_a_failure_logging_the_datasets_closes_the_new_run_and_frees_its_name(new_store, write_job, tmp_path,
                                                                            monkeypatch):
    """The MLflow run exists before its dataset inputs are logged: a failure there ends it FAILED, and the run's
    directory in storage is released for the next submit."""
    from orchestrator.tracking.tracker import RunTracker

    uri = new_store(tmp_path)
    storage = tmp_path / "ray_results"
    job = write_job(small_job(tracking={"uri": uri, "experiment": "lineage"},
                              checkpoint={"storage_path": str(storage)}))
    monkeypatch.setattr(RunTracker, "log_datasets", _raise("log_datasets"))
    with pytest.raises(RuntimeError, match="injected: log_datasets"):
        driver.plan_run(load_job(job), job, None, RunChoice("lineage", datasets=["train", "eval"]))
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("lineage").experiment_id])
    assert [run.info.status for run in runs] == ["FAILED"]
    assert not (storage / "lineage").exists()


def test_a_run_that_ends_well_with_fakes_is_finished(planned):
    """The stage test's fakes do not fail by themselves: with nothing injected the run ends FINISHED."""
    assert driver.execute(planned.plan) == 0
    assert planned.status() == "FINISHED"


def test_the_console_s_final_line_is_the_last_step_even_when_it_reached_the_relay_as_fit_returned(
        planned, monkeypatch, capsys):
    """The last report sits in the relay when fit() returns (the writer polls it once a second): the progress
    line's final print comes after the writer took it."""
    import orchestrator.tracking.relay as relay

    queue: list = []

    class QueueRelay(_FakeRelay):
        def __init__(self):
            super().__init__()
            self.take = type("Take", (), {"remote": staticmethod(lambda: ([queue.pop(0) for _ in list(queue)], []))})()

    class ReportsAtTheEnd(_FakeTrainer):
        def fit(self):
            queue.append(Report(seq=1, step=4, epoch=1, epochs=1, total_steps=4, metrics={"train/loss": 0.5}))
            return _FakeResult()

    monkeypatch.setattr(relay, "start_relay", QueueRelay)
    planned.use_trainer(ReportsAtTheEnd(False))
    assert driver.execute(planned.plan) == 0
    assert "epoch 1/1 | step 4/4 | loss 0.5000" in capsys.readouterr().err


def test_an_interrupt_during_training_closes_the_run_killed_and_says_how_to_resume(planned):
    import signal

    from orchestrator.errors import Interrupted

    class Stopped(_FakeTrainer):
        def fit(self):
            raise SystemExit(0)  # a handler's sys.exit() inside fit(): an interrupt too

    planned.use_trainer(Stopped(False))
    with pytest.raises(Interrupted) as caught:
        driver.execute(planned.plan)
    assert caught.value.signum == signal.SIGINT and caught.value.exit_code == 130
    assert f"python -m orchestrator.submit {planned.plan.job_path} --resume" in caught.value.describe()
    assert planned.status() == "KILLED"


def test_submit_turns_a_driver_failure_into_exit_1_and_one_line_naming_it_and_where(write_job, tmp_path,
                                                                                    monkeypatch, capsys):
    from orchestrator.cli.submit import main

    def fails(plan):
        raise RuntimeError("injected: driver")

    monkeypatch.setattr(driver, "execute", fails)
    monkeypatch.setattr(ray_start, "init_ray", lambda address, module_sources: (False, None))  # execute() would stop it
    monkeypatch.chdir(tmp_path)
    job = write_job(small_job(checkpoint={"storage_path": str(tmp_path / "ray_results")}))
    assert main([str(job)]) == driver.EXIT_FAILED
    err = capsys.readouterr().err
    assert "error: the driver failed: RuntimeError: injected: driver" in err
    assert f"at {__file__}:" in err and "in fails" in err
    assert "Traceback" not in err


# -- submit creates the MLflow run while Ray starts -----------------------------------------------------------

def test_the_mlflow_run_is_created_while_ray_starts(fake_ray, monkeypatch):
    """`plan_run_as_ray_starts` (submit's and `run()`'s way): Ray starts on the main thread while the run is created
    on another. Each waits here for the other to have begun, so done one after the other this fails. The run then
    trains and ends FINISHED, its record dating the launch (where perf/time_to_first_step_s counts from)."""
    ray_starting, run_created, seen = threading.Event(), threading.Event(), {}
    real_start_run = driver._start_run

    def start_run(*args, **kwargs):
        seen["ray_was_starting"] = ray_starting.wait(60)  # bounds on a busy machine; each returns once set
        tracker = real_start_run(*args, **kwargs)
        run_created.set()
        return tracker

    def init_ray(address, module_sources):
        seen["on_the_main_thread"] = threading.current_thread() is threading.main_thread()
        ray_starting.set()
        seen["run_created_meanwhile"] = run_created.wait(60)
        return False, None

    monkeypatch.setattr(driver, "_start_run", start_run)
    monkeypatch.setattr(ray_start, "init_ray", init_ray)
    before = time.time()
    plan = driver.plan_run_as_ray_starts(load_job(fake_ray.job), fake_ray.job, None, RunChoice("overlap"))
    assert seen == {"ray_was_starting": True, "on_the_main_thread": True, "run_created_meanwhile": True}
    assert driver.execute(plan) == 0
    assert fake_ray.status(plan.tracker.run_id) == "FINISHED"
    record = records.read_record(plan.cfg.checkpoint.storage_path, "overlap")
    assert before <= record["launched_at"] <= record["started"]


def test_a_tracking_server_that_refuses_connections_is_reported_before_ray_starts(write_job, tmp_path, monkeypatch):
    """MLflow down with `tracking.required` is exit 2 with nothing started: no Ray, no run, the name free."""
    started = []
    monkeypatch.setattr(ray_start, "init_ray", lambda address, module_sources: started.append(address) or (True, None))
    storage = tmp_path / "refused_storage"
    job = write_job(small_job(tracking={"uri": "http://127.0.0.1:9"}, checkpoint={"storage_path": str(storage)}))
    with pytest.raises(BadInput, match="cannot be reached"):
        driver.plan_run_as_ray_starts(load_job(job), job, None, RunChoice("refused"))
    assert started == [] and not storage.exists()


def test_a_run_refused_once_ray_started_shuts_that_ray_down(fake_ray, monkeypatch):
    """A refusal that comes while Ray starts beside it (here the store refuses the new run) is still exit 2 with
    nothing left: the Ray started meanwhile is shut down, the run's name is free, the SIGTERM handler the caller's."""
    import ray

    from orchestrator.tracking.tracker import RunTracker, TrackingUnavailable

    def refuse(*args, **kwargs):
        raise TrackingUnavailable("tracking: MLflow refused the run (injected)")

    shut_down = []
    monkeypatch.setattr(RunTracker, "start", refuse)
    monkeypatch.setattr(ray_start, "init_ray", lambda address, module_sources: (True, None))
    monkeypatch.setattr(ray, "shutdown", lambda: shut_down.append(True))
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(BadInput, match="injected"):
        driver.plan_run_as_ray_starts(load_job(fake_ray.job), fake_ray.job, None, RunChoice("refused"))
    assert shut_down == [True]
    assert not (fake_ray.job.parent / "ray_results" / "refused").exists()
    assert signal.getsignal(signal.SIGTERM) is handler


@pytest.mark.parametrize("interrupt, signum", [(KeyboardInterrupt(), signal.SIGINT),
                                               (SystemExit(signal.SIGTERM), signal.SIGTERM)],
                         ids=["ctrl-c", "sigterm-in-rays-handler"])
def test_an_interrupt_while_ray_starts_closes_the_run_being_created_killed(fake_ray, monkeypatch, interrupt, signum):
    """Ctrl-C, or SIGTERM meeting the handler ray.init installs (it exits with the signal's number), lands as Ray
    starts, before the run on the other thread exists: the run is waited for, closed KILLED, and the interrupt
    says its signal and how to resume."""
    def init_ray(address, module_sources):
        raise interrupt

    monkeypatch.setattr(ray_start, "init_ray", init_ray)
    plan = driver.plan_run_as_ray_starts(load_job(fake_ray.job), fake_ray.job, None, RunChoice("interrupted"))
    with pytest.raises(Interrupted) as raised:
        driver.execute(plan)
    assert raised.value.signum == signum
    assert "--resume" in raised.value.resume_hint
    assert fake_ray.status(plan.tracker.run_id) == "KILLED"
