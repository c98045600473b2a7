"""A run's goodput across its attempts (`orchestrator.tracking.goodput`): the driver's accounting of where the wall
time from submit to the run's end went, from the reports (each with the loop's `time/*` split of its window and
the time it was handed over) and the restarts the controller relays. Plain arithmetic: no Ray."""

import json

import pytest

from conftest import small_job
from orchestrator.config import load_job
from orchestrator.tracking.goodput import PARTS, AttemptEnded, RunClock
from orchestrator.tracking.nodes import NodeLost
from orchestrator.tracking.time_breakdown import JSON_PATH, PNG_PATH, log_goodput
from orchestrator.tracking.tracker import RunTracker
from orchestrator.tracking.writer import MlflowWriter
from orchestrator.common.report import Report

SUBMIT = 1_790_000_000.0


def window(data=0.0, compute=0.0, comm=0.0, eval=0.0, checkpoint=0.0, other=0.0) -> dict[str, float]:
    return {"time/data_s": data, "time/compute_s": compute, "time/comm_s": comm, "time/eval_s": eval,
            "time/checkpoint_s": checkpoint, "time/other_s": other}


def report(seq, step, at, **parts) -> Report:
    return Report(seq=seq, step=step, at=SUBMIT + at, metrics={"system/world_size": 2.0, **window(**parts)})


def resumed(seq, step, at) -> Report:
    """A restarted attempt's first report: the checkpoint's report sent again, before its first step."""
    return Report(seq=seq, step=step, at=SUBMIT + at, tags={"resumed_from_step": str(step)},
                  metrics={"system/world_size": 2.0, **window(compute=99.0)})  # the old window's: not counted


def assert_sums_to_wall(breakdown, wall):
    assert breakdown.wall_s == pytest.approx(wall)
    assert sum(breakdown.parts.values()) == pytest.approx(wall)
    assert all(seconds >= 0 for seconds in breakdown.parts.values())
    for attempt in breakdown.attempts:
        assert set(attempt["parts_s"]) == set(PARTS)


def test_one_attempt_splits_submit_to_end_into_start_up_the_windows_parts_and_the_end():
    clock = RunClock(SUBMIT)
    # Windows of 10 s that tile the time from the first step (at 20 s) to the last report (at 50 s).
    clock.report(report(1, 2, 30, data=1, compute=6, comm=1, other=2))
    clock.report(report(2, 4, 40, data=1, compute=6, comm=1, checkpoint=1, other=1))
    clock.report(report(3, 6, 50, data=1, compute=6, comm=1, eval=1, other=1))
    breakdown = clock.breakdown(SUBMIT + 58)

    assert_sums_to_wall(breakdown, 58)
    # Exchanges outside the steps (`time/comm_s`: the window's reduction, a report's hand-off) are not training.
    assert breakdown.parts == pytest.approx({"training": 18, "startup": 20, "restarts": 0, "redone": 0,
                                             "checkpoint": 1, "eval": 1, "data": 3, "other": 4 + 3, "end": 8})
    assert breakdown.fraction == pytest.approx(18 / 58)
    metrics = breakdown.metrics()
    assert metrics["goodput/fraction"] == pytest.approx(18 / 58) and metrics["goodput/wall_s"] == pytest.approx(58)
    assert metrics["goodput/startup_s"] == pytest.approx(20) and metrics["goodput/end_s"] == pytest.approx(8)
    assert metrics["goodput/attempts"] == 1.0
    assert breakdown.line() == "time: 34% start-up, 31% training, 14% the end, 12% other, 5% data stalls, " \
                               "2% evaluation, 2% checkpoints (of 58 s)"


def test_a_node_loss_costs_the_restart_and_the_steps_trained_again_at_the_lost_attempt_s_own_step_time():
    clock = RunClock(SUBMIT)
    # Attempt 1: steps 1-6 in 3 windows of 2 steps, 2 s of compute each (1 s a step); checkpoint at step 4.
    clock.report(report(1, 2, 12, compute=2))
    clock.report(report(2, 4, 14, compute=2))
    clock.report(report(3, 6, 16, compute=2))
    lost_at = SUBMIT + 17
    clock.node_lost(lost_at)  # relayed late, once Ray declared the node dead ...
    clock.ended(AttemptEnded(lost_at + 0.2, "failure"))  # ... or before the controller's restart: either way
    clock.report(resumed(2, 4, 30))  # the restarted attempt resumed the checkpoint of step 4 at 30 s
    clock.report(report(3, 6, 34, compute=4))  # 2 s a step now (one worker fewer)
    clock.report(report(4, 8, 38, compute=4))
    breakdown = clock.breakdown(SUBMIT + 40)

    assert_sums_to_wall(breakdown, 40)
    # Steps 5 and 6 were trained twice: the first time (attempt 1, 1 s each) is the badput.
    assert breakdown.parts["redone"] == pytest.approx(2)
    assert breakdown.parts["restarts"] == pytest.approx(30 - 16)
    assert breakdown.parts["startup"] == pytest.approx(10)
    assert breakdown.parts["training"] == pytest.approx(6 - 2 + 8)
    first, second = breakdown.attempts
    assert (first["ended_by"], first["steps_redone"], first["last_step"]) == ("node loss", 2, 6)
    assert (second["resumed_from_step"], second["first_step"], second["last_step"]) == (4, 4, 8)
    assert first["parts_s"]["redone"] == pytest.approx(2) and second["parts_s"]["restarts"] == pytest.approx(14)
    assert breakdown.restart_causes == ["node loss"]
    assert "35% restarts after a node loss" in breakdown.line()
    assert "5% redone after a node loss" in breakdown.line()


def test_a_preemption_at_a_checkpoint_redoes_nothing_and_says_so():
    clock = RunClock(SUBMIT)
    clock.report(report(1, 5, 10, compute=5))  # the checkpoint of step 5, written on the notice
    clock.ended(AttemptEnded(SUBMIT + 11, "preemption"))
    clock.report(resumed(1, 5, 20))
    clock.report(report(2, 10, 25, compute=5))
    breakdown = clock.breakdown(SUBMIT + 26)
    assert_sums_to_wall(breakdown, 26)
    assert breakdown.parts["redone"] == 0 and breakdown.parts["restarts"] == pytest.approx(10)
    assert breakdown.restart_causes == ["preemption"] and "restarts after a preemption" in breakdown.line()
    assert "redone" not in breakdown.line()


def test_a_restart_without_a_checkpoint_starts_a_new_attempt_and_redoes_every_step_before_it():
    clock = RunClock(SUBMIT)
    clock.report(report(1, 3, 8, compute=3))
    clock.report(report(2, 6, 11, compute=3))
    # No checkpoint: the restarted attempt trains from step 0, its reports numbered afresh (no controller word).
    clock.report(report(1, 3, 23, compute=3))
    clock.report(report(2, 6, 26, compute=3))
    breakdown = clock.breakdown(SUBMIT + 26)
    assert_sums_to_wall(breakdown, 26)
    assert len(breakdown.attempts) == 2 and breakdown.attempts[0]["steps_redone"] == 6
    assert breakdown.parts["redone"] == pytest.approx(6) and breakdown.parts["training"] == pytest.approx(6)
    assert breakdown.parts["restarts"] == pytest.approx(20 - 11)  # its first window began at 20 s
    assert breakdown.restart_causes == [None] and "redone after a restart" in breakdown.line()


def test_an_attempt_that_ends_before_it_reports_is_restart_time_and_elastic_resizes_are_named():
    clock = RunClock(SUBMIT)
    clock.report(report(1, 4, 10, compute=4))
    clock.ended(AttemptEnded(SUBMIT + 11, "elastic resize"))
    clock.ended(AttemptEnded(SUBMIT + 15, "failure"))  # the grown group failed before its first report
    clock.report(resumed(1, 4, 20))
    clock.report(report(2, 8, 24, compute=4))
    breakdown = clock.breakdown(SUBMIT + 24)
    assert_sums_to_wall(breakdown, 24)
    assert [attempt.ended_by for attempt in clock.attempts] == ["elastic resize", "failure", None]
    assert len(breakdown.attempts) == 2  # bars for the attempts that trained; the one between is restart time
    assert breakdown.parts["restarts"] == pytest.approx(10)
    assert breakdown.restart_causes == ["elastic resize"]


def test_without_the_loop_s_time_metrics_an_attempt_s_time_is_training_and_start_up_ends_at_the_first_step():
    clock = RunClock(SUBMIT)
    clock.report(Report(seq=1, step=2, at=SUBMIT + 12, metrics={"perf/time_to_first_step_s": 9.0}))
    clock.report(Report(seq=2, step=4, at=SUBMIT + 14))
    breakdown = clock.breakdown(SUBMIT + 15)
    assert_sums_to_wall(breakdown, 15)
    assert breakdown.parts["startup"] == pytest.approx(9) and breakdown.parts["training"] == pytest.approx(5)
    assert breakdown.parts["end"] == pytest.approx(1) and not breakdown.timed


def test_times_out_of_order_never_make_a_part_negative_and_the_parts_still_sum_to_the_wall():
    clock = RunClock(SUBMIT)
    clock.report(report(1, 2, -1, compute=30))  # a worker's clock behind the driver's; windows longer than seen
    clock.report(report(2, 4, 5, compute=3, data=3))
    breakdown = clock.breakdown(SUBMIT + 4)  # the driver's end before the last report's time
    assert_sums_to_wall(breakdown, 5)
    assert breakdown.parts["training"] + breakdown.parts["data"] == pytest.approx(5)


def test_a_run_that_never_reported_is_all_start_up():
    breakdown = RunClock(SUBMIT).breakdown(SUBMIT + 7)
    assert breakdown.parts["startup"] == 7 and breakdown.fraction == 0 and breakdown.attempts == []


@pytest.fixture
def tracker(write_job, mlflow_uri):
    cfg = load_job(write_job(small_job(tracking={"uri": mlflow_uri, "experiment": "goodput"})))
    return RunTracker.start(mlflow_uri, cfg, run_name="goodput", tags={}, params={}, config_yaml="a: 1\n")


def test_the_writer_times_what_the_relay_hands_it_and_the_run_gets_goodput_metrics_json_and_chart(
        tracker, mlflow_uri, capsys):
    from mlflow import MlflowClient

    writer = MlflowWriter(relay=None, tracker=tracker)
    writer.clock.submitted_at = SUBMIT
    writer.accept([report(1, 2, 10, compute=2), report(2, 4, 12, compute=2), report(3, 6, 14, compute=2),
                   AttemptEnded(SUBMIT + 15, "failure"), NodeLost("a" * 56, "10.0.0.2", [1], SUBMIT + 14.9)])
    writer.accept([resumed(2, 4, 25), report(3, 6, 27, compute=2), report(4, 8, 29, compute=2)])
    assert writer._flush(force=True)
    assert "2 step(s) redone" in capsys.readouterr().err

    breakdown = log_goodput(tracker, writer.clock, step=8, end_at=SUBMIT + 30)
    logged = tracker.latest_metrics()
    assert logged["goodput/wall_s"] == pytest.approx(30) and logged["goodput/redone_s"] == pytest.approx(2)
    assert logged["goodput/fraction"] == pytest.approx(breakdown.fraction)
    assert sum(logged[f"goodput/{part}_s"] for part in PARTS) == pytest.approx(logged["goodput/wall_s"])
    saved = tracker.load_json(JSON_PATH)
    assert [attempt["ended_by"] for attempt in saved["attempts"]] == ["node loss", None]
    assert saved == json.loads(json.dumps(breakdown.to_json()))
    assert PNG_PATH in {artifact.path for artifact in MlflowClient(mlflow_uri).list_artifacts(tracker.run_id, "perf")}


def test_a_preemption_notice_s_exception_names_the_restart_a_preemption():
    from ray.train import WorkerGroupError

    from orchestrator.tracking.attempts import failure_cause
    from orchestrator.train.preemption import Preempted

    assert failure_cause(WorkerGroupError("x", {1: Preempted("notice"), 0: RuntimeError("peer")})) == "preemption"
    assert failure_cause(WorkerGroupError("x", {0: RuntimeError("boom")})) == "failure"
    assert failure_cause(RuntimeError("the controller's own")) == "failure"


def test_the_time_a_rank_handed_a_report_over_travels_on_the_wire_and_the_merge_keeps_rank_0s():
    ranks = [Report.from_wire({**Report(seq=3, step=6).to_wire(), "at": SUBMIT + rank}) for rank in (0, 1)]
    merged = Report.merged(ranks)
    assert merged.at == SUBMIT
    assert Report.from_wire(json.loads(json.dumps(merged.to_wire()))).at == SUBMIT
    assert Report.from_wire({"seq": 1, "step": 2}).at is None  # a report of an older worker: the driver's clock
