"""MLflow going away never costs training, never loses a metric, never leaks a secret (a real `mlflow server`)."""

import secrets
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from mlflow import MlflowClient

from conftest import small_job
from mlflow_server import MlflowServer

pytestmark = pytest.mark.slow

STEPS = 24
LONG_JOB = dict(precision={"preset": "O0"}, run={"epochs": 4, "max_steps_per_epoch": 6},
                checkpoint={"every_n_steps": 2})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server")).start()
    yield server
    server.stop()


def submit_in_background(tmp_path, monkeypatch, write_job, *overrides):
    from orchestrator.cli.submit import main

    monkeypatch.chdir(tmp_path)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("rc", main([str(write_job(small_job(**LONG_JOB))),
                                                                             *overrides])))
    thread.start()
    return thread, result


def newest_checkpoint_step(tmp_path: Path) -> int:
    steps = [int(p.name.split("_")[1]) for p in tmp_path.glob("ray_results/*/checkpoint_0*")]
    return max(steps, default=0)


def wait_for_checkpoint(tmp_path: Path, step: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while newest_checkpoint_step(tmp_path) < step:
        assert time.monotonic() < deadline, f"no checkpoint of step >= {step}"
        time.sleep(0.2)


def the_run(uri: str, experiment: str):
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run


def assert_every_step_once(client, run_id, key="amp/loss_scale"):
    steps = Counter(m.step for m in client.get_metric_history(run_id, key))
    assert sorted(steps) == list(range(1, STEPS + 1)) and set(steps.values()) == {1}, steps


def test_server_stopped_mid_run_and_restarted_training_goes_on_metrics_are_complete_and_no_secret_reaches_the_run(
        ray_session, tmp_path, monkeypatch, write_job, server, capsys):
    """The tracking server stopped mid-run and restarted: training goes on, every metric reaches the run, and no
    credential from the environment reaches it.

    Long: a real MLflow server (a process of its own) is stopped, kept down across steps and started again while
    the run trains."""
    # A token and a password from the environment, as a user passes credentials: in the job through `oc.env`.
    token, password = f"tok-{secrets.token_hex(12)}", f"pw-{secrets.token_hex(12)}"
    monkeypatch.setenv("AMPFLOW_TEST_API_TOKEN", token)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    uri = server.url.replace("://", "://ampflow:${oc.env:MLFLOW_TRACKING_PASSWORD}@")
    thread, result = submit_in_background(tmp_path, monkeypatch, write_job, f"tracking.uri={uri}",
                                          "tracking.experiment=outage", "tracking.log_every_n_steps=1",
                                          "data.root=cache/${oc.env:AMPFLOW_TEST_API_TOKEN}")
    try:
        wait_for_checkpoint(tmp_path, 4)
        server.stop()
        stopped_at = newest_checkpoint_step(tmp_path)
        wait_for_checkpoint(tmp_path, stopped_at + 6)  # training goes on while MLflow is down
    finally:
        if server.process is None:
            server.start()
        thread.join(timeout=600)
    assert result["rc"] == 0
    captured = capsys.readouterr()
    err = captured.err
    assert "MLflow is not answering" in err and "MLflow is back" in err
    client, run = the_run(server.url, "outage")
    assert run.info.status == "FINISHED"
    assert_every_step_once(client, run.info.run_id)
    assert_every_step_once(client, run.info.run_id, "train/loss")

    # The secrets: redacted in the run's params, never in its tags, metrics, artifacts or on the console.
    assert run.data.params["tracking.uri"] == server.url.replace("://", "://ampflow:***@")
    assert run.data.params["data.root"].endswith("cache/***")
    texts = [*run.data.params.items(), *run.data.tags.items(), *run.data.metrics]

    def artifacts(path=None):
        for item in client.list_artifacts(run.info.run_id, path):
            yield from artifacts(item.path) if item.is_dir else [item.path]

    paths = list(artifacts())
    assert {"config/job.yaml", "precision/audit.json", "memory/breakdown.json"} <= set(paths)
    contents = [Path(client.download_artifacts(run.info.run_id, path)).read_bytes() for path in paths]
    everything = repr(texts).encode() + b"".join(contents) + (captured.out + err).encode()
    assert token.encode() not in everything and password.encode() not in everything
    assert b"cache/***" in everything  # the resolved config artifact, redacted


def test_mlflow_down_at_start_is_a_clear_error_unless_not_required(ray_session, tmp_path, monkeypatch, write_job,
                                                                   capsys):
    """A tracking server down at the start is exit 2 with what to do, and nothing starts; with
    `tracking.required=false` the run trains anyway, and the server, once up, gets the run.

    Long: the second case trains a whole job, the server started only after its sixth checkpoint."""
    from orchestrator.cli.submit import main

    monkeypatch.chdir(tmp_path)
    down = MlflowServer(tmp_path / "late")  # nothing listens on its port yet
    (tmp_path / "late").mkdir()
    job = str(write_job(small_job(**LONG_JOB)))
    assert main([job, f"tracking.uri={down.url}"]) == 2
    err = capsys.readouterr().err
    assert f"MLflow at {down.url} cannot be reached" in err and "tracking.required: false" in err
    assert not (tmp_path / "ray_results").exists()  # nothing started

    thread, result = submit_in_background(tmp_path, monkeypatch, write_job, f"tracking.uri={down.url}",
                                          "tracking.required=false", "tracking.experiment=late",
                                          "tracking.log_every_n_steps=1")
    try:
        wait_for_checkpoint(tmp_path, 6)  # training without MLflow
    finally:
        down.start()
        thread.join(timeout=600)
    try:
        assert result["rc"] == 0
        assert "training anyway (tracking.required: false)" in capsys.readouterr().err
        client, run = the_run(down.url, "late")  # created late, then backfilled
        assert run.info.status == "FINISHED" and run.data.params["run.epochs"] == "4"
        assert_every_step_once(client, run.info.run_id)
    finally:
        down.stop()
