"""DDP really synchronises the ranks: two processes joined by gloo, each training its own shard with the
step the Ray Train worker runs (the worker adds nothing to it: test_one_core)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import REPO

pytestmark = pytest.mark.slow


def _train_a_few_steps(rank: int, config: dict, directory: str) -> None:
    from orchestrator.config import load_job
    from orchestrator.train.data import build_datasets, build_loaders
    from drills import Overflow
    from orchestrator.train.local import exit_rank
    from orchestrator.train.rng import seed_everything
    from orchestrator.train.step import train_step
    from orchestrator.train.training import build_training

    cfg = load_job(config["job_file"], [f"precision.preset={config['preset']}", "optim.name=adam", "optim.lr=0.001",
                                        *config.get("overrides", [])])
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=2)
    try:
        seed_everything(rank)  # different seeds: without DDP's broadcast + all-reduce the ranks would differ
        device = torch.device("cpu")
        train, test = build_datasets(cfg.data, 10)
        loader, _, _ = build_loaders(train, test, batch_size=16, rank=rank, world_size=2, seed=0,
                                     loader_workers=0, pin_memory=False)
        training = build_training(cfg, device, rank=rank, world_size=2, total_steps=3)
        drill = Overflow(**config["overflow"]) if "overflow" in config else None
        as_loop = SimpleNamespace(rank=rank, training=training)  # what the drill reads of the loop
        after_backward = (lambda step: drill.after_backward(as_loop, step)) if drill else None
        first_batch_sum, outcomes = None, []
        for step, (inputs, targets) in enumerate(loader, start=1):
            if step == 4:
                break
            first_batch_sum = first_batch_sum if first_batch_sum is not None else float(inputs.sum())
            _, outcome = train_step(training, inputs, targets, device, step, after_backward)
            outcomes.append(outcome.stepped)
        params = list(training.prepared.raw.parameters())
        flat = torch.cat([p.detach().double().flatten() for p in params])
        guard = training.precision.guard
        torch.save({"rank": rank, "param_sum": float(flat.sum()), "param_abs": float(flat.abs().sum()),
                    "param_dtypes": sorted({str(p.dtype) for p in params}),
                    "first_batch_sum": first_batch_sum, "stepped": outcomes,
                    **guard.metrics(), "overflow_log": guard.drain_overflow_log()}, f"{directory}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    exit_rank()


def _run(tmp_path: Path, **config) -> list[dict]:
    mp.spawn(_train_a_few_steps, args=({"job_file": str(REPO / "jobs" / "quickstart.yaml"), **config}, str(tmp_path)),
             nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


@pytest.mark.parametrize("preset, dtypes", [("bf16-mixed", ["torch.float32"]), ("O2", ["torch.float16"])])
def test_parameters_are_equal_on_both_ranks_after_training(tmp_path, preset, dtypes):
    # O2: DDP all-reduces float16 gradients (gloo) and the ranks' fp32 masters stay in step.
    rank0, rank1 = _run(tmp_path, preset=preset)
    assert rank0["first_batch_sum"] != rank1["first_batch_sum"]  # each rank trained on its own shard
    assert rank0["param_dtypes"] == rank1["param_dtypes"] == dtypes
    assert rank0["param_sum"] == rank1["param_sum"]
    assert rank0["param_abs"] == rank1["param_abs"]


def test_an_overflow_on_one_rank_is_seen_by_both_and_both_skip(tmp_path):
    # The inf reaches rank 1's gradient only, after DDP's all-reduce: only the gathered found-inf
    # flags can make rank 0 skip too. Without that, rank 0 would step and the ranks would drift.
    rank0, rank1 = _run(tmp_path, preset="O1", overrides=["precision.init_scale=1024"],
                        overflow={"at_steps": [2], "rank": 1, "layer": "features.0"})
    assert rank0["stepped"] == rank1["stepped"] == [True, False, True]
    assert rank0["amp/skipped_steps"] == rank1["amp/skipped_steps"] == 1.0
    assert rank0["amp/loss_scale"] == rank1["amp/loss_scale"] == 512.0  # both backed off
    assert rank0["amp/rank_disagreements"] == rank1["amp/rank_disagreements"] == 1.0
    assert rank0["param_sum"] == rank1["param_sum"]
    assert rank0["overflow_log"] == [{"step": 2, "event": "ranks_disagree", "found_inf_by_rank": [0, 1]}]
    (record,) = rank1["overflow_log"]
    assert (record["step"], record["rank"], record["layer"], record["kind"]) == (2, 1, "features.0", "inf")
