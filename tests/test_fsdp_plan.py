"""FSDP units and their MixedPrecisionPolicy from the per-layer rules (`orchestrator.precision.fsdp`), planned on the
CPU without a process group: which modules become units and why, what each unit gathers, stores, reduces and hands
on under each preset, and the rules FSDP cannot honour (exit 2 naming them)."""

import pytest
import torch
from torch import nn

from conftest import REPO
from orchestrator.config import load_job
from orchestrator.errors import BadInput
from orchestrator.precision.fsdp import FsdpSettings, plan_units
from orchestrator.precision.policy import Policy, plan
from orchestrator.train.fsdp_memory import predict_rank_bytes
from orchestrator.train.models import resnet18

QUICKSTART = REPO / "jobs" / "quickstart.yaml"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.embed(x))))


class Blocks(nn.Module):
    """Two blocks of (Linear, LayerNorm), an untied output layer, and a `fsdp_units` hint."""

    fsdp_units = ["blocks.0", "blocks.1"]

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(2))
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight (a language model's usual tying)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.mix(self.embed(tokens)))


def units(model, *overrides, wrap=(), reduce_dtype=F32):
    policy = Policy.from_config(load_job(QUICKSTART, list(overrides)).precision)
    return plan_units(model, policy, plan(model, policy), FsdpSettings(tuple(wrap), reduce_dtype))


def by_name(fsdp_plan):
    return {unit.label: unit for unit in fsdp_plan.units}


def test_default_units_are_the_direct_children_holding_parameters_then_the_root():
    fsdp_plan = units(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), "precision.preset=O0")
    assert [u.label for u in fsdp_plan.units] == ["0", "2", "(model)"]  # ReLU holds none; the root comes last
    assert by_name(fsdp_plan)["0"].reason == "a direct child holding parameters"
    assert by_name(fsdp_plan)["0"].params == ("0.weight", "0.bias")
    assert fsdp_plan.unit_of["1"] == ""  # the ReLU computes within the root's unit


def test_wrap_globs_and_the_models_hint_choose_the_units():
    by_glob = by_name(units(Blocks(), "precision.preset=O0", wrap=["blocks.*"]))
    assert set(by_glob) == {"blocks.0", "blocks.1", "(model)"}  # `out` is left to the root
    assert by_glob["blocks.1"].reason == "scaling.fsdp.wrap[0] 'blocks.*'"
    assert by_glob["(model)"].params == ("out.weight", "out.bias")
    by_class = units(Blocks(), "precision.preset=O0", wrap=["Sequential"])
    assert {u.label for u in by_class.units} == {"blocks.0", "blocks.1", "(model)"}
    hinted = by_name(units(Blocks(), "precision.preset=O0"))
    assert set(hinted) == {"blocks.0", "blocks.1", "(model)"} and hinted["blocks.0"].reason == "Blocks.fsdp_units"


def test_units_are_applied_deepest_first_and_the_root_last():
    names = [u.name for u in units(resnet18(), "precision.preset=O2").units]
    assert names[-1] == ""
    depth = [name.count(".") for name in names[:-1]]
    assert depth == sorted(depth, reverse=True)
    assert "layer1.0.bn1" in names  # keep_norm_fp32 made each BatchNorm a unit of its own, inside layer1


def test_o2_gathers_half_stores_fp32_masters_and_keeps_norm_units_fp32():
    plan_ = by_name(units(resnet18(), "precision.preset=O2"))
    conv = plan_["layer1"]
    assert (conv.compute_dtype, conv.storage_dtype) == (F16, F32)  # the fp32 shards are the masters
    assert conv.mp_policy.param_dtype == F16 and conv.mp_policy.reduce_dtype == F32
    norm = plan_["layer1.0.bn1"]
    assert norm.reason == "rule 'keep_norm_fp32' (float32)"
    assert (norm.compute_dtype, norm.storage_dtype) == (F32, F32)
    # BatchNorm's CPU kernel takes fp16 inputs with fp32 parameters and returns fp16: nothing to cast.
    assert norm.mp_policy.cast_forward_inputs is False and norm.mp_policy.output_dtype is None
    assert norm.params == ("layer1.0.bn1.weight", "layer1.0.bn1.bias")
    assert "layer1.0.bn1.weight" not in plan_["layer1"].params


def test_o3_and_bf16_true_store_what_they_compute_in():
    for preset, dtype in (("O3", F16), ("bf16-true", BF16)):
        for unit in units(resnet18(), f"precision.preset={preset}").units:
            assert unit.compute_dtype == unit.storage_dtype == dtype, (preset, unit)


def test_autocast_presets_keep_fp32_parameters_and_let_autocast_cast():
    for preset in ("O1", "bf16-mixed"):
        for unit in units(resnet18(), f"precision.preset={preset}").units:
            assert unit.compute_dtype == unit.storage_dtype == F32
            assert unit.mp_policy.cast_forward_inputs is False and unit.mp_policy.output_dtype is None


def test_an_fp32_rule_in_a_half_model_is_a_unit_that_hands_its_neighbours_their_dtype():
    plan_ = by_name(units(Tiny(), "precision.preset=bf16-true", "precision.rules=[{match: head, dtype: float32}]"))
    head = plan_["head"]
    assert head.compute_dtype == head.storage_dtype == F32
    assert head.mp_policy.param_dtype == F32 and head.mp_policy.cast_forward_inputs is True
    assert head.mp_policy.output_dtype == BF16  # without it: "mat1 and mat2 must have the same dtype"
    assert plan_["embed"].mp_policy.output_dtype is None  # same dtype as the root: nothing to hand on


def test_a_rule_inside_a_wrapped_unit_splits_it():
    rule = "precision.rules=[{match: 'blocks.1.0', dtype: float32}]"
    plan_ = by_name(units(Blocks(), "precision.preset=bf16-true", rule, wrap=["blocks.*"]))
    assert plan_["blocks.1.0"].reason == "rule 'blocks.1.0' (float32)"
    assert plan_["blocks.1"].params == ("blocks.1.1.weight", "blocks.1.1.bias")
    assert plan_["blocks.1.0"].mp_policy.output_dtype == BF16


def test_reduce_dtype_is_every_units_reduction_dtype():
    for unit in units(Tiny(), "precision.preset=O2", reduce_dtype=BF16).units:
        assert unit.mp_policy.reduce_dtype == BF16


def test_a_direct_child_sharing_a_parameter_is_left_to_the_root():
    plan_ = by_name(units(Tied(), "precision.preset=O0"))
    assert set(plan_) == {"mix", "(model)"}
    assert plan_["(model)"].params == ("embed.weight",)  # named once, kept in one unit


def test_a_rule_fsdp_cannot_honour_is_bad_input_naming_it():
    with pytest.raises(BadInput) as info:
        units(Tied(), "precision.preset=bf16-true", "precision.rules=[{match: head, dtype: float32}]")
    message = str(info.value)
    assert "'head.weight' is shared by 'embed', 'head'" in message or "'embed.weight' is shared by" in message
    assert "rule 'head' (float32)" in message and "one dtype" in message


def test_a_wrap_glob_that_matches_no_module_holding_parameters_is_bad_input():
    with pytest.raises(BadInput, match=r"scaling.fsdp.wrap\[1\]: 'ReLU' matches no module holding parameters"):
        units(Tiny(), "precision.preset=O0", wrap=["head", "ReLU"])


def test_a_hint_naming_no_submodule_is_bad_input():
    class Hinted(Tiny):
        def fsdp_units(self):
            return ["embed", "decoder"]

    with pytest.raises(BadInput, match="Hinted.fsdp_units names 'decoder', which is not a submodule"):
        units(Hinted(), "precision.preset=O0")


def test_the_prediction_shards_by_rows_padded_to_the_world_size():
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2))  # 5x4 + 5, 2x5 + 2 elements
    fsdp_plan = units(model, "precision.preset=O2")
    one = predict_rank_bytes(model, fsdp_plan, 1, optimizer_states=2)
    assert one == {"params": {"float32": 37 * 4}, "grads": {"float32": 37 * 4}, "optimizer": {"float32": 2 * 37 * 4}}
    # Two ranks: ceil(5/2) = 3 rows of 4 (+3) and ceil(2/2) = 1 row of 5 (+1) on each; rank 1 keeps 2 of its 3 rows.
    rank0 = predict_rank_bytes(model, fsdp_plan, 2, rank=0, optimizer_states=2)
    rank1 = predict_rank_bytes(model, fsdp_plan, 2, rank=1, optimizer_states=2)
    assert rank0["params"] == rank1["params"] == {"float32": (12 + 3 + 5 + 1) * 4}
    assert rank0["optimizer"] == {"float32": 2 * (12 + 3 + 5 + 1) * 4}
    assert rank1["optimizer"] == {"float32": 2 * (8 + 2 + 5 + 1) * 4}
