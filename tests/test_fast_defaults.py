"""The fast defaults: on a CUDA device each is on where it is safe, on the CPU none is, and each key turns it off."""

import pytest
import torch
from torch import nn

from conftest import small_job
from orchestrator.config import load_job
from orchestrator.train import cuda_defaults
from orchestrator.train.data import build_datasets
from orchestrator.train.training import build_training

CPU, GPU = torch.device("cpu"), torch.device("cuda")


def job(write_job, **sections):
    return load_job(write_job(small_job(**sections)))


CONV = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
MLP = nn.Sequential(nn.Linear(4, 4))


def test_channels_last_is_on_for_convolutions_on_cuda_only_and_a_key_decides(write_job):
    cfg = job(write_job)
    assert cuda_defaults.channels_last(cfg, CONV, GPU) and not cuda_defaults.channels_last(cfg, MLP, GPU)
    assert not cuda_defaults.channels_last(cfg, CONV, CPU)
    assert not cuda_defaults.channels_last(job(write_job, perf={"channels_last": False}), CONV, GPU)
    assert cuda_defaults.channels_last(job(write_job, perf={"channels_last": True}), CONV, CPU)
    assert not cuda_defaults.channels_last(job(write_job, scaling={"strategy": "fsdp"}), CONV, GPU)


def test_auto_means_the_fused_optimizer_on_cuda_for_the_built_ins_under_ddp(write_job):
    assert cuda_defaults.fused_optimizer(job(write_job), GPU) and not cuda_defaults.fused_optimizer(job(write_job), CPU)
    for sections in ({"optim": {"implementation": "foreach"}}, {"optim": {"name": "torch.optim:RMSprop"}},
                     {"scaling": {"strategy": "fsdp"}}):
        assert not cuda_defaults.fused_optimizer(job(write_job, **sections), GPU), sections


def test_on_the_cpu_the_built_training_keeps_today_s_choices(write_job):
    training = build_training(job(write_job, scaling={"num_workers": 1}), CPU, total_steps=4)
    assert training.prepared.memory_format == torch.contiguous_format
    group = training.optimizer.param_groups[0]
    assert not group.get("fused") and group.get("foreach") is None


def test_cudnn_benchmark_is_set_on_cuda_unless_turned_off(write_job, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    cuda_defaults.set_cudnn_benchmark(job(write_job), CPU)
    assert torch.backends.cudnn.benchmark is False
    cuda_defaults.set_cudnn_benchmark(job(write_job), GPU)
    assert torch.backends.cudnn.benchmark is True
    cuda_defaults.set_cudnn_benchmark(job(write_job, perf={"cudnn_benchmark": False}), GPU)
    assert torch.backends.cudnn.benchmark is False


def test_data_loader_auto_holds_tensor_datasets_on_cuda_when_they_fit(write_job, monkeypatch):
    cfg = job(write_job)
    datasets = build_datasets(cfg.data, cfg.model.num_classes)
    size = sum(cuda_defaults.tensor_bytes(dataset) for dataset in datasets)
    assert size > 0
    assert cuda_defaults.loader(cfg, datasets, CPU) == "dataloader"
    share = cuda_defaults.DEVICE_DATA_SHARE
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(size / share), 0))
    assert cuda_defaults.loader(cfg, datasets, GPU) == "device"
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(size / share) - 1, 0))
    assert cuda_defaults.loader(cfg, datasets, GPU) == "dataloader"  # it would not fit
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 ** 12, 0))
    assert cuda_defaults.loader(job(write_job, data={"loader": "dataloader"}), datasets, GPU) == "dataloader"
    assert cuda_defaults.loader(job(write_job, data={"loader_workers": 1}), datasets, GPU) == "dataloader"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_built_training_takes_the_fast_defaults(write_job):
    training = build_training(job(write_job, scaling={"num_workers": 1}, precision={"preset": "O1"}), GPU,
                              total_steps=4)
    assert training.prepared.memory_format == torch.channels_last
    assert training.optimizer.param_groups[0]["fused"] is True
    assert torch.backends.cudnn.benchmark is True
