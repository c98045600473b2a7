"""Memory by dtype, measured: the summary CLI answers the "still 35 MB after fp16" question."""

import json

import pytest
import torch

from orchestrator.precision.ledger import bytes_by_dtype
from orchestrator.cli.summary import main as summary_main
from orchestrator.cli.summary import summarize

TOY_PARAMS = 9_223_901  # three_conv: Conv2d 3->300->500->1000 (k3), Linear 3,364,000 -> 1


def summary_json(capsys, *argv) -> dict:
    assert summary_main(list(argv) + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_toy_model_summary_json_under_o0_counts_real_bytes(capsys):
    summary = summary_json(capsys, "three_conv", "--input", "3,64,64", "--optimizer", "adam")
    assert summary["total_params"] == TOY_PARAMS
    bytes_ = summary["bytes"]
    assert bytes_["params"] == {"float32": 36_895_604}
    assert bytes_["grads"] == {"float32": 36_895_604}
    assert bytes_["optimizer"] == {"float32": 2 * 36_895_604}  # Adam's two moments
    assert bytes_["master"] == {}
    assert sum(bytes_["activations"].values()) > 0
    fc = next(layer for layer in summary["layers"] if layer["name"] == "fc")
    assert fc == {"name": "fc", "type": "Linear", "output_shape": [1, 1], "params": 3_364_001,
                  "param_dtype": "float32", "bytes": 3_364_001 * 4}


def test_toy_model_is_half_the_size_under_o3_and_the_table_says_so(capsys):
    # --no-activations: fp16 convolutions on this CPU take over a minute; the state is still real.
    summary = summary_json(capsys, "three_conv", "--input", "3,64,64", "--precision", "O3", "--optimizer", "adam",
                           "--no-activations")
    assert summary["bytes"]["params"] == {"float16": 18_447_802}
    assert summary["bytes"]["optimizer"] == {"float16": 2 * 18_447_802}  # no masters: Adam state is fp16 too
    assert summary_main(["three_conv", "--input", "3,64,64", "--precision", "O3", "--no-activations"]) == 0
    table = capsys.readouterr().out
    assert "Params size (MB): 17.59" in table and "not measured (--no-activations)" in table
    assert summary_main(["three_conv", "--input", "3,64,64", "--no-activations"]) == 0
    assert "Params size (MB): 35.19" in capsys.readouterr().out


def test_o2_keeps_fp32_masters_and_their_gradients():
    summary = summarize("simple_cnn", (3, 32, 32), preset="O2", optimizer="adam", batch_size=2)
    params = 268_650
    assert summary["bytes"]["params"] == {"float16": params * 2}
    assert summary["bytes"]["master"] == {"float32": 2 * params * 4}  # fp32 copies + their fp32 gradients
    assert summary["bytes"]["optimizer"] == {"float32": 2 * params * 4}  # Adam steps on the masters


def test_activations_under_bf16_autocast_are_smaller_than_fp32():
    fp32 = summarize("simple_cnn", (3, 32, 32), preset="O0", batch_size=8)["bytes"]["activations"]
    bf16 = summarize("simple_cnn", (3, 32, 32), preset="bf16-mixed", batch_size=8)["bytes"]["activations"]
    assert "bfloat16" in bf16
    assert sum(bf16.values()) < sum(fp32.values())


def test_shared_storage_is_counted_once():
    base = torch.zeros(10, 10)
    assert bytes_by_dtype([base, base.view(100), base[2:], None, torch.zeros(3, dtype=torch.float16)]) == {
        "float32": 400, "float16": 6}


@pytest.mark.parametrize("argv, fragment", [(["nope_model"], "unknown model 'nope_model'"),
                                            (["simple_cnn", "--input", "3x32"], "--input"),
                                            (["simple_cnn", "--precision", "O9"], "unknown preset 'O9'")])
def test_bad_arguments_exit_2_with_a_message(capsys, argv, fragment):
    assert summary_main(argv) == 2
    assert fragment in capsys.readouterr().err
