"""DDP through Ray Train really synchronises the ranks."""

import sys

import pytest
import ray.train
import torch
from ray.train import RunConfig, ScalingConfig, UserCallback
from ray.train.torch import TorchTrainer

from conftest import REPO

pytestmark = pytest.mark.slow

# The workers cannot import this test module: ship its functions and classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _train_a_few_steps(config):
    import ray.train.torch

    from orchestrator.config import load_job
    from orchestrator.train.data import build_datasets, build_loaders
    from orchestrator.train.faults import Faults
    from orchestrator.train.training import build_training
    from orchestrator.train.rng import seed_everything
    from orchestrator.train.step import train_step

    cfg = load_job(config["job_file"], [f"precision.preset={config['preset']}", "optim.name=adam", "optim.lr=0.001",
                                        *config.get("overrides", [])])
    context = ray.train.get_context()
    rank = context.get_world_rank()
    seed_everything(rank)  # different seeds: without DDP's broadcast + all-reduce the ranks would differ
    device = ray.train.torch.get_device()
    train, test = build_datasets(cfg.data, 10)
    loader, _, _ = build_loaders(train, test, batch_size=16, rank=rank, world_size=2, seed=0,
                                 loader_workers=0, pin_memory=False)
    training = build_training(cfg, device, rank=rank, world_size=2, total_steps=3)
    faults = Faults(cfg.faults, rank)
    first_batch_sum, outcomes = None, []
    for step, (inputs, targets) in enumerate(loader, start=1):
        if step == 4:
            break
        first_batch_sum = first_batch_sum if first_batch_sum is not None else float(inputs.sum())
        _, outcome = train_step(training, inputs, targets, device, step, faults)
        outcomes.append(outcome.stepped)
    params = list(training.prepared.raw.parameters())
    flat = torch.cat([p.detach().double().flatten() for p in params])
    ray.train.report({"rank": rank, "param_sum": float(flat.sum()), "param_abs": float(flat.abs().sum()),
                      "param_dtypes": sorted({str(p.dtype) for p in params}),
                      "first_batch_sum": first_batch_sum, "stepped": outcomes,
                      **training.precision.guard.metrics(), "overflow_log": training.precision.guard.drain_overflow_log()})


class Collect(UserCallback):
    def __init__(self, sink):
        self.sink = sink

    def after_report(self, run_context, metrics, checkpoint):
        ray.get(self.sink.put.remote(metrics))


@ray.remote(num_cpus=0)
class Sink:
    def __init__(self):
        self.items = []

    def put(self, item):
        self.items.append(item)

    def get(self):
        return self.items


def _run(tmp_path, name, **config):
    sink = Sink.remote()
    TorchTrainer(
        _train_a_few_steps,
        train_loop_config={"job_file": str(REPO / "jobs" / "quickstart.yaml"), **config},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path), name=name, callbacks=[Collect(sink)]),
    ).fit()
    (reports,) = ray.get(sink.get.remote())
    return sorted(reports, key=lambda r: r["rank"])


@pytest.mark.parametrize("preset, dtypes", [("bf16-mixed", ["torch.float32"]), ("O2", ["torch.float16"])])
def test_parameters_are_equal_on_both_ranks_after_training(ray_session, tmp_path, preset, dtypes):
    # O2: DDP all-reduces float16 gradients (gloo) and the ranks' fp32 masters stay in step.
    rank0, rank1 = _run(tmp_path, "ddp-sync", preset=preset)
    assert rank0["first_batch_sum"] != rank1["first_batch_sum"]  # each rank trained on its own shard
    assert rank0["param_dtypes"] == rank1["param_dtypes"] == dtypes
    assert rank0["param_sum"] == rank1["param_sum"]
    assert rank0["param_abs"] == rank1["param_abs"]


def test_an_overflow_on_one_rank_is_seen_by_both_and_both_skip(ray_session, tmp_path):
    # The inf reaches rank 1's gradient only, after DDP's all-reduce: only the gathered found-inf
    # flags can make rank 0 skip too. Without that, rank 0 would step and the ranks would drift.
    overrides = ["faults.overflow_at_steps=[2]", "faults.overflow_rank=1", "faults.overflow_layer=features.0",
                 "precision.init_scale=1024"]
    rank0, rank1 = _run(tmp_path, "ddp-overflow", preset="O1", overrides=overrides)
    assert rank0["stepped"] == rank1["stepped"] == [True, False, True]
    assert rank0["amp/skipped_steps"] == rank1["amp/skipped_steps"] == 1.0
    assert rank0["amp/loss_scale"] == rank1["amp/loss_scale"] == 512.0  # both backed off
    assert rank0["amp/rank_disagreements"] == rank1["amp/rank_disagreements"] == 1.0
    assert rank0["param_sum"] == rank1["param_sum"]
    assert rank0["overflow_log"] == [{"step": 2, "event": "ranks_disagree", "found_inf_by_rank": [0, 1]}]
    (record,) = rank1["overflow_log"]
    assert (record["step"], record["rank"], record["layer"], record["kind"]) == (2, 1, "features.0", "inf")
