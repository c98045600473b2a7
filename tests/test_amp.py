"""Autocast and GradScaler: the scaler is on exactly for fp16, skipped steps are seen."""

import pytest
import torch
from torch import nn

from orchestrator.config.schema import PrecisionSection
from orchestrator.precision import AmpSettings, autocast_context, found_inf, loss_scale_of, make_scaler


def settings(compute_dtype="float16", loss_scale="dynamic", **extra) -> AmpSettings:
    return AmpSettings.from_config(PrecisionSection(compute_dtype=compute_dtype, loss_scale=loss_scale, **extra))


@pytest.mark.parametrize(
    "compute_dtype, loss_scale, enabled",
    [("float16", "dynamic", True), ("float16", "128", True), ("float16", "none", False),
     ("bfloat16", "dynamic", False), ("float32", "dynamic", False)],
)
def test_scaler_enabled_exactly_for_fp16(compute_dtype, loss_scale, enabled):
    scaler = make_scaler(settings(compute_dtype, loss_scale), "cpu")
    assert scaler.is_enabled() is enabled
    assert loss_scale_of(scaler) == (float(scaler.get_scale()) if enabled else 1.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_autocast_computes_in_the_asked_dtype(dtype):
    amp = settings("float16" if dtype == torch.float16 else "bfloat16", "none")
    layer = nn.Linear(4, 4)
    with autocast_context(amp, "cpu"):
        out = layer(torch.randn(2, 4))
    assert out.dtype == dtype
    assert layer.weight.dtype == torch.float32  # autocast leaves parameters in fp32


def _step_with_grad(scaler, optimizer, param, grad_value):
    loss = (param * 1.0).sum()
    scaler.scale(loss).backward()
    param.grad.fill_(grad_value)
    before = param.detach().clone()
    scaler.step(optimizer)
    flag = found_inf(scaler, optimizer)
    scaler.update()
    return flag, before


def test_overflow_step_is_skipped_and_counted_and_scale_backs_off():
    param = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = make_scaler(settings(init_scale=1024.0), "cpu")
    flag, before = _step_with_grad(scaler, optimizer, param, float("inf"))
    assert flag.item() == 1.0
    assert torch.equal(param.detach(), before)  # the optimizer step was skipped
    assert loss_scale_of(scaler) == 512.0  # backoff_factor 0.5
    optimizer.zero_grad()
    flag, before = _step_with_grad(scaler, optimizer, param, 1.0)
    assert flag.item() == 0.0
    assert not torch.equal(param.detach(), before)


def test_fixed_loss_scale_never_moves():
    param = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = make_scaler(settings(loss_scale="128", growth_interval=1), "cpu")
    for grad in (float("nan"), 1.0, 1.0):
        optimizer.zero_grad()
        _step_with_grad(scaler, optimizer, param, grad)
        assert loss_scale_of(scaler) == 128.0


def test_found_inf_is_none_without_scaler():
    param = nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = make_scaler(settings("bfloat16", "none"), "cpu")
    assert found_inf(scaler, optimizer) is None
