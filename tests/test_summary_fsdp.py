"""`orchestrator.summary --strategy fsdp --world-size N`: what rank 0 will hold under FSDP, from the same plan the
training uses (the prediction itself is checked against two real ranks in test_fsdp.py and bench.fsdp_memory)."""

from orchestrator.cli.summary import main as summary_main
from orchestrator.cli.summary import summarize


def total(per_dtype: dict) -> int:
    return sum(per_dtype.values())


def test_fsdp_over_two_ranks_holds_half_of_what_each_ddp_rank_holds():
    ddp = summarize("resnet18", (3, 32, 32), preset="O0", optimizer="adam", activations=False)
    fsdp = summarize("resnet18", (3, 32, 32), preset="O0", optimizer="adam", activations=False, strategy="fsdp",
                     world_size=2)
    assert (fsdp["strategy"], fsdp["world_size"]) == ("fsdp", 2)
    for category in ("params", "grads", "optimizer"):  # resnet18's first dimensions are all even: no padding
        assert 2 * total(fsdp["bytes"][category]) == total(ddp["bytes"][category]), category
    assert fsdp["units"][-1]["name"] == "(model)"


def test_under_o2_the_fp32_shards_are_the_masters():
    ddp = summarize("resnet18", (3, 32, 32), preset="O2", optimizer="adam", activations=False)
    fsdp = summarize("resnet18", (3, 32, 32), preset="O2", optimizer="adam", activations=False, strategy="fsdp",
                     world_size=2)
    ddp_params = ddp["bytes"]["params"]
    assert set(ddp_params) == {"float16", "float32"} and ddp["bytes"]["master"]  # fp16 weights + fp32 masters
    assert set(fsdp["bytes"]["params"]) == {"float32"} and fsdp["bytes"]["master"] == {}
    # Every weight once, in fp32 (the fp16 ones as their masters), split over the two ranks.
    assert 2 * total(fsdp["bytes"]["params"]) == 2 * ddp_params["float16"] + ddp_params["float32"]
    # resnet18's 20 BatchNorms compute in fp32, each a unit: `bn1` as a direct child, the 19 inside the blocks by
    # keep_norm_fp32; every other unit computes in fp16.
    fp32_units = [u for u in fsdp["units"] if u["compute_dtype"] == "float32"]
    assert len(fp32_units) == 20
    assert sum(u["reason"] == "rule 'keep_norm_fp32' (float32)" for u in fp32_units) == 19
    assert fsdp["gathered_bytes"] > 0


def test_the_cli_prints_the_units_and_refuses_a_world_size_below_one(capsys):
    assert summary_main(["simple_cnn", "--strategy", "fsdp", "--world-size", "2", "--no-activations"]) == 0
    out = capsys.readouterr().out
    assert "FSDP over 2 ranks" in out and "unit (model)" in out and "unit features" in out
    assert summary_main(["simple_cnn", "--strategy", "fsdp", "--world-size", "0", "--no-activations"]) == 2
    assert "--world-size: must be >= 1, got 0." in capsys.readouterr().err
