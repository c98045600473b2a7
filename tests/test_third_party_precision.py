"""Every preset with third-party models: a container that holds parameters of its own (timm's ViT: its class token
and position embeddings on the root) is cast by the policy, and promised what its last layer computes, so an fp32
head under a half preset is honoured; timm's ResNet keeps every promise too."""

import pytest
import torch

from conftest import REPO
from orchestrator.config import load_job
from orchestrator.precision import broken_promises
from orchestrator.train.step import train_step
from orchestrator.train.training import build_training

CPU = torch.device("cpu")
VIT = ["model.name=timm:create_model",
       "model.kwargs={model_name: vit_tiny_patch16_224, img_size: 32, patch_size: 16, depth: 1, embed_dim: 32, "
       "num_heads: 2}"]
HEAD_FP32 = "precision.rules=[{match: 'head*', dtype: float32}]"


def one_step_audit(overrides):
    cfg = load_job(REPO / "jobs" / "quickstart.yaml", overrides)
    training = build_training(cfg, CPU, total_steps=2)
    loss, _ = train_step(training, torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,)), CPU, 1)
    return {e["name"]: e for e in training.precision.audit.close()}, loss, training.prepared.raw


@pytest.mark.parametrize("preset, half", [("O2", "float16"), ("O3", "float16"), ("bf16-true", "bfloat16")])
def test_a_vit_with_an_fp32_head_keeps_every_promise_under_half_presets(preset, half):
    entries, loss, model = one_step_audit([*VIT, f"precision.preset={preset}", HEAD_FP32])
    assert broken_promises(list(entries.values())) == []
    root = entries["(model)"]
    # The root's own parameters (cls_token, pos_embed) are stored in the preset's dtype ...
    assert model.cls_token.dtype == model.pos_embed.dtype == getattr(torch, half) and root["param_dtype"] == half
    # ... and its output is its fp32 head's, as promised.
    assert (root["output_dtype"], root["promised_output_dtype"]) == ("float32", "float32")
    assert (entries["head"]["param_dtype"], entries["head"]["output_dtype"]) == ("float32", "float32")
    assert entries["blocks.0.attn.qkv"]["output_dtype"] == half
    assert torch.isfinite(loss)


def test_a_vit_under_o1_and_bf16_mixed_keeps_every_promise():
    for preset in ("O1", "bf16-mixed"):
        entries, loss, _ = one_step_audit([*VIT, f"precision.preset={preset}", HEAD_FP32])
        assert broken_promises(list(entries.values())) == [], preset
        assert entries["(model)"]["output_dtype"] == "float32"


@pytest.mark.parametrize("preset", ["O1", "bf16-mixed", "O2"])
def test_a_timm_resnet_keeps_every_promise(preset):
    """timm's ResNet by its factory: BatchNorm kept fp32 by the presets, an fp32 classifier by a rule under O2."""
    rules = [HEAD_FP32.replace("head*", "fc")] if preset == "O2" else []
    entries, loss, _ = one_step_audit(["model.name=timm:create_model", "model.kwargs={model_name: resnet10t}",
                                       f"precision.preset={preset}", *rules])
    assert broken_promises(list(entries.values())) == []
    assert entries["bn1"]["param_dtype"] == "float32"
    if preset == "O2":
        assert entries["conv1.0"]["param_dtype"] == "float16"
        assert (entries["fc"]["param_dtype"], entries["fc"]["output_dtype"]) == ("float32", "float32")
    assert torch.isfinite(loss)


def test_preflight_refuses_a_policy_the_model_cannot_keep_naming_the_layer(write_job):
    """Before Ray starts: the model copied, cast and run on two samples with the workers' audit."""
    from conftest import small_job
    from orchestrator.errors import BadInput
    from orchestrator.runner.preflight import check_data_fits_model
    from orchestrator.precision.kept import check_policy_kept
    from orchestrator.train.models import build_model

    def check(job):
        cfg = load_job(write_job(job))
        model, first = build_model(cfg.model), []
        check_data_fits_model(cfg, model, first)
        before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        try:
            check_policy_kept(cfg, model, first[0])
        finally:  # the job's model is left as it was: the check runs on a copy
            assert all(torch.equal(before[k], v) and v.dtype == torch.float32 for k, v in model.state_dict().items())

    with pytest.raises(BadInput, match=r"precision: O2 cannot be kept on model.name tiny_nets:Float64Output: layer "
                                       r"'\(model\)' \(Float64Output\) computed in float64, policy promised float16"):
        check(small_job(model={"name": "tiny_nets:Float64Output"}, precision={"preset": "O2"}))
    check(small_job(model={"name": "timm:create_model", "kwargs": {"model_name": "vit_tiny_patch16_224",
                                                                   "img_size": 32, "depth": 1, "embed_dim": 32,
                                                                   "num_heads": 2}},
                    precision={"preset": "O2", "rules": [{"match": "head*", "dtype": "float32"}]}))
