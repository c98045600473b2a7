"""Per-layer dtype policies: presets, rules, fp32 masters, audit and lint, on real models (CPU)."""

import math

import pytest
import torch

from conftest import REPO
from orchestrator.config import load_job
from orchestrator.train.models import build_model
from orchestrator.precision import broken_promises
from orchestrator.runner.precision_lint import lint
from orchestrator.train.training import build_training
from orchestrator.train.step import train_step

QUICKSTART = REPO / "jobs" / "quickstart.yaml"


def job(*overrides):
    return load_job(QUICKSTART, list(overrides))


CPU = torch.device("cpu")


def prepared(cfg):
    """The worker's set-up without Ray (no DDP): policy applied, masters, optimizer, guarded scaler."""
    return build_training(cfg, CPU, total_steps=10)


def step(training, cfg, inputs, targets, step_number=1):
    return train_step(training, inputs, targets, CPU, step_number)


def one_step_audit(cfg, batch=4):
    training = prepared(cfg)
    loss, _ = step(training, cfg, torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,)))
    entries = training.precision.audit.close()
    return {e["name"]: e for e in entries}, loss, training.prepared.raw


def dtypes_by_type(entries, key):
    out = {}
    for e in entries.values():
        out.setdefault(e["type"], set()).add(e[key])
    return out


@pytest.mark.parametrize("model_name", ["simple_cnn", "resnet18"])
@pytest.mark.parametrize("preset", ["O0", "O1", "O2", "O3", "bf16-mixed", "bf16-true"])
def test_audit_shows_what_each_preset_promises(preset, model_name):
    cfg = job(f"precision.preset={preset}", f"model.name={model_name}")
    entries, loss, _ = one_step_audit(cfg, batch=2)
    assert broken_promises(list(entries.values())) == []
    params = dtypes_by_type(entries, "param_dtype")
    outputs = dtypes_by_type(entries, "output_dtype")
    half = {"O2": "float16", "O3": "float16", "bf16-true": "bfloat16"}.get(preset)
    compute = {"O1": "float16", "O2": "float16", "O3": "float16",
               "bf16-mixed": "bfloat16", "bf16-true": "bfloat16"}.get(preset, "float32")
    assert params["Conv2d"] == params["Linear"] == {half or "float32"}
    assert outputs["Conv2d"] == outputs["Linear"] == {compute}
    if model_name == "resnet18":
        norm = "float32" if preset in ("O0", "O1", "O2", "bf16-mixed") else half
        assert params["BatchNorm2d"] == {norm}
        if preset == "O2":
            # Kept fp32 and computed in fp32, but handing its neighbours float16: no fp32 activations saved.
            assert outputs["BatchNorm2d"] == {"float16"}
            assert all(e["rule"] == "keep_norm_fp32" for e in entries.values() if e["type"] == "BatchNorm2d")
    assert torch.isfinite(loss)


def test_rules_first_match_wins_by_class_and_by_qualified_name():
    cfg = load_job(QUICKSTART, ["precision.preset=O2", "model.name=resnet18",
                                "precision.rules=[{match: fc, dtype: float32}, {match: Linear, dtype: bfloat16},"
                                " {match: 'layer1.*', dtype: bfloat16}, {match: Conv2d, dtype: float32}]"])
    entries, loss, _ = one_step_audit(cfg, batch=2)
    assert broken_promises(list(entries.values())) == []
    fc = entries["fc"]
    assert (fc["param_dtype"], fc["output_dtype"], fc["rule"]) == ("float32", "float32", "fc")  # name beats class
    conv = entries["layer1.0.conv1"]
    assert (conv["param_dtype"], conv["rule"]) == ("bfloat16", "layer1.*")  # earlier rule beats Conv2d
    assert entries["layer2.0.conv1"]["param_dtype"] == "float32"  # Conv2d rule
    assert entries["layer1.0.bn1"]["param_dtype"] == "bfloat16"  # a rule beats keep_norm_fp32
    assert entries["layer2.0.bn1"]["param_dtype"] == "float32"  # keep_norm_fp32
    assert torch.isfinite(loss)


def test_policy_with_rules_from_the_issue_is_honoured_on_simple_cnn():
    cfg = load_job(QUICKSTART, ["precision.preset=O2", "precision.rules=[{match: 'classifier.*', dtype: float32}]"])
    entries, _, model = one_step_audit(cfg)
    for name in ("classifier.1", "classifier.3"):
        assert (entries[name]["param_dtype"], entries[name]["output_dtype"]) == ("float32", "float32")
    assert entries["features.0"]["param_dtype"] == "float16"


def test_audit_catches_a_layer_that_breaks_its_promise():
    # Under autocast a layer still runs when its weight is not in the promised dtype: only the audit sees it.
    cfg = job("precision.preset=O1")
    training = prepared(cfg)
    model = training.prepared.raw
    model.features[0].weight.data = model.features[0].weight.data.half()  # someone cast it behind the policy
    step(training, cfg, torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,)))
    problems = broken_promises(training.precision.audit.close())
    assert any("features.0" in p and "stores float16" in p for p in problems)


def test_fp16_params_with_adam_without_masters_is_a_lint_error_and_with_masters_trains():
    no_masters = job("precision.preset=O3", "optim.name=adam", "optim.lr=0.001")
    findings = lint(no_masters, build_model(no_masters.model))
    assert any("optim.eps" in f and "master_weights: true" in f for f in findings)

    with_masters = job("precision.preset=O2", "optim.name=adam", "optim.lr=0.001")
    assert lint(with_masters, build_model(with_masters.model)) == []
    training = prepared(with_masters)
    model = training.prepared.raw
    generator = torch.Generator().manual_seed(0)
    for number in range(1, 5):
        inputs = torch.randn(4, 3, 32, 32, generator=generator)
        loss, _ = step(training, with_masters, inputs, torch.randint(0, 10, (4,), generator=generator), number)
        assert math.isfinite(loss.item())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model.features[0].weight.dtype == torch.float16
    state = training.precision.fp32_state_dict()
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    # The half parameter is the rounded master: the optimizer really stepped on fp32.
    assert torch.equal(state["features.0.weight"].half(), model.features[0].weight.detach())


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["precision.preset=O3", "model.name=resnet18"], "normalisation layers in float16"),
        (["precision.compute_dtype=float16", "precision.loss_scale=none"], "loss_scale: dynamic"),
        (["precision.param_dtype=float16"], "is rounded away"),
        (["precision.rules=[{match: 'transformer.*', dtype: float32}]"], "'transformer.*' matches no layer"),
    ],
)
def test_lint_names_the_problem_and_the_fix(overrides, fragment):
    cfg = job(*overrides)
    findings = lint(cfg, build_model(cfg.model))
    assert any(fragment in f and "Fix:" in f for f in findings), findings


def test_clean_presets_have_no_lint_findings():
    for preset in ("O0", "O1", "O2", "bf16-mixed"):
        cfg = job(f"precision.preset={preset}", "model.name=resnet18")
        assert lint(cfg, build_model(cfg.model)) == [], preset
    # bf16-true steps bfloat16 weights with SGD: only a warning that small updates are lost.
    cfg = job("precision.preset=bf16-true", "model.name=resnet18")
    (finding,) = lint(cfg, build_model(cfg.model))
    assert finding.severity == "warning" and "|gradient| >=" in finding


def test_batchnorm_kept_fp32_runs_in_eval_mode_under_o2():
    cfg = job("precision.preset=O2", "model.name=resnet18")
    model = prepared(cfg).prepared.raw
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        logits = model(torch.randn(2, 3, 32, 32))
    assert torch.isfinite(logits).all()
    assert model.bn1.weight.dtype == torch.float32 and model.bn1.running_var.dtype == torch.float32
    assert model.conv1.weight.dtype == torch.float16
