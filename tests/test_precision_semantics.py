"""Precision that means what it says: presets true to their namesakes, norms that save memory, modes that
stay the user's, loss scaling that follows the gradients, an optimizer lint that measures (CPU)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import REPO
from orchestrator.cli.summary import summarize
from orchestrator.config import load_job
from orchestrator.runner.precision_lint import lint
from orchestrator.train.local import LocalSession
from orchestrator.train.loop import TrainingLoop
from orchestrator.train.models import build_model
from orchestrator.train.step import train_step
from orchestrator.train.training import build_training

QUICKSTART = REPO / "jobs" / "quickstart.yaml"
CPU = torch.device("cpu")
# What docs/precision.md's table promises per preset: autocast on or off.
AUTOCAST = {"O0": False, "O1": True, "O2": False, "O3": False, "bf16-mixed": True, "bf16-true": False}


def job(*overrides):
    return load_job(QUICKSTART, list(overrides))


def activations(preset: str) -> int:
    return sum(summarize("resnet18", (3, 32, 32), preset=preset, batch_size=4)["bytes"]["activations"].values())


def test_o2_saves_activation_memory_like_o1():
    o0, o1, o2 = activations("O0"), activations("O1"), activations("O2")
    assert o2 <= 0.55 * o0, (o0, o2)
    assert o2 <= 1.05 * o1, (o1, o2)


@pytest.mark.parametrize("preset", list(AUTOCAST))
def test_each_preset_autocasts_exactly_as_the_docs_table_says(preset):
    cfg = job(f"precision.preset={preset}")
    training = build_training(cfg, CPU, total_steps=1)
    train_step(training, torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,)), CPU, 1)
    entries = training.precision.close_audit()
    assert {entry["autocast"] for entry in entries} == {AUTOCAST[preset]}


@pytest.mark.parametrize("preset", list(AUTOCAST))
def test_the_docs_table_and_the_code_agree_property_by_property(preset):
    from orchestrator.precision import dtype_name
    from orchestrator.precision.policy import Policy

    table = (REPO / "docs" / "precision.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith(f"| `{preset}` |"))
    params, autocast, norms, masters, loss_scale, max_scale = [cell.strip() for cell in row.split("|")[2:8]]
    policy = Policy.from_config(job(f"precision.preset={preset}").precision)
    assert params == dtype_name(policy.param_dtype)
    assert autocast == ("on" if policy.autocast else "off") and policy.autocast == AUTOCAST[preset]
    assert norms == ("float32" if policy.keep_norm_fp32 else dtype_name(policy.param_dtype))
    assert masters == ("yes" if policy.master_weights else "no")
    assert loss_scale == str(policy.amp.loss_scale) and policy.scaler_enabled == (loss_scale == "dynamic")
    assert max_scale == ("2^24" if policy.scaler_enabled else "-") and policy.amp.max_scale == 2**24


class SoftmaxHead(nn.Module):
    """A layer of its own parameters whose forward applies softmax, an op on autocast's fp32 list."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3 * 32 * 32, num_classes) * 0.01)

    def forward(self, x):
        return F.softmax(x.flatten(1) @ self.weight, dim=1)


def test_o3_runs_softmax_in_float16_as_a_pure_half_model_does():
    cfg = job("precision.preset=O3")
    training = build_training(cfg, CPU, total_steps=1)
    head = SoftmaxHead()
    training.precision.prepare(head)
    with training.precision.forward():
        out = head(torch.randn(2, 3, 32, 32))
    entries = {e["name"]: e for e in training.precision.close_audit()}
    assert out.dtype == torch.float16
    assert entries["(model)"]["output_dtype"] == "float16" == entries["(model)"]["promised_output_dtype"]


class FineTuned(nn.Module):
    """A CNN whose BatchNorm the user froze in its constructor (the 'fix_bn' of fine-tuning)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.gn = nn.GroupNorm(2, 8)
        self.fc = nn.Linear(8, num_classes)
        self.bn.eval()

    def forward(self, x):
        x = torch.relu(self.gn(self.bn(self.conv(x))))
        return self.fc(x.mean((2, 3)))


def run_loop(tmp_path, monkeypatch, *overrides):
    module = tmp_path / "finetune_models.py"
    module.write_text("from test_precision_semantics import FineTuned\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    cfg = job("model.name=finetune_models:FineTuned", "scaling.num_workers=1", "run.epochs=2",
              "run.max_steps_per_epoch=3", "run.batch_size=8", *overrides)
    loop = TrainingLoop(cfg, LocalSession(0, 1, CPU, tmp_path / "checkpoints"))
    training = loop.run()
    return training.prepared.raw


def test_a_batchnorm_the_user_froze_stays_frozen_through_training_and_evaluation(tmp_path, monkeypatch):
    model = run_loop(tmp_path, monkeypatch, "precision.preset=O0")
    assert not model.bn.training and model.gn.training and model.training
    assert torch.equal(model.bn.running_mean, torch.zeros(8)) and torch.equal(model.bn.running_var, torch.ones(8))
    assert int(model.bn.num_batches_tracked) == 0


def test_freeze_norm_keeps_every_norm_layer_in_eval_mode(tmp_path, monkeypatch):
    model = run_loop(tmp_path, monkeypatch, "precision.preset=O2", "run.freeze_norm=true")
    assert not model.bn.training and not model.gn.training and model.conv.training
    assert int(model.bn.num_batches_tracked) == 0 and torch.equal(model.bn.running_mean, torch.zeros(8))


def test_a_scaler_runs_whenever_a_gradient_is_float16():
    o2_fp32_compute = job("precision.preset=O2", "precision.compute_dtype=float32")
    training = build_training(o2_fp32_compute, CPU, total_steps=1)
    assert training.precision.guard.scaler.is_enabled()
    assert lint(o2_fp32_compute, build_model(o2_fp32_compute.model)) == []
    # O3 without masters: the scaler unscales the float16 gradients themselves.
    o3_scaled = job("precision.preset=O3", "precision.loss_scale=dynamic")
    training = build_training(o3_scaled, CPU, total_steps=1)
    _, outcome = train_step(training, torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,)), CPU, 1)
    assert training.precision.guard.scaler.is_enabled() and outcome.stepped
    assert not build_training(job("precision.preset=bf16-true"), CPU, total_steps=1).precision.guard.scaler.is_enabled()


def test_no_loss_scaling_with_float16_gradients_is_a_finding_naming_the_cause():
    cfg = job("precision.preset=O2", "precision.compute_dtype=float32", "precision.loss_scale=none")
    (finding,) = lint(cfg, build_model(cfg.model))
    assert "float16 parameters in" in finding and "loss_scale: none" in finding and "autocast" not in finding


def test_the_loss_scale_never_grows_past_max_scale():
    cfg = job("precision.preset=O1", "precision.init_scale=8", "precision.growth_interval=1",
              "precision.max_scale=32")
    training = build_training(cfg, CPU, total_steps=8)
    for number in range(1, 7):
        train_step(training, torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,)), CPU, number)
    assert training.precision.guard.loss_scale() == 32.0


@pytest.mark.parametrize("overrides, adam_error", [
    (["precision.preset=O3", "optim.implementation=foreach"], True),      # fp16 state: v = g^2 underflows
    (["precision.preset=O3", "optim.implementation=fused"], True),        # fp32 arithmetic, still fp16 state
    (["precision.preset=O2"], False),                                     # fp32 masters: fp32 state
    (["precision.preset=bf16-true"], False),                              # bf16 keeps fp32's exponent range
])
def test_the_adam_lint_measures_the_optimizer_it_will_run(overrides, adam_error):
    cfg = job("optim.name=adam", "optim.lr=0.001", "optim.eps=1e-7", *overrides)
    findings = [f for f in lint(cfg, build_model(cfg.model)) if "v = g^2" in f]
    assert bool(findings) == adam_error, findings
    if adam_error:
        assert findings[0].severity == "error" and "instead of" in findings[0] and "master_weights: true" in findings[0]
