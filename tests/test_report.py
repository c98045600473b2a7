"""The typed Report: its wire form is plain (it crosses processes through ray.train.report and lives in
checkpoints loaded with weights_only), round-trips whole, merges the ranks' records, and scores checkpoints
as Ray Train's checkpoint manager needs."""

from pathlib import Path

import numpy as np
import pytest
import torch

from orchestrator.common.report import CHECKPOINT_SCORE, Report, checkpoint_score


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
                         "overflow_records", "system_samples", "warnings", "checkpoint_score", "replay", "at"}
    assert set(wire["metrics"]) == {"train/loss", "eval/accuracy", "amp/loss_scale"}


def test_merging_keeps_rank_0s_report_and_every_ranks_records_in_rank_order():
    rank0, rank1 = a_report(), Report(seq=7, step=12, metrics={"train/loss": 9.0}, warnings=["rank 1's"],
                                      overflow_records=[{"step": 11, "rank": 1}], system_samples=[{"t": 2}])
    merged = Report.merged([rank0, rank1])
    assert merged.metrics == rank0.metrics and merged.warnings == rank0.warnings and merged.replay == rank0.replay
    assert merged.overflow_records == rank0.overflow_records + [{"step": 11, "rank": 1}]
    assert merged.system_samples == rank0.system_samples + [{"t": 2}]


@pytest.mark.parametrize("mode", ["min", "max"])
def test_ray_trains_checkpoint_manager_keeps_the_best_evaluated_checkpoints_and_always_the_newest(tmp_path, mode):
    """Ray Train's own checkpoint manager (the one the controller runs) given our reports' wire forms, with
    `num_to_keep` 2: checkpoints without an evaluation (steps 1, 3, 5) never displace evaluated ones, whichever
    the mode, and the newest checkpoint, the one a resume needs, is never deleted. Its bookkeeping, saved as
    JSON, loads again (an infinite score would be saved as null). Ray scores a report lacking the attribute
    -inf before applying the mode: under `min` that would rank every unevaluated checkpoint best."""
    import asyncio

    from ray.train import Checkpoint, CheckpointConfig
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.storage import StorageContext
    from ray.train.v2._internal.execution.training_report import _TrainingReport

    storage = StorageContext(str(tmp_path), "run")
    config = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute=CHECKPOINT_SCORE, checkpoint_score_order=mode)
    evaluated = {2: 1.0, 4: 2.0, 6: 3.0} if mode == "min" else {2: 3.0, 4: 2.0, 6: 1.0}  # best first

    def kept() -> set[int]:
        return {int(path.name.split("_")[1]) for path in (tmp_path / "run").glob("checkpoint_[0-9]*")}

    async def register_all(manager: CheckpointManager) -> None:
        for step in range(1, 7):
            path = storage.build_checkpoint_path_from_name(f"checkpoint_{step}")
            Path(path).mkdir()
            report = Report(seq=step, step=step, metrics={"eval/loss": evaluated[step]} if step in evaluated else {})
            report.checkpoint_score = checkpoint_score(report.metrics, "eval/loss", mode)
            manager.register_checkpoint(_TrainingReport(Checkpoint(path), report.to_wire(), validation=False))
            assert step in kept(), f"the newest checkpoint {step} was deleted"

    asyncio.run(register_all(CheckpointManager(config, storage)))
    assert kept() == {2, 4, 6}  # the two best evaluated, and the newest (the worst evaluated)

    async def reload() -> str:
        return CheckpointManager(config, storage).best_checkpoint_result.checkpoint.path

    assert asyncio.run(reload()).endswith("checkpoint_2")