"""Autocast and the guarded GradScaler: on exactly for fp16, skips seen and counted, guardrails trip."""

import pytest
import torch
from torch import nn

from orchestrator.config.schema import PrecisionSection, ScalerGuardSection
from orchestrator.precision import AmpSettings, GuardedScaler, NonFiniteGradients, NonFiniteLoss, autocast_context
from orchestrator.precision.guarded_step import first_nonfinite

CPU = torch.device("cpu")


def settings(compute_dtype="float16", loss_scale="dynamic", **extra) -> AmpSettings:
    return AmpSettings.from_config(PrecisionSection(compute_dtype=compute_dtype, loss_scale=loss_scale, **extra))


def guarded(amp=None, **guard) -> GuardedScaler:
    return GuardedScaler(amp or settings(init_scale=1024.0), ScalerGuardSection(**guard), CPU)


@pytest.mark.parametrize(
    "compute_dtype, loss_scale, enabled",
    [("float16", "dynamic", True), ("float16", "128", True), ("float16", "none", False),
     ("bfloat16", "dynamic", False), ("float32", "dynamic", False)],
)
def test_scaler_enabled_exactly_for_fp16(compute_dtype, loss_scale, enabled):
    guard = guarded(settings(compute_dtype, loss_scale))
    assert guard.scaler.is_enabled() is enabled
    assert guard.loss_scale() == (float(guard.scaler.get_scale()) if enabled else 1.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_autocast_computes_in_the_asked_dtype(dtype):
    amp = settings("float16" if dtype == torch.float16 else "bfloat16", "none")
    layer = nn.Linear(4, 4)
    with autocast_context(amp, "cpu"):
        out = layer(torch.randn(2, 4))
    assert out.dtype == dtype
    assert layer.weight.dtype == torch.float32  # autocast leaves parameters in fp32


def _step(guard, optimizer, param, grad_value, loss_value=1.0, number=1):
    """One guarded step whose gradient (after scaling) is `grad_value` everywhere."""
    loss = (param * 1.0).sum() * loss_value
    optimizer.zero_grad()
    guard.scale(loss).backward()
    param.grad.fill_(grad_value)
    before = param.detach().clone()
    outcome = guard.step(optimizer, loss, number, [("layer.weight", param)])
    return outcome, before


def _param_and_optimizer():
    param = nn.Parameter(torch.ones(3))
    return param, torch.optim.SGD([param], lr=0.1)


def test_overflow_step_is_skipped_counted_logged_and_the_scale_backs_off():
    guard = guarded()
    param, optimizer = _param_and_optimizer()
    outcome, before = _step(guard, optimizer, param, float("inf"), number=7)
    assert outcome.overflow and not outcome.stepped
    assert torch.equal(param.detach(), before)  # the optimizer step was skipped
    assert guard.loss_scale() == 512.0  # backoff_factor 0.5
    (record,) = guard.drain_overflow_log()
    assert (record["step"], record["rank"], record["layer"], record["kind"]) == (7, 0, "layer", "inf")
    assert record["loss_scale"] == 1024.0  # the scale the overflow happened at
    outcome, before = _step(guard, optimizer, param, 1.0)
    assert outcome.stepped and not torch.equal(param.detach(), before)
    metrics = guard.metrics()
    assert metrics["amp/skipped_steps"] == 1.0 and metrics["amp/consecutive_skips"] == 0.0
    assert guard.end_epoch() == {"amp/skip_rate": 0.5}
    assert guard.end_epoch() == {"amp/skip_rate": 0.0}  # per epoch: the counts start again


def test_growth_events_follow_the_scaler():
    guard = guarded(settings(init_scale=8.0, growth_interval=2))
    param, optimizer = _param_and_optimizer()
    for _ in range(4):
        _step(guard, optimizer, param, 0.01)
    assert guard.loss_scale() == 32.0  # grew twice
    assert guard.metrics()["amp/growth_events"] == 2.0


def test_fixed_loss_scale_never_moves_but_still_skips():
    guard = guarded(settings(loss_scale="128", growth_interval=1))
    param, optimizer = _param_and_optimizer()
    for grad in (float("nan"), 1.0, 1.0):
        outcome, _ = _step(guard, optimizer, param, grad)
        assert guard.loss_scale() == 128.0
    assert guard.metrics()["amp/skipped_steps"] == 1.0 and guard.metrics()["amp/growth_events"] == 0.0


def test_nan_loss_is_skipped_without_backing_off_or_aborts():
    guard = guarded(on_nan_loss="skip")
    param, optimizer = _param_and_optimizer()
    outcome, before = _step(guard, optimizer, param, 1.0, loss_value=float("nan"))
    assert outcome.nan_loss and not outcome.stepped and not outcome.overflow
    assert torch.equal(param.detach(), before)
    assert guard.loss_scale() == 1024.0  # not an overflow: the scale stays
    assert guard.metrics()["amp/nan_loss_steps"] == 1.0

    with pytest.raises(NonFiniteLoss, match="step 5.*on_nan_loss: skip"):
        _step(guarded(on_nan_loss="abort"), optimizer, param, 1.0, loss_value=float("nan"), number=5)


def test_nan_loss_skip_works_without_a_scaler_too():
    guard = guarded(settings("bfloat16", "none"), on_nan_loss="skip")
    param, optimizer = _param_and_optimizer()
    outcome, before = _step(guard, optimizer, param, 1.0, loss_value=float("inf"))
    assert outcome.nan_loss and torch.equal(param.detach(), before)


def test_without_a_scaler_a_nan_loss_aborts_at_its_own_step_before_the_weights_change():
    guard = guarded(settings("bfloat16", "none"))  # on_nan_loss: abort, no GradScaler
    param, optimizer = _param_and_optimizer()
    before = param.detach().clone()
    with pytest.raises(NonFiniteLoss, match="at step 7 on rank"):
        _step(guard, optimizer, param, 1.0, loss_value=float("nan"), number=7)
    assert torch.equal(param.detach(), before)


@pytest.mark.parametrize("amp", [settings("float32", "none"), settings("bfloat16", "dynamic")], ids=["fp32", "bf16"])
def test_without_a_scaler_nonfinite_gradients_are_skipped_by_default_counted_and_attributed(amp):
    guard = GuardedScaler(amp, ScalerGuardSection(), CPU)
    assert not guard.scaler.is_enabled() and guard.on_nonfinite_grads == "skip"
    param, optimizer = _param_and_optimizer()
    outcome, before = _step(guard, optimizer, param, float("nan"), number=4)  # a finite loss, a NaN gradient
    assert not outcome.stepped and outcome.nonfinite_grads and not outcome.overflow
    assert torch.equal(param.detach(), before)
    metrics = guard.metrics()
    assert metrics["amp/nonfinite_grad_steps"] == 1.0 and metrics["amp/skipped_steps"] == 1.0
    (record,) = guard.drain_overflow_log()
    assert (record["step"], record["event"], record["param"], record["kind"]) == (4, "nonfinite_grads", "layer.weight",
                                                                                  "nan")
    outcome, before = _step(guard, optimizer, param, 1.0, number=5)
    assert outcome.stepped and not torch.equal(param.detach(), before)


def test_nonfinite_gradients_without_a_scaler_fail_or_warn_as_configured():
    param, optimizer = _param_and_optimizer()
    failing = GuardedScaler(settings("float32", "none"), ScalerGuardSection(), CPU, on_nonfinite_grads="fail")
    with pytest.raises(NonFiniteGradients, match=r"step 3 on rank\(s\) \[0\] \(first: layer.weight, inf\)"):
        _step(failing, optimizer, param, float("inf"), number=3)

    warning = GuardedScaler(settings("float32", "none"), ScalerGuardSection(), CPU, on_nonfinite_grads="warn")
    outcome, _ = _step(warning, optimizer, param, float("inf"), number=3)
    assert outcome.stepped and outcome.nonfinite_grads  # stepped anyway: the weights are inf now
    assert not torch.isfinite(param).all()
    assert warning.metrics()["amp/nonfinite_grad_steps"] == 1.0 and warning.metrics()["amp/skipped_steps"] == 0.0
    (message,) = warning.drain_warnings()
    assert "steps 3" in message and "on_nonfinite_grads: warn" in message
    assert warning.drain_warnings() == []


def test_skipped_nan_losses_count_toward_max_consecutive_skips():
    guard = guarded(settings("float32", "none"), on_nan_loss="skip", max_consecutive_skips=2)
    param, optimizer = _param_and_optimizer()
    reasons = [_step(guard, optimizer, param, 1.0, loss_value=float("nan"))[0].collapse for _ in range(3)]
    assert reasons[:2] == [None, None]
    assert reasons[2] == "3 consecutive skipped steps, the last with the loss not finite (max_consecutive_skips=2)"


def test_collapse_after_too_many_consecutive_skips_and_below_min_scale():
    guard = guarded(max_consecutive_skips=2, min_scale=None)
    param, optimizer = _param_and_optimizer()
    reasons = [_step(guard, optimizer, param, float("inf"))[0].collapse for _ in range(3)]
    assert reasons[:2] == [None, None] and "3 consecutive skipped steps" in reasons[2]

    guard = guarded(max_consecutive_skips=None, min_scale=300.0)  # 1024 -> 512 -> 256 < 300
    reasons = [_step(guard, optimizer, param, float("inf"))[0].collapse for _ in range(2)]
    assert reasons[0] is None and "loss scale 256 < min_scale=300" in reasons[1]
    assert guard.overflowing_layers() == ["layer"]
    _step(guard, optimizer, param, 1.0)
    assert guard.overflowing_layers() == []  # a clean step ends the streak


def test_first_nonfinite_names_the_layer_nearest_the_output():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()
    with torch.no_grad():
        model[0].weight.grad[0, 0] = float("inf")  # spread to the input side...
        model[2].weight.grad[1, 1] = float("nan")  # ...from where it began
    record = first_nonfinite(list(model.named_parameters()))
    assert (record["layer"], record["param"], record["kind"], record["nonfinite_count"]) == ("2", "2.weight", "nan", 1)
    assert record["max_abs_grad"] == pytest.approx(model[2].weight.grad.nan_to_num(0).abs().max().item())


def test_the_grad_scaler_internals_ampflow_reads_are_where_it_reads_them():
    """orchestrator.precision.scaler reads GradScaler's private found-inf flags and scale tensor, unscales fp16
    gradients through `_unscale_grads_`, and keeps a fixed scale with `_init_scale`: a torch that renames them
    fails here, not in a training run."""
    from orchestrator.precision.scaler import FixedScaler, Scaler

    half = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    optimizer = torch.optim.SGD([half], lr=0.1)
    scaler = Scaler("cpu", init_scale=1024.0)
    scaler.scale(half.float().sum()).backward()
    half.grad[0] = float("inf")
    scaler.unscale_(optimizer)  # fp16 gradients: torch refuses unless `_unscale_grads_` allows them
    (flag,) = scaler.found_inf_flags(optimizer)
    assert float(flag) == 1.0 and half.grad.dtype == torch.float16
    scaler.update()
    assert scaler.get_scale() == 512.0
    scaler.cap(100.0)
    assert scaler.get_scale() == 100.0

    fixed = FixedScaler("cpu", init_scale=64.0)
    fixed.scale(half.float().sum()).backward()
    fixed.unscale_(optimizer)
    fixed.update()  # an inf was found: a dynamic scaler would back off
    assert fixed.get_scale() == 64.0
