"""Two submits of one job at the same moment get two runs: their own name, their own Ray run directory, and
the same MLflow experiment, whichever of them created it."""

import multiprocessing
import re

import pytest
from mlflow import MlflowClient

from orchestrator.config import load_job
from orchestrator.errors import BadInput
from orchestrator.runner import records
from orchestrator.runner.preflight import choose_run, default_run_name

from conftest import small_job


def test_default_names_differ_within_one_second_and_are_safe(tmp_path):
    job = tmp_path / "quickstart.yaml"
    names = {default_run_name(job) for _ in range(20)}
    assert len(names) == 20
    assert all(re.fullmatch(r"quickstart-\d{8}-\d{6}-[0-9a-f]{6}", name) for name in names), names


def _claim(storage: str, name: str, barrier, results) -> None:
    barrier.wait()
    try:
        records.claim(storage, name)
        results.put("won")
    except BadInput as exc:
        results.put(str(exc))


def test_two_processes_racing_for_one_run_name_one_wins_the_other_is_told(tmp_path):
    """The run directory is claimed atomically: of two submits that chose one name, exactly one gets it."""
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(2), context.Queue()
    racers = [context.Process(target=_claim, args=(str(tmp_path / "ray_results"), "same-name", barrier, results))
              for _ in range(2)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(timeout=30)
    outcomes = sorted(results.get(timeout=5) for _ in racers)
    assert outcomes[1] == "won", outcomes
    assert "run.name: a run named 'same-name' already exists" in outcomes[0], outcomes
    assert (tmp_path / "ray_results" / "same-name").is_dir()


def test_a_claimed_name_is_taken_for_the_next_submit_and_released_when_nothing_started(write_job, tmp_path):
    storage = tmp_path / "ray_results"
    job = write_job(small_job(run={"name": "mine"}, checkpoint={"storage_path": str(storage)}))
    cfg = load_job(job)
    assert choose_run(cfg, job, resume=False).name == "mine"
    records.claim(str(storage), "mine")
    with pytest.raises(BadInput, match="already exists"):
        choose_run(cfg, job, resume=False)
    records.release(str(storage), "mine")  # e.g. MLflow refused the run: the name is free again
    assert choose_run(cfg, job, resume=False).name == "mine"


def test_plan_run_gives_the_name_back_when_mlflow_refuses(write_job, tmp_path):
    from orchestrator.runner.driver import plan_run
    from orchestrator.runner.preflight import RunChoice

    storage = tmp_path / "ray_results"
    job = write_job(small_job(tracking={"uri": "http://127.0.0.1:9"}, checkpoint={"storage_path": str(storage)}))
    with pytest.raises(BadInput, match="cannot be reached"):
        plan_run(load_job(job), job, None, RunChoice("refused"))
    assert not storage.exists()  # nothing left behind, not even the storage directory the claim made


def test_an_experiment_another_submit_just_created_is_used_not_an_error(new_store, write_job, tmp_path, monkeypatch):
    """Both submits looked the experiment up before either created it: the second create fails in MLflow
    (unique name); the run goes into the experiment the first one made."""
    from orchestrator.tracking.tracker import RunTracker

    uri = new_store(tmp_path)
    made_by_the_other = MlflowClient(tracking_uri=uri).create_experiment("raced")
    looked_up = []
    real_lookup = MlflowClient.get_experiment_by_name

    def stale_first_lookup(self, name):
        looked_up.append(name)
        return None if len(looked_up) == 1 else real_lookup(self, name)  # the first look predates the other's create

    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", stale_first_lookup)
    cfg = load_job(write_job(small_job(tracking={"uri": uri, "experiment": "raced"})))
    tracker = RunTracker.start(uri, cfg, run_name="second", tags={}, params={}, config_yaml="")
    assert tracker.experiment_id == made_by_the_other
    assert len(looked_up) == 2
