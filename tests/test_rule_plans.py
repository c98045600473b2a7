"""Rules that do more than choose a dtype: `checkpoint: full | selective` (activation checkpointing of the matched
blocks) and `compile: true` (each matched block compiled on its own). The dtype keeps its first-match-wins meaning (a
rule without a dtype decides none); the audit says per layer what was applied; bad rules are refused at load or in
pre-flight, naming the key. A float8 rule leaves out the Linear layers below torchao's thresholds when asked
(`precision.float8_min_size`). Fast ones run the Ray-free loop in one process; the slow ones train on two ranks
(DDP, FSDP2) and measure the activation figure of `bench.rule_checkpoint`."""

import pytest
import torch
import yaml
from torch import nn

from conftest import small_job
from orchestrator.config import load_job
from orchestrator.errors import BadInput
from orchestrator.precision.blocks import apply_blocks
from orchestrator.precision.policy import Policy, plan
from orchestrator.train.batch import Batch
from orchestrator.train.local import LocalSession
from orchestrator.train.loop import TrainingLoop
from orchestrator.train.models import SimpleCNN
from orchestrator.train.strategy import check_plan

CPU = torch.device("cpu")


def job(tmp_path, name="job", **sections):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(small_job(**sections), sort_keys=False))
    return load_job(path)


def trained(cfg, directory):
    """rank 0's reports of the job run on the Ray-free loop in this process."""
    session = LocalSession(0, 1, CPU, directory)
    TrainingLoop(cfg, session).run()
    return session.reports


def audit_of(reports):
    return {entry["name"]: entry for entry in next(r.tables["precision/audit"] for r in reports
                                                   if "precision/audit" in r.tables)}


def losses(reports):
    return [r.metrics["train/loss"] for r in reports if "train/loss" in r.metrics]


# -- the plan ---------------------------------------------------------------------------------------------------

def policy_of(*rules, **precision):
    return Policy.from_config(load_job_section(list(rules), **precision))


def load_job_section(rules, **precision):
    from omegaconf import OmegaConf

    from orchestrator.config.sections.precision import PrecisionSection

    section = OmegaConf.structured(PrecisionSection)
    return OmegaConf.merge(section, {"rules": rules, **precision})


def test_a_rule_without_a_dtype_decides_no_dtype_and_the_next_matching_rule_does():
    policy = policy_of({"match": "features", "checkpoint": "full"}, {"match": "feat*", "dtype": "bfloat16"},
                       {"match": "classifier", "compile": True}, {"match": "class*", "dtype": "float16"})
    plans = plan(SimpleCNN(), policy)
    assert plans["features"].checkpoint == "full" and plans["features"].param_dtype == torch.bfloat16
    assert plans["features"].rule == "feat*" and plans["features"].checkpoint_rule == "features"
    assert plans["classifier"].compile and plans["classifier"].param_dtype == torch.float16
    assert plans["classifier.1"].param_dtype == torch.float16  # inherited from the ruled block, as before
    assert not plans["features.0"].checkpoint and not plans["classifier.1"].compile


def test_a_block_inside_a_checkpointed_or_compiled_block_is_not_checkpointed_or_compiled_again():
    policy = policy_of({"match": "features", "checkpoint": "full", "compile": True},
                       {"match": "Conv2d", "checkpoint": "selective", "compile": True})
    plans = plan(SimpleCNN(), policy)
    assert (plans["features"].checkpoint, plans["features"].compile) == ("full", True)
    assert (plans["features.0"].checkpoint, plans["features.0"].compile) == (None, False)


def _saved_tensors(block, x):
    count = [0]

    def pack(tensor):
        count[0] += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        block(x).sum().backward()
    return count[0]


def test_full_checkpointing_saves_only_the_block_input_and_selective_saves_the_matmul_outputs():
    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))

    x = torch.randn(4, 8, requires_grad=True)
    counts, grads = {}, {}
    for mode in (None, "selective", "full"):
        block = mlp()
        if mode:
            apply_blocks(block, plan(block, policy_of({"match": "Sequential", "checkpoint": mode})))
        counts[mode] = _saved_tensors(block, x)
        grads[mode] = [p.grad.clone() for p in block.parameters()]
    assert counts["full"] < counts["selective"] < counts[None]
    for mode in ("selective", "full"):  # the same gradients: the recomputation is exact
        assert all(torch.equal(a, b) for a, b in zip(grads[mode], grads[None]))


# -- the loop ---------------------------------------------------------------------------------------------------

def test_checkpointed_and_compiled_blocks_train_as_the_plain_model_and_the_audit_says_what_was_applied(tmp_path):
    plain = trained(job(tmp_path, "plain", scaling={"num_workers": 1}), tmp_path / "plain")
    ruled_cfg = job(tmp_path, "ruled", scaling={"num_workers": 1}, perf={"compile_backend": "eager"},
                    precision={"rules": [{"match": "features", "checkpoint": "full"},
                                         {"match": "classifier", "compile": True}]})
    ruled = trained(ruled_cfg, tmp_path / "ruled")
    assert losses(ruled) == losses(plain) and losses(plain)  # recomputation and compilation change nothing
    audit = audit_of(ruled)
    assert (audit["features"]["checkpoint"], audit["features"]["promised_checkpoint"]) == ("full", "full")
    assert audit["classifier"]["compiled"] and audit["classifier"]["promised_compile"]
    assert audit["features.0"]["checkpoint"] is None and not audit["features.0"]["compiled"]
    assert audit_of(plain).get("features") is None  # a block no rule names and without parameters: not listed
    from orchestrator.tracking.tables import audit_summary

    blocks = audit_summary(list(audit.values()))["blocks"]  # the run's audit_summary table
    assert [(row["layer"], row["checkpoint"], row["compiled"]) for row in blocks] == [
        ("features", "full", "-"), ("classifier", "-", "yes")]


# -- bad input --------------------------------------------------------------------------------------------------

def test_a_checkpoint_mode_other_than_full_or_selective_is_bad_input_naming_the_key(tmp_path):
    with pytest.raises(BadInput, match=r"precision\.rules\[1\]\.checkpoint: unknown mode 'half'. Use one of full, "
                                       r"selective"):
        job(tmp_path, precision={"rules": [{"match": "features", "dtype": "float32"},
                                           {"match": "classifier", "checkpoint": "half"}]})


def test_a_rule_that_sets_nothing_is_bad_input(tmp_path):
    with pytest.raises(BadInput, match=r"precision\.rules\[0\]: the rule for 'features' sets none of dtype"):
        job(tmp_path, precision={"rules": [{"match": "features"}]})


@pytest.mark.parametrize("rule", [{"match": "blocks.*", "checkpoint": "full"}, {"match": "Attention", "compile": True}])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_checkpoint_or_compile_rule_matching_no_module_is_refused_in_preflight_naming_the_key(tmp_path, rule,
                                                                                                 strategy):
    cfg = job(tmp_path, scaling={"num_workers": 2, "strategy": strategy},
              precision={"rules": [{"match": "features", "dtype": "float32"}, rule]})
    with pytest.raises(BadInput, match=rf"precision\.rules\[1\]\.match: '{rule['match']}' \(.*\) matches no module "
                                       r"of SimpleCNN"):
        check_plan(cfg, SimpleCNN())


# -- on two ranks ----------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_checkpointed_and_compiled_blocks_train_to_the_same_weights_on_two_ranks(tmp_path, strategy):
    """FSDP2: checkpointing, compile, then `fully_shard` on the same blocks (units); DDP: then DDP."""
    from omegaconf import OmegaConf

    from orchestrator.train.local import spawn

    def run(name, **precision):
        cfg = job(tmp_path, name, scaling={"num_workers": 2, "strategy": strategy}, perf={"compile_backend": "eager"},
                  precision=precision)
        return spawn(OmegaConf.to_container(cfg, resolve=True), world_size=2, directory=tmp_path / name)

    plain = run("plain")
    ruled = run("ruled", rules=[{"match": "features", "checkpoint": "full"}, {"match": "classifier", "compile": True}])
    assert losses(ruled["reports"]) == losses(plain["reports"])
    for name, weight in plain["weights"].items():  # the plain model's names: nothing renamed by the wrapping
        assert torch.equal(ruled["weights"][name], weight), name
    audit = audit_of(ruled["reports"])
    assert (audit["features"]["checkpoint"], audit["classifier"]["compiled"]) == ("full", True)
    if strategy == "fsdp":
        assert (audit["features"]["unit"], audit["classifier"]["unit"]) == ("features", "classifier")


# -- float8 only where it pays ----------------------------------------------------------------------------------

def _float8_run(min_size, caplog):
    """A wide and a narrow Linear under a float8 rule, one forward and backward on the CPU's emulation: the audit."""
    pytest.importorskip("torchao.float8")
    from orchestrator.precision import Precision

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 64), nn.ReLU(), nn.Linear(64, 10))
    section = load_job_section([{"match": "Linear", "dtype": "float8"}], float8_min_size=min_size)
    precision = Precision(section, CPU)
    with caplog.at_level("WARNING", logger="ampflow.precision"):
        precision.prepare(model)
    with precision.forward():
        model(torch.randn(16, 64)).sum().backward()
    return {entry["name"]: entry for entry in precision.close_audit()}


def test_float8_skips_the_layers_below_torchaos_threshold_naming_each_and_why(caplog):
    audit = _float8_run("torchao", caplog)
    assert audit["0"]["float8"] and audit["0"]["float8_skipped"] is None  # K x N = 64 x 2048: N above 1024
    assert not audit["2"]["float8"] and not audit["2"]["promised_float8"]  # 2048 x 64: both within the threshold
    assert audit["2"]["float8_skipped"] == ("K x N = 2048 x 64 is within torchao's H100 threshold for tensorwise "
                                            "scaling (K <= 4096 and N <= 1024)")
    assert audit["4"]["float8_skipped"] == "K x N = 64 x 10: float8 matmuls need both dims multiples of 16"
    assert audit["2"]["rule"] is None and audit["2"]["output_dtype"] == "float32"  # as if the rule did not name it
    said = caplog.text
    assert "float8 skipped for layer '2' (rule Linear): K x N = 2048 x 64 is within" in said
    assert "float8 skipped for layer '4' (rule Linear): K x N = 64 x 10" in said and "layer '0'" not in said


@pytest.mark.parametrize("min_size", ["auto", "none"])
def test_on_the_cpu_emulation_float8_converts_every_layer_unless_the_job_asks(min_size, caplog):
    audit = _float8_run(min_size, caplog)
    assert all(audit[name]["float8"] and audit[name]["float8_skipped"] is None for name in ("0", "2", "4"))
    assert "float8 skipped" not in caplog.text


def test_an_unknown_float8_min_size_is_bad_input_naming_the_key(tmp_path):
    with pytest.raises(BadInput, match=r"precision\.float8_min_size: unknown value 'small'. Use one of auto, "
                                       r"torchao, none"):
        job(tmp_path, precision={"float8_min_size": "small"})


# -- the activation figure (bench.rule_checkpoint) --------------------------------------------------------------

@pytest.mark.slow
def test_under_fsdp_checkpoint_full_on_a_decoders_blocks_halves_its_activations_and_keeps_its_loss_curve():
    from bench.rule_checkpoint import LOSS_TOLERANCE, trained

    plain = trained([], layers=2, steps=3, world_size=2)
    full = trained([{"match": "blocks.*", "checkpoint": "full"}], layers=2, steps=3, world_size=2)
    assert full["checkpointed"] == ["blocks.0", "blocks.1"]  # the blocks, not what is inside them
    assert sum(full["activation_bytes"].values()) <= 0.5 * sum(plain["activation_bytes"].values())
    assert len(full["losses"]) == len(plain["losses"]) == 3
    assert full["losses"] == pytest.approx(plain["losses"], rel=LOSS_TOLERANCE)


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return nn.functional.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x))


def test_a_split_attention_names_the_rule_deciding_the_dtype_not_a_checkpoint_rule_with_the_same_glob(tmp_path):
    cfg = job(tmp_path, precision={"rules": [{"match": "q", "checkpoint": "full"}, {"match": "q", "dtype": "float16"}]})
    with pytest.raises(BadInput, match=r"precision\.rules\[1\] \{match: 'q', dtype: float16\} splits"):
        check_plan(cfg, _Attention(), Batch(args=(torch.randn(2, 4, 8),), targets=torch.zeros(2, dtype=torch.long)))
