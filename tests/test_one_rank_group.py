"""A process group of one rank makes no collective: a single-GPU Ray Train worker, or the Ray-free loop on one rank,
runs in a group of one, where the first NCCL collective would build a communicator (seconds on a GPU) and each one
after it would launch a kernel and wait for it, which a single-GPU script never pays."""

import torch
import torch.distributed as dist

from orchestrator.config import load_job
from orchestrator.train.local import LocalSession
from orchestrator.train.loop import TrainingLoop

from conftest import small_job

COLLECTIVES = ("all_reduce", "barrier", "broadcast", "all_gather", "all_gather_object", "reduce", "new_group")


def test_one_rank_trains_evaluates_logs_and_checkpoints_without_a_collective(write_job, tmp_path, monkeypatch):
    cfg = load_job(write_job(small_job(scaling={"num_workers": 1}, run={"epochs": 2, "max_steps_per_epoch": 3},
                                       tracking={"log_every_n_steps": 2})))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    calls: list[str] = []
    try:
        for name in COLLECTIVES:
            monkeypatch.setattr(dist, name, lambda *args, _name=name, **kwargs: calls.append(_name))
        session = LocalSession(0, 1, torch.device("cpu"), tmp_path / "checkpoints")
        TrainingLoop(cfg, session).run()
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
    assert calls == []
    # What the collectives would have agreed on is still there: losses, evaluations, memory, checkpoints.
    metrics = {name for report in session.reports for name in report.metrics}
    assert {"train/loss", "eval/accuracy", "eval/loss"} <= metrics
    assert len(session.checkpoints()) == 2
