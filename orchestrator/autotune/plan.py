"""From the probe to a policy: the sensitivity table's rows, the `precision` section a choice becomes, what it is
predicted to save, and the table and chart the tune logs."""

import glob
import math
from typing import Any, Optional

import torch

from orchestrator.precision.dtypes import dtype_name
from orchestrator.precision.float8 import FLOAT8, import_error, native, unavailable
from orchestrator.precision.policy import LayerPlan, Policy
from orchestrator.autotune.devices import BYTES, TARGETS, modelled_time
from orchestrator.autotune.probe import Probe
from orchestrator.autotune.search import FP32, Option, by_layer, cost, predicted_error

HALF = ("float16", "bfloat16")
"""The dtypes a layer stores its parameters in when lowered (float8 layers keep theirs in fp32)."""


def options(probe: Probe, candidates: list[str], target: Optional[str], emulate_float8: bool = False) -> list[Option]:
    """Every candidate layer in fp32 and in each candidate dtype: errors from the probe, costs measured on the
    device at hand (`target` None) or modelled for `target`. A dtype refused before measuring (float8 off a Linear
    layer, without torchao, without float8 matmuls; not native on the target) has no errors and no cost."""
    device = TARGETS[target] if target is not None else None
    rows = []
    for name, layer in probe.layers.items():
        timed = (lambda dtype: modelled_time(layer.work, dtype, device)) if device is not None else \
            (lambda dtype: probe.measured_time(name, dtype))
        rows.append(Option(name, FP32, 0.0, 0.0, timed(FP32)))
        for dtype in candidates:
            refused = _refused_before_measuring(layer, dtype, target, probe, emulate_float8)
            if refused is not None:
                rows.append(Option(name, dtype, math.nan, math.nan, math.inf, refused))
                continue
            try:
                output_error, grad_error = probe.sensitivity(name, dtype)
                cost = timed(dtype)
            except Exception as exc:  # the model does not run with this layer lowered: a candidate skipped, not the tune
                rows.append(Option(name, dtype, math.nan, math.nan, math.inf, f"fails in {dtype}: {failure(exc)}"))
                continue
            if dtype == "float16":
                refused = layer.headroom.refusal
            if refused is None and not (math.isfinite(output_error) and math.isfinite(grad_error)):
                refused = f"not finite in {dtype}"
            rows.append(Option(name, dtype, output_error, grad_error, cost, refused))
    return rows


def failure(exc: BaseException) -> str:
    """An exception in one line: its type and the first line of its message, cut at 200 characters."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def _refused_before_measuring(layer, dtype: str, target: Optional[str], probe: Probe,
                              emulate_float8: bool) -> Optional[str]:
    if target is not None and not TARGETS[target].supports(dtype):
        return f"{dtype} is not native on {target}"
    if dtype != FLOAT8:
        return None
    if layer.type != "Linear":
        return "float8 applies to Linear layers"
    reason = float8_missing(probe.device, emulate_float8)
    if reason is not None:
        return reason
    if not native(probe.device) and not emulate_float8:
        return (f"this {probe.device.type} has no float8 matmuls; tune.emulate_float8=true measures float8's errors "
                "emulated")
    return None


def float8_missing(device: torch.device, emulate_float8: bool) -> Optional[str]:
    """Why float8 can be tried on no layer here: torchao not installed, or, where float8 would be probed (a device
    with float8 matmuls, or `tune.emulate_float8`), installed but failing to import; None when nothing is missing."""
    reason = unavailable()
    if reason is None and (emulate_float8 or native(device)):
        reason = import_error()
    return reason


def tuned_rules(assignment: dict[str, str], policy: Policy, plans: dict[str, LayerPlan]) -> list[dict[str, str]]:
    """A rule naming each tuned layer (`assignment`: layer -> dtype) exactly, where the job's own policy would not
    already store and compute it in the chosen dtype: under autocast every tuned layer has one (a rule's region is
    what stores it in its dtype), without autocast those whose chosen dtype is not the one they inherit."""
    return [{"match": glob.escape(layer), "dtype": dtype} for layer, dtype in assignment.items()
            if policy.autocast or dtype == FLOAT8 or dtype_name(plans[layer].param_dtype) != dtype]


def precision_section(assignment: dict[str, str], base: dict[str, Any], policy: Policy,
                      plans: dict[str, LayerPlan]) -> dict[str, Any]:
    """The job's `precision` section for `assignment`: the job's own (`base`, its preset and settings) with its own
    rules first, as they were, then the tuner's (`tuned_rules`); fp32 master weights for the optimizer and a dynamic
    loss scale where the tuner's rules store layers in half precision and the job's section had neither."""
    rules = tuned_rules(assignment, policy, plans)
    section = {**base, "rules": [*base.get("rules", []), *rules]}
    if any(rule["dtype"] in HALF for rule in rules):
        section["master_weights"] = True
    if any(rule["dtype"] == "float16" for rule in rules) and base.get("loss_scale") == "none":
        section["loss_scale"] = "dynamic"
    return section


def predictions(assignment: dict[str, str], rows: list[Option], probe: Probe) -> dict[str, float]:
    """What the choice is predicted to do, over the tuned layers: the speed-up of their forward and backward, the
    ratio of their activation bytes and of their parameter bytes (fp32 masters included) to fp32's, and the
    predicted errors."""
    table = by_layer(rows)
    fp32 = {layer: FP32 for layer in assignment}
    output_error, grad_error = predicted_error(assignment, table)
    chosen_cost = cost(assignment, table)
    # float8 layers keep fp32 weights (no masters) and hand their neighbours fp32 activations
    activations = sum(probe.layers[l].work.activations * (BYTES[d] if d in HALF else 4) for l, d in assignment.items())
    activations_fp32 = sum(probe.layers[l].work.activations * 4 for l in assignment)
    params = sum(probe.layers[l].work.params * (BYTES[d] + 4 if d in HALF else 4) for l, d in assignment.items())
    params_fp32 = sum(probe.layers[l].work.params * 4 for l in assignment)
    return {"predicted_speedup": cost(fp32, table) / chosen_cost if chosen_cost > 0 else 1.0,
            "predicted_activation_bytes_ratio": activations / activations_fp32 if activations_fp32 else 1.0,
            "predicted_param_bytes_ratio": params / params_fp32 if params_fp32 else 1.0,
            "predicted_output_error": output_error, "predicted_grad_error": grad_error,
            "lowered_layers": float(sum(d != FP32 for d in assignment.values()))}


def sensitivity_table(rows: list[Option], probe: Probe, assignment: dict[str, str]) -> list[dict[str, Any]]:
    """The table as the tune's artifact: one row per layer and dtype, with the layer's headroom and work."""
    table = []
    for row in rows:
        layer = probe.layers[row.layer]
        table.append({"layer": row.layer, "type": layer.type, "dtype": row.dtype,
                      "output_error": row.output_error, "grad_error": row.grad_error, "cost_s": row.cost,
                      "allowed": row.allowed, "refused": row.refused, "chosen": assignment[row.layer] == row.dtype,
                      "flops": layer.work.flops, "params": layer.work.params,
                      "max_abs_activation": layer.headroom.max_abs_activation,
                      "activation_underflow": layer.headroom.activation_underflow,
                      "max_abs_grad": layer.headroom.max_abs_grad, "grad_underflow": layer.headroom.grad_underflow})
    return table


def measured(value: Any) -> bool:
    """A number the tune measured (a dtype refused before measuring has None in the JSON, NaN or inf here)."""
    return isinstance(value, (int, float)) and math.isfinite(value)


CHART_PANELS = (("output_error", "output error"), ("grad_error", "gradient error"), ("cost_s", "time vs fp32"))
"""The chart's panels, top to bottom: the table's column and the axis's label."""


def chart(table: list[dict[str, Any]], tolerance: Optional[float] = None):
    """Each layer in each dtype: its output error, its gradient error (log axes, `tolerance` dashed) and its time
    relative to the layer's fp32 time (linear), one bar per dtype measured; a dtype never measured (refused before, e.g.
    float8 off a Linear layer) draws no bar. The chosen dtype outlined in black, refused ones hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    layers = list(dict.fromkeys(row["layer"] for row in table))
    dtypes = list(dict.fromkeys(row["dtype"] for row in table))
    cells = {(row["layer"], row["dtype"]): row for row in table}
    figure, axes = plt.subplots(len(CHART_PANELS), 1, sharex=True,
                                figsize=(max(7.0, 0.6 * len(layers) * len(dtypes) / 2 + 3), 8))
    width = 0.8 / max(len(dtypes), 1)
    colours = {dtype: f"C{index}" for index, dtype in enumerate(dtypes)}
    for axis, (column, label) in zip(axes, CHART_PANELS):
        shown = [d for d in dtypes if d != FP32] if column != "cost_s" else dtypes  # fp32's errors are 0
        for dtype in shown:
            offset = dtypes.index(dtype) * width
            xs, heights, rows = [], [], []
            for i, layer in enumerate(layers):
                row = cells.get((layer, dtype))
                value = row.get(column) if row is not None else None
                if column == "cost_s":
                    base = (cells.get((layer, FP32)) or {}).get("cost_s")
                    value = value / base if measured(value) and measured(base) and base > 0 else None
                if not measured(value):
                    continue  # never measured: no bar
                xs.append(i + offset)
                heights.append(max(value, 1e-9))
                rows.append(row)
            if not xs:
                continue
            bars = axis.bar(xs, heights, width, color=colours[dtype])
            for bar, row in zip(bars, rows):
                bar.set_gid(f"{row['layer']}|{dtype}|{column}")
                if not row["allowed"]:
                    bar.set_hatch("//")
                if row["chosen"]:
                    bar.set_edgecolor("black")
                    bar.set_linewidth(2)
        axis.set_ylabel(label)
        if column == "cost_s":  # a ratio to fp32's time: linear, from 0
            axis.axhline(1.0, color="grey", linewidth=0.8)
            axis.set_ylim(bottom=0)
            continue
        axis.set_yscale("log")
        if tolerance is not None:
            axis.axhline(tolerance, color="red", linestyle="--", linewidth=1)
    axes[-1].set_xticks([i + (len(dtypes) - 1) * width / 2 for i in range(len(layers))], layers, rotation=60,
                        ha="right", fontsize=8)
    figure.suptitle("Per-layer sensitivity, each layer alone lowered (outlined: chosen; hatched: refused; "
                    "no bar: not measured)", fontsize=10)
    handles = [Patch(color=colours[dtype], label=dtype) for dtype in dtypes]
    if tolerance is not None:
        handles.append(Line2D([], [], color="red", linestyle="--", label=f"tune.tolerance {tolerance:g}"))
    figure.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.965), ncol=len(handles), fontsize=8,
                  frameon=False)
    figure.tight_layout(rect=(0, 0, 1, 0.93))
    return figure
