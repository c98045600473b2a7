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
    from orchestrator.data import build_datasets, build_loaders
    from orchestrator.optim import build_optimizer
    from orchestrator.precision import AmpSettings, make_scaler
    from orchestrator.worker import prepare_model, seed_everything, train_step

    cfg = load_job(config["job_file"], [f"precision.preset={config['preset']}", "optim.name=adam", "optim.lr=0.001"])
    context = ray.train.get_context()
    rank = context.get_world_rank()
    seed_everything(rank)  # different seeds: without DDP's broadcast + all-reduce the ranks would differ
    device = ray.train.torch.get_device()
    train, test = build_datasets(cfg.data, 10)
    loader, _, _ = build_loaders(train, test, batch_size=16, rank=rank, world_size=2, seed=0,
                                 loader_workers=0, pin_memory=False)
    prepared = prepare_model(cfg, device)
    optimizer = build_optimizer(cfg.optim, prepared.optimizer_params())
    amp = AmpSettings.from_config(cfg.precision)
    scaler = make_scaler(amp, device.type)
    first_batch_sum = None
    for step, (inputs, targets) in enumerate(loader):
        if step == 3:
            break
        first_batch_sum = first_batch_sum if first_batch_sum is not None else float(inputs.sum())
        train_step(prepared.model, inputs, targets, optimizer, scaler, amp, device, prepared.masters)
    params = list(prepared.raw.parameters())
    flat = torch.cat([p.detach().double().flatten() for p in params])
    ray.train.report({"rank": rank, "param_sum": float(flat.sum()), "param_abs": float(flat.abs().sum()),
                      "param_dtypes": sorted({str(p.dtype) for p in params}),
                      "first_batch_sum": first_batch_sum})


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


@pytest.mark.parametrize("preset, dtypes", [("bf16-mixed", ["torch.float32"]), ("O2", ["torch.float16"])])
def test_parameters_are_equal_on_both_ranks_after_training(ray_session, tmp_path, preset, dtypes):
    # O2: DDP all-reduces float16 gradients (gloo) and the ranks' fp32 masters stay in step.
    sink = Sink.remote()
    TorchTrainer(
        _train_a_few_steps,
        train_loop_config={"preset": preset, "job_file": str(REPO / "jobs" / "quickstart.yaml")},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path), name="ddp-sync", callbacks=[Collect(sink)]),
    ).fit()
    (reports,) = ray.get(sink.get.remote())
    rank0, rank1 = sorted(reports, key=lambda r: r["rank"])
    assert rank0["first_batch_sum"] != rank1["first_batch_sum"]  # each rank trained on its own shard
    assert rank0["param_dtypes"] == rank1["param_dtypes"] == dtypes
    assert rank0["param_sum"] == rank1["param_sum"]
    assert rank0["param_abs"] == rank1["param_abs"]
