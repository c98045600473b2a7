"""Fast-path switches change speed, not the maths: channels_last, optimizer kernels, torch.compile, DDP knobs."""

import tempfile
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
import torch.distributed as dist
from torch import nn

from orchestrator.config import load_job
from orchestrator.train.ddp import ddp_kwargs, register_comm_hook
from orchestrator.train.local import LocalSession
from orchestrator.train.batch import Batch
from orchestrator.train.loop import TrainingLoop
from orchestrator.train.step import Step
from orchestrator.train.training import build_training

from conftest import REPO

CPU = torch.device("cpu")


def job(*overrides):
    return load_job(REPO / "jobs/quickstart.yaml", ["precision.preset=O0", "scaling.num_workers=1", *overrides])


def losses(cfg, steps=3):
    """Losses of the first `steps` steps from a fixed initialisation, as the worker's training loop runs them
    (its `train_step`: the hooks, the audit closing, compilation once audited)."""
    session = LocalSession(0, 1, CPU, Path(tempfile.mkdtemp(prefix="fast-paths-")))  # no checkpoint is written
    loop = TrainingLoop(OmegaConf.merge(cfg, {"data": {"loader": "device", "augment": False},
                                              "run": {"batch_size": 16}}), session)
    loop.hooks.call("setup", loop)
    loop.position.set_position(0, 0, 16)
    out = []
    for index, batch in zip(range(steps), loop.train_loader):
        out.append(loop.train_step(Step(index + 1, 0, index, [batch])).loss.item())
    loop.hooks.call("teardown", loop)
    return out, loop.training


def test_channels_last_stores_conv_weights_nhwc_and_trains_the_same():
    reference, _ = losses(job())
    result, training = losses(job("perf.channels_last=true"))
    conv = training.prepared.raw.features[0]
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    placed = training.prepared.place(Batch.pair(torch.zeros(2, 3, 32, 32), torch.zeros(2, dtype=torch.long)), CPU)
    assert placed.args[0].is_contiguous(memory_format=torch.channels_last)
    assert result == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("implementation, flag, value", [("fused", "fused", True), ("foreach", "foreach", True),
                                                         ("for_loop", "foreach", False)])
def test_optimizer_implementation_picks_the_kernels_and_trains_the_same(implementation, flag, value):
    reference, _ = losses(job())
    result, training = losses(job(f"optim.implementation={implementation}"))
    assert training.optimizer.defaults[flag] is value
    assert result == pytest.approx(reference, rel=1e-5)


def test_fused_optimizer_steps_fp32_masters_under_o2():
    _, training = losses(job("precision.preset=O2", "optim.implementation=fused", "precision.lint=off"), steps=2)
    assert training.optimizer.defaults["fused"] is True
    assert next(training.prepared.raw.features[0].parameters()).dtype == torch.float16
    assert all(p.dtype == torch.float32 for group in training.optimizer.param_groups for p in group["params"])


def test_compile_starts_after_the_audited_first_step_and_trains_the_same():
    reference, _ = losses(job())
    cfg = job("perf.compile=true", "perf.compile_backend=aot_eager")
    result, training = losses(cfg)
    assert isinstance(training.prepared.model, torch._dynamo.eval_frame.OptimizedModule)
    assert training.prepared.compile_options is None
    assert result == pytest.approx(reference, rel=1e-4)
    # Before its first step, a freshly built model is not compiled yet: the audit's hooks run eagerly.
    fresh = build_training(cfg, CPU, total_steps=1)
    assert not isinstance(fresh.prepared.model, torch._dynamo.eval_frame.OptimizedModule)


def test_ddp_section_becomes_distributed_data_parallel_arguments():
    cfg = job("ddp.bucket_cap_mb=4", "ddp.gradient_as_bucket_view=true", "ddp.static_graph=true")
    assert ddp_kwargs(cfg.ddp) == {"bucket_cap_mb": 4.0, "gradient_as_bucket_view": True, "static_graph": True,
                                   "find_unused_parameters": False}


@pytest.fixture
def gloo_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def ddp_grads(hook: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.DistributedDataParallel(nn.Linear(64, 8)) if hasattr(nn, "DistributedDataParallel") else \
        nn.parallel.DistributedDataParallel(nn.Linear(64, 8))
    register_comm_hook(model, hook)
    model(torch.randn(16, 64) * 1e-3).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("hook, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_comm_hook_sends_gradients_rounded_to_its_dtype(gloo_group, hook, dtype):
    exact, compressed = ddp_grads("none"), ddp_grads(hook)
    assert all(torch.equal(c, e.to(dtype).float()) for c, e in zip(compressed, exact))
    assert any(not torch.equal(c, e) for c, e in zip(compressed, exact))  # the rounding is real
