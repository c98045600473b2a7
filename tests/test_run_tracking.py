"""The MLflow run through its one door (`RunTracker`) and its one end (`records.close_run`), on a real
SQLite MLflow store and without Ray: the writer's records land once per step and resume where they
stopped; closing a run sets the run record and MLflow to the same status, or says why it could not.
"""

import pytest
from mlflow import MlflowClient

from conftest import small_job
from orchestrator.config import load_job
from orchestrator.runner import records
from orchestrator.tracking.tracker import RunTracker
from orchestrator.tracking.writer import MlflowWriter
from orchestrator.common.report import Report


@pytest.fixture
def tracker(write_job, mlflow_uri):
    cfg = load_job(write_job(small_job(tracking={"uri": mlflow_uri, "experiment": "door"})))
    return RunTracker.start(mlflow_uri, cfg, run_name="door", tags={}, params={}, config_yaml="a: 1\n")


def test_the_writer_logs_each_metric_once_per_step_and_a_resumed_writer_goes_on_after_the_last(tracker,
                                                                                                 monkeypatch):
    monkeypatch.setenv("AMPFLOW_TEST_SECRET", "hunter2-hunter2")
    writer = MlflowWriter(relay=None, tracker=tracker)
    writer.enqueue(Report(step=2, metrics={"train/loss": 0.5}, tags={"note": "key hunter2-hunter2"},
                          tables={"audit": [{"a": 1}]}))
    writer.enqueue(Report(step=2, metrics={"train/loss": 0.4, "eval/accuracy": 0.7},
                          overflow_records=[{"step": 2, "rank": 1}]))
    writer.enqueue(Report(step=4, metrics={"train/loss": 0.3}, overflow_records=[{"step": 3, "rank": 0}]))
    assert writer._flush(force=True)

    client = MlflowClient(tracking_uri=tracker.uri)
    assert [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, "train/loss")] == [(2, 0.5), (4, 0.3)]
    assert [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, "eval/accuracy")] == [(2, 0.7)]
    assert client.get_run(tracker.run_id).data.tags["note"] == "key ***"  # redacted at the door
    assert tracker.load_json("audit.json") == [{"a": 1}]
    assert [r["step"] for r in tracker.load_json("amp/overflow_log.json")] == [2, 3]

    resumed = MlflowWriter(relay=None, tracker=RunTracker.open(tracker.uri, tracker.run_id))
    resumed.resume_from_run()
    assert resumed.last_step == {"train/loss": 4, "eval/accuracy": 2}
    resumed.enqueue(Report(step=4, metrics={"train/loss": 9.0}, overflow_records=[{"step": 5, "rank": 0}]))  # a repeat
    resumed.enqueue(Report(step=6, metrics={"train/loss": 0.2}))
    assert resumed._flush(force=True)
    assert [m.step for m in tracker.metric_history("train/loss")] == [2, 4, 6]
    assert [r["step"] for r in tracker.load_json("amp/overflow_log.json")] == [2, 3, 5]


def test_a_resumed_runs_replayed_reports_fill_the_gap_once_and_the_writer_says_how_far_it_logged(tracker):
    """A driver died holding reports 3-4 (steps 6, 8): the resumed run sends back every report since the last
    one the dead driver had logged for sure (here 2-4), with their overflow records; only what MLflow lacks is
    logged, the overflow log has no duplicates, and the new writer tells storage the newest report it logged."""
    first = MlflowWriter(relay=None, tracker=tracker)
    first.enqueue(Report(seq=1, step=2, metrics={"train/loss": 0.9}))
    first.enqueue(Report(seq=2, step=4, metrics={"train/loss": 0.8},
                         overflow_records=[{"step": 3, "rank": 1, "event": "overflow"}]))
    assert first._flush(force=True)  # then the driver dies with reports 3 and 4 never taken

    told = []
    resumed = MlflowWriter(relay=None, tracker=RunTracker.open(tracker.uri, tracker.run_id), on_logged=told.append)
    resumed.resume_from_run()
    replay = [Report(seq=2, step=4, metrics={"train/loss": 0.8}), Report(seq=3, step=6, metrics={"train/loss": 0.7}),
              Report(seq=4, step=8, metrics={"train/loss": 0.6, "eval/accuracy": 0.5})]
    resumed.enqueue(Report(seq=4, step=8, metrics={"train/loss": 0.6, "eval/accuracy": 0.5}, replay=replay,
                           overflow_records=[{"step": 3, "rank": 1, "event": "overflow"},
                                             {"step": 7, "rank": 0, "event": "overflow"}]))
    resumed.enqueue(Report(seq=5, step=10, metrics={"train/loss": 0.5}))
    assert resumed._flush(force=True)
    resumed._tell_logged(force=True)
    assert [(m.step, m.value) for m in tracker.metric_history("train/loss")] == \
        [(2, 0.9), (4, 0.8), (6, 0.7), (8, 0.6), (10, 0.5)]
    assert [m.step for m in tracker.metric_history("eval/accuracy")] == [8]
    assert [(r["step"], r["rank"]) for r in tracker.load_json("amp/overflow_log.json")] == [(3, 1), (7, 0)]
    assert told == [5]


def test_a_report_counts_as_logged_only_once_all_of_its_records_are_in(tracker, monkeypatch):
    """MLflow takes a report's metrics, then fails on its overflow records: the writer does not yet say the report
    is logged (the workers would drop it, and a driver dying now would lose those records); once MLflow takes
    them too, it does."""
    told = []
    writer = MlflowWriter(relay=None, tracker=tracker, on_logged=told.append)
    writer.enqueue(Report(seq=1, step=2, metrics={"train/loss": 0.9}))
    writer.enqueue(Report(seq=2, step=4, metrics={"train/loss": 0.8},
                          overflow_records=[{"step": 3, "rank": 1, "event": "overflow"}]))
    real_log_dict = RunTracker.log_dict

    def refuses(self, value, path):
        raise ConnectionError("MLflow went away (injected)")

    monkeypatch.setattr(RunTracker, "log_dict", refuses)
    assert not writer._flush(force=True)
    writer._tell_logged(force=True)
    assert [m.step for m in tracker.metric_history("train/loss")] == [2, 4]  # report 2's metrics are in
    assert told == [1]
    monkeypatch.setattr(RunTracker, "log_dict", real_log_dict)
    assert writer._flush(force=True)
    writer._tell_logged(force=True)
    assert told == [1, 2]
    assert writer.close(timeout_s=0) == 0


def test_the_logged_through_record_round_trips_and_a_missing_or_torn_one_reads_as_nothing(tmp_path):
    from pyarrow import fs

    storage = str(tmp_path)
    (tmp_path / "run").mkdir()
    assert records.read_logged_through(fs.LocalFileSystem(), f"{tmp_path}/run") == 0
    records.write_logged_through(storage, "run", 17)
    assert records.read_logged_through(fs.LocalFileSystem(), f"{tmp_path}/run") == 17
    (tmp_path / "run" / records.LOGGED).write_text('{"se')  # being rewritten as it is read
    assert records.read_logged_through(fs.LocalFileSystem(), f"{tmp_path}/run") == 0


def test_closing_a_run_sets_its_record_and_its_mlflow_run_to_the_same_status(tracker, tmp_path):
    storage = str(tmp_path / "runs")
    records.write_record(storage, "door", run_id=tracker.run_id, status="RUNNING")
    records.close_run(tracker, "KILLED", 5, storage, "door")
    assert records.read_record(storage, "door")["status"] == "KILLED"
    assert tracker.status() == "KILLED"

    records.close_run(None, "FAILED", 5, storage, "never-started")  # no record, no MLflow run: nothing made
    assert not records.run_exists(storage, "never-started")


def test_an_mlflow_that_does_not_answer_at_the_end_is_reported_not_raised(monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    gone = RunTracker("http://127.0.0.1:9", "0", "c" * 32)
    records.close_run(gone, "FAILED", timeout_s=0)
    err = capsys.readouterr().err
    assert f"MLflow run {'c' * 32} could not be marked FAILED and still shows RUNNING" in err
    assert "`--resume` closes it" in err


def test_system_samples_of_every_rank_are_logged_at_their_own_time_once_even_when_sent_again(tracker):
    """Two ranks' samples ride on one report; a resumed run sends rank 1's again (and a newer one): each sample is
    logged once, at the step and time it was taken, whatever the report's own step."""
    first = MlflowWriter(relay=None, tracker=tracker)
    samples = [{"t": 1_000_000, "step": 1, "m": {"system/rank_0/cpu_utilization_percentage": 50.0}},
               {"t": 1_000_005, "step": 1, "m": {"system/rank_1/cpu_utilization_percentage": 70.0}},
               {"t": 1_010_000, "step": 1, "m": {"system/rank_1/cpu_utilization_percentage": 75.0}}]
    first.enqueue(Report(seq=1, step=2, metrics={"train/loss": 0.9}, system_samples=samples))
    assert first._flush(force=True)

    resumed = MlflowWriter(relay=None, tracker=RunTracker.open(tracker.uri, tracker.run_id))
    resumed.resume_from_run()
    again = samples[1:] + [{"t": 1_020_000, "step": 3, "m": {"system/rank_1/cpu_utilization_percentage": 80.0}}]
    resumed.enqueue(Report(seq=2, step=4, metrics={"train/loss": 0.8}, system_samples=again))
    assert resumed._flush(force=True)
    history = lambda key: [(m.step, m.timestamp, m.value) for m in tracker.metric_history(key)]  # noqa: E731
    assert history("system/rank_0/cpu_utilization_percentage") == [(1, 1_000_000, 50.0)]
    assert sorted(history("system/rank_1/cpu_utilization_percentage")) == \
        [(1, 1_000_005, 70.0), (1, 1_010_000, 75.0), (3, 1_020_000, 80.0)]
    assert "system_samples" not in {a.path for a in MlflowClient(tracking_uri=tracker.uri).list_artifacts(
        tracker.run_id)}  # bookkeeping, not a JSON artifact
