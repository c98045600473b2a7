"""`dtype: float8` as a per-layer rule: the Linear layers it matches compute in float8 through torchao's
Float8Linear (emulated on the CPU), audited like the other rules; where torchao or the GPU cannot, the job is
refused saying what to install or where it runs."""

import importlib.util
import math

import pytest
import torch
from omegaconf import OmegaConf

from conftest import small_job
from orchestrator.config.loader import load_job
from orchestrator.config.schema import PrecisionSection
from orchestrator.errors import BadInput
from orchestrator.precision import Precision, float8
from orchestrator.precision.policy import broken_promises
from orchestrator.runner.precision_lint import lint
from orchestrator.train.local import LocalSession
from orchestrator.train.loop import TrainingLoop
from orchestrator.train.models import build_model

CPU = torch.device("cpu")


def section(*rules):
    return OmegaConf.merge(OmegaConf.structured(PrecisionSection), {"rules": list(rules)})


def test_a_float8_rule_makes_exactly_its_linear_layers_float8_with_their_scaling_and_the_audit_holds_it():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    precision = Precision(section({"match": "0", "dtype": "float8"},
                                  {"match": "2", "dtype": "float8", "scaling": "rowwise"}), CPU)
    model = precision.prepare(model)
    assert [type(m).__name__ for m in model] == ["Float8Linear", "ReLU", "Float8Linear", "ReLU", "Linear"]
    assert "dyn_ten" in repr(model[0]) and "dyn_axs" in repr(model[2])  # tensorwise, rowwise
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the weights stay fp32
    with precision.forward():
        out = model(torch.randn(16, 32))
    out.sum().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(p.grad).all() for p in model.parameters())
    entries = {e["name"]: e for e in precision.audit.close()}
    assert (entries["0"]["float8"], entries["2"]["float8"], entries["4"]["float8"]) == (True, True, False)
    assert all(e["float8"] == e["promised_float8"] for e in entries.values())
    assert broken_promises(list(entries.values())) == []
    entries["0"]["float8"] = False  # a layer that ran its matmuls in fp32 after all
    assert broken_promises(list(entries.values())) == [
        "layer '0' (Linear) computed its matmuls in float32, policy promised float8 (rule 0)"]


def test_a_job_with_a_float8_rule_trains_through_the_loop_and_its_audit_says_float8(write_job, tmp_path):
    cfg = load_job(write_job(small_job(scaling={"num_workers": 1}, run={"max_steps_per_epoch": 3},
                                       precision={"rules": [{"match": "Linear", "dtype": "float8"}]})))
    session = LocalSession(0, 1, CPU, tmp_path / "checkpoints")
    TrainingLoop(cfg, session).run()
    audit = next(r.tables["precision/audit"] for r in session.reports if "precision/audit" in r.tables)
    linear = [e for e in audit if e["type"] == "Linear"]
    assert linear and all(e["float8"] and e["promised_float8"] for e in linear)
    assert all(not e["float8"] for e in audit if e["type"] != "Linear")
    assert math.isfinite(session.reports[-1].metrics["train/loss"])


def test_a_float8_rule_matching_a_layer_that_is_not_linear_is_a_lint_error(write_job):
    cfg = load_job(write_job(small_job(precision={"rules": [{"match": "Conv2d", "dtype": "float8"}]})))
    findings = lint(cfg, build_model(cfg.model))
    assert any("float8 applies to Linear layers only" in f and "(Conv2d)" in f for f in findings), findings


def test_without_torchao_a_job_with_a_float8_rule_is_refused_saying_what_to_install(write_job, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(BadInput, match=r"precision.rules\[0\].dtype: float8 rules need torchao.*pip install"):
        load_job(write_job(small_job(precision={"rules": [{"match": "Linear", "dtype": "float8"}]})))


def test_a_gpu_without_float8_tensor_cores_is_named_with_what_to_use_there(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    reason = float8.unavailable(torch.device("cuda"))
    assert "compute capability 8.9+" in reason and "A100-SXM4-80GB is 8.0" in reason and "bfloat16" in reason
    assert float8.unavailable(CPU) is None  # torchao installed: the CPU emulates


def test_an_unknown_float8_scaling_is_refused_naming_the_key(write_job):
    with pytest.raises(BadInput, match=r"precision.rules\[0\].scaling: unknown scaling 'blockwise'"):
        load_job(write_job(small_job(precision={"rules": [{"match": "Linear", "dtype": "float8",
                                                            "scaling": "blockwise"}]})))


def test_a_float8_job_for_the_gpus_of_a_machine_without_float8_tensor_cores_is_a_lint_error(write_job, monkeypatch):
    cfg = load_job(write_job(small_job(scaling={"use_gpu": True},
                                       precision={"rules": [{"match": "Linear", "dtype": "float8"}]})))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    findings = lint(cfg, build_model(cfg.model))
    assert any("float8 rules need a GPU with float8 tensor cores" in f for f in findings), findings


@pytest.mark.slow  # two spawned gloo ranks
def test_under_fsdp2_float8_layers_train_sharded_and_the_audit_holds_them(write_job, tmp_path):
    from orchestrator.train.local import spawn

    cfg = load_job(write_job(small_job(scaling={"num_workers": 2, "strategy": "fsdp"}, run={"max_steps_per_epoch": 3},
                                       precision={"rules": [{"match": "Linear", "dtype": "float8"}]})))
    reports = spawn(OmegaConf.to_container(cfg, resolve=True), world_size=2, directory=tmp_path / "run")["reports"]
    audit = next(r.tables["precision/audit"] for r in reports if "precision/audit" in r.tables)
    assert {e["name"]: e["float8"] for e in audit} == {"features.0": False, "features.3": False,
                                                       "classifier.1": True, "classifier.3": True}
    assert all(e["float8"] == e["promised_float8"] for e in audit)
    assert math.isfinite(reports[-1].metrics["train/loss"])
