"""Per-rank system metrics: sampled off the training thread under MLflow's system metric names, gathered
from every rank by the relay callback, and turned off by an interval of 0."""

import os
import time

import torch

from orchestrator.common.report import Report
from orchestrator.train.system import FLOOR_S, SystemSampler, start_sampler, wait_s


def test_a_sampler_reads_its_process_cpu_and_memory_at_the_step_the_loop_is_at():
    sampler = SystemSampler(rank=3, device=torch.device("cpu"), interval_s=0.05).start()
    sampler.step = 7
    samples, deadline = [], time.monotonic() + 60
    while len(samples) < 3 and time.monotonic() < deadline:  # some CPU for the sampler to see, however loaded
        busy_until = time.monotonic() + 0.1
        while time.monotonic() < busy_until:
            sum(i * i for i in range(1000))
        samples += sampler.take()
    sampler.stop()
    samples += sampler.take()
    assert len(samples) >= 3 and sampler.take() == []  # taken once
    assert [s["t"] for s in samples] == sorted(s["t"] for s in samples)
    for sample in samples:
        assert set(sample["m"]) == {"system/rank_3/cpu_utilization_percentage", "system/rank_3/memory_rss_megabytes"}
        assert 0 <= sample["m"]["system/rank_3/cpu_utilization_percentage"] <= 100 * os.cpu_count()
        assert sample["m"]["system/rank_3/memory_rss_megabytes"] > 10  # a process with torch loaded
        assert abs(sample["t"] / 1000 - time.time()) < 60
    assert samples[-1]["step"] == 7
    assert max(s["m"]["system/rank_3/cpu_utilization_percentage"] for s in samples) > 10  # it saw the busy loop


def test_a_short_run_is_sampled_often_enough_to_draw_a_line_and_a_long_one_at_the_configured_interval():
    # An 11 s run under the default 10 s interval: at least 10 samples, never closer than the floor.
    elapsed, waits = 0.0, []
    while elapsed + wait_s(10.0, elapsed) <= 11.0:
        waits.append(wait_s(10.0, elapsed))
        elapsed += waits[-1]
    assert len(waits) >= 10 and min(waits) == FLOOR_S
    assert wait_s(10.0, 3600.0) == 10.0  # an hour in: as configured
    assert wait_s(0.1, 0.0) == 0.1  # an interval asked below the floor is kept


def test_a_sampler_under_the_default_interval_samples_a_two_second_rank_at_least_twice():
    sampler = SystemSampler(rank=0, device=torch.device("cpu"), interval_s=10.0).start()
    time.sleep(2.5)
    sampler.stop()
    assert len(sampler.take()) >= 2  # the first at the floor, not after 10 s


def test_an_interval_of_zero_samples_nothing():
    assert start_sampler(0, torch.device("cpu"), 0) is None


def test_the_relay_callback_gathers_every_ranks_samples_onto_rank_0s_report():
    sample = lambda rank: {"t": 1, "step": 2, "m": {f"system/rank_{rank}/memory_rss_megabytes": 1.0}}  # noqa: E731
    ranks = [Report(step=2, metrics={"train/loss": 0.5}, system_samples=[sample(0)],
                    overflow_records=[{"step": 1, "rank": 0}], tags={"t": "0"}),
             Report(step=2, metrics={"train/loss": 0.5}, system_samples=[sample(1)],
                    overflow_records=[{"step": 1, "rank": 1}], tags={"t": "1"})]
    merged = Report.merged([Report.from_wire(report.to_wire()) for report in ranks])  # as they travel
    assert merged == Report(step=2, metrics={"train/loss": 0.5}, system_samples=[sample(0), sample(1)],
                            overflow_records=[{"step": 1, "rank": 0}, {"step": 1, "rank": 1}], tags={"t": "0"})
    assert Report.merged([Report(step=1), Report(step=1)]).system_samples == []
