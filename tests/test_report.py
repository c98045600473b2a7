"""The typed Report: its wire form is plain (it crosses processes through ray.train.report and lives in
checkpoints loaded with weights_only), round-trips whole, merges the ranks' records, and names the key Ray
Train scores checkpoints by."""

import numpy as np
import torch

from orchestrator.train.report import Report, score_attribute


def a_report() -> Report:
    return Report(seq=7, step=12, epoch=2, epochs=3, total_steps=18,
                  metrics={"train/loss": np.float32(0.25), "eval/accuracy": torch.tensor(0.5).item(), "amp/loss_scale": 1024},
                  tags={"resumed_from_step": "6"}, tables={"precision/audit": [{"name": "fc", "param_dtype": "float16"}]},
                  overflow_records=[{"step": 11, "rank": 1, "layer": "fc", "kind": "inf"}],
                  system_samples=[{"t": 1700000000000, "step": 11, "m": {"system/rank_0/cpu_utilization_percentage": 50.0}}],
                  warnings=["a checkpoint was skipped"], replay=[Report(seq=6, step=10, metrics={"train/loss": 0.3})])


def test_the_wire_form_round_trips_through_a_weights_only_load(tmp_path):
    report = a_report()
    torch.save(report.to_wire(), tmp_path / "wire.pt")
    loaded = Report.from_wire(torch.load(tmp_path / "wire.pt", weights_only=True))
    assert loaded == Report.from_wire(report.to_wire())
    assert loaded.metrics == {"train/loss": 0.25, "eval/accuracy": 0.5, "amp/loss_scale": 1024}
    assert type(loaded.metrics["train/loss"]) is float  # numpy and torch scalars become plain numbers
    assert loaded.replay == [Report(seq=6, step=10, metrics={"train/loss": 0.3})]
    assert (loaded.tags, loaded.tables, loaded.warnings) == (report.tags, report.tables, report.warnings)
    assert loaded.overflow_records == report.overflow_records and loaded.system_samples == report.system_samples


def test_the_wire_form_keeps_metrics_apart_from_what_is_not_a_metric():
    wire = a_report().to_wire()
    assert set(wire) == {"seq", "step", "epoch", "epochs", "total_steps", "metrics", "tags", "tables",
                         "overflow_records", "system_samples", "warnings", "replay"}
    assert set(wire["metrics"]) == {"train/loss", "eval/accuracy", "amp/loss_scale"}


def test_merging_keeps_rank_0s_report_and_every_ranks_records_in_rank_order():
    rank0, rank1 = a_report(), Report(seq=7, step=12, metrics={"train/loss": 9.0}, warnings=["rank 1's"],
                                      overflow_records=[{"step": 11, "rank": 1}], system_samples=[{"t": 2}])
    merged = Report.merged([rank0, rank1])
    assert merged.metrics == rank0.metrics and merged.warnings == rank0.warnings and merged.replay == rank0.replay
    assert merged.overflow_records == rank0.overflow_records + [{"step": 11, "rank": 1}]
    assert merged.system_samples == rank0.system_samples + [{"t": 2}]


def test_ray_train_finds_a_metric_under_its_score_attribute():
    """Ray Train flattens a report with "/" to find `checkpoint_score_attribute` (ray.train's checkpoint
    manager); a Ray that flattens otherwise would score every checkpoint -inf."""
    from ray._private.dict import flatten_dict

    flat = flatten_dict(Report(metrics={"eval/accuracy": 0.75}).to_wire())
    assert flat[score_attribute("eval/accuracy")] == 0.75
