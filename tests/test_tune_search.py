"""The tuner's choice, as plain functions over a sensitivity table: the cheapest assignment within the tolerance,
never a refused dtype, and one layer up at a time when a validation fails. No model here."""

import math

import pytest

from orchestrator.autotune.devices import TARGETS, Work, modelled_time
from orchestrator.autotune.search import FP32, Option, by_layer, choose, one_up, predicted_error, riskiest


def rows(*layers):
    """(layer, fp32 cost, {dtype: (error, cost, refused)}) -> Options (output and gradient errors alike)."""
    out = []
    for layer, fp32_cost, lowered in layers:
        out.append(Option(layer, FP32, 0.0, 0.0, fp32_cost))
        for dtype, (error, cost, refused) in lowered.items():
            out.append(Option(layer, dtype, error, error, cost, refused))
    return out


def test_every_layer_is_lowered_to_its_cheapest_dtype_when_the_errors_fit():
    table = rows(("a", 10, {"float16": (0.001, 4, None), "bfloat16": (0.008, 4, None)}),
                 ("b", 10, {"float16": (0.001, 5, None), "bfloat16": (0.008, 3, None)}))
    assert choose(table, tolerance=0.05) == {"a": "float16", "b": "bfloat16"}


def test_the_predicted_error_stays_within_the_tolerance_and_the_biggest_saving_per_error_goes_first():
    # Each lowering alone fits; together they do not (root sum of squares 0.042 > 0.04). `big` saves 9 for 0.03,
    # `small` saves 1 for 0.03: `big` is lowered.
    table = rows(("big", 10, {"bfloat16": (0.03, 1, None)}), ("small", 2, {"bfloat16": (0.03, 1, None)}))
    assignment = choose(table, tolerance=0.04)
    assert assignment == {"big": "bfloat16", "small": FP32}
    assert max(predicted_error(assignment, by_layer(table))) <= 0.04


def test_a_refused_or_non_finite_dtype_is_never_chosen_however_cheap():
    table = rows(("hot", 10, {"float16": (0.0001, 1, "no fp16 headroom: activations reach 1e+05"),
                              "bfloat16": (0.004, 5, None)}),
                 ("nan", 10, {"float16": (math.inf, 1, None)}))
    assert choose(table, tolerance=0.05) == {"hot": "bfloat16", "nan": FP32}


def test_a_lowering_that_costs_more_than_fp32_is_not_taken():
    table = rows(("a", 1, {"bfloat16": (0.0, 10, None)}))  # a CPU without native bf16
    assert choose(table, tolerance=0.05) == {"a": FP32}


def test_a_pinned_layer_keeps_its_dtype_and_the_rest_is_chosen_around_it():
    table = rows(("a", 10, {"float16": (0.01, 2, None), "bfloat16": (0.02, 2, None)}),
                 ("b", 10, {"bfloat16": (0.02, 2, None)}))
    assert choose(table, tolerance=0.05, pinned={"a": FP32}) == {"a": FP32, "b": "bfloat16"}


def test_the_riskiest_lowered_layer_goes_up_one_dtype_then_to_fp32():
    table = by_layer(rows(("a", 10, {"float8": (0.05, 1, None), "bfloat16": (0.01, 3, None),
                                     "float16": (0.002, 3, "no fp16 headroom")}),
                          ("b", 10, {"bfloat16": (0.02, 2, None)})))
    assignment = {"a": "float8", "b": "bfloat16"}
    assert riskiest(assignment, table) == "a"
    assert one_up("a", "float8", table) == "bfloat16"  # fp16 is safer still, but refused
    assert one_up("a", "bfloat16", table) == FP32
    assert riskiest(assignment, table, exclude=["a"]) == "b"
    assert riskiest({"a": FP32, "b": FP32}, table) is None


@pytest.mark.parametrize("work", [Work(flops=2e9, params=1_000_000, activations=500_000, matmul=True),
                                  Work(flops=1e6, params=1000, activations=500_000, matmul=False)])
def test_on_a_cpu_target_fp32_is_cheapest_and_on_an_h100_half_precision_is(work):
    cpu, h100 = TARGETS["cpu"], TARGETS["h100"]
    assert all(modelled_time(work, d, cpu) > modelled_time(work, FP32, cpu) for d in ("float16", "bfloat16"))
    if work.matmul:
        assert all(modelled_time(work, d, h100) < modelled_time(work, FP32, h100) for d in ("float16", "bfloat16"))
