"""The sweep's comparison: one row per child run, read back from MLflow; a table, a chart, a verdict.

A row is what a user compares presets (or any grid's points) by: throughput, peak memory, final
accuracy, skipped steps and wall time, and the same against the first row (the baseline the user
listed first, usually O0). Every number comes from what the child run logged, never from the
driver's own bookkeeping. A grid's rows add `point` (the label) and a column per swept key.
"""

import math
from typing import Any, Optional, Sequence

from orchestrator.tracking.plots import _pyplot

ROW_KEYS = ("preset", "run_id", "status", "samples_per_s", "peak_memory_bytes", "final_accuracy",
            "skipped_steps", "wall_time_s", "speedup", "memory_ratio", "accuracy_delta")
"""The keys of each row of `sweep/comparison.json`, in this order (then, in a grid's, `point` and the swept
keys but the preset)."""

METRICS = ("perf/samples_per_s", "memory/peak_bytes", "eval/accuracy", "amp/skipped_steps")
"""The child-run metrics a row is computed from."""


def _values(history: Sequence[Any]) -> list[float]:
    """A metric's values in step order (MLflow returns its history in no promised order)."""
    return [m.value for m in sorted(history, key=lambda m: (m.step, m.timestamp))]


def summarize(histories: dict[str, Sequence[Any]]) -> dict[str, Optional[float]]:
    """The row's measurements from metric histories (MLflow `Metric`s: key -> history); None where not logged.

    samples/s is the mean over the run's reports, leaving out the first when there are several: it
    includes the warm-up (first-step compilation, allocator growth, DDP bucket building).
    """
    samples = _values(histories.get("perf/samples_per_s", []))
    if len(samples) > 1:
        samples = samples[1:]
    peaks = _values(histories.get("memory/peak_bytes", []))
    accuracy = _values(histories.get("eval/accuracy", []))
    skipped = _values(histories.get("amp/skipped_steps", []))
    return {
        "samples_per_s": sum(samples) / len(samples) if samples else None,
        "peak_memory_bytes": max(peaks) if peaks else None,
        "final_accuracy": accuracy[-1] if accuracy else None,
        "skipped_steps": skipped[-1] if skipped else None,
    }


def child_row(tracker, preset: str, exit_code: int) -> dict[str, Any]:
    """A preset's row from its child run (`tracker`: the child's RunTracker, None when MLflow never created
    it). Status FAILED when the child's exit code was not 0, whatever the run says (e.g. a refused export
    leaves the run FINISHED)."""
    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    row.update(preset=preset, run_id=tracker.run_id if tracker is not None else None,
               status="FINISHED" if exit_code == 0 else "FAILED")
    if tracker is None:  # MLflow never created the run (tracking.required: false and an outage)
        return row
    info = tracker.run_info()
    row.update(summarize({key: tracker.metric_history(key) for key in METRICS}))
    if exit_code == 0:
        row["status"] = info.status
    if info.end_time and info.start_time:
        row["wall_time_s"] = (info.end_time - info.start_time) / 1000
    return row


def label_of(row: dict[str, Any]) -> str:
    """What names a row: its grid point's label, or its preset in a sweep of presets."""
    return row.get("point") or row["preset"]


def extra_columns(row: dict[str, Any]) -> list[str]:
    """A grid row's swept keys (those after `point`), shown after the label."""
    keys = list(row)
    return keys[keys.index("point") + 1:] if "point" in keys else []


def _ratio(value: Optional[float], base: Optional[float]) -> Optional[float]:
    return value / base if value is not None and base else None


def add_baseline_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """speedup and memory_ratio (this / first) and accuracy_delta (this - first), vs the first row."""
    base = rows[0]
    for row in rows:
        row["speedup"] = _ratio(row["samples_per_s"], base["samples_per_s"])
        row["memory_ratio"] = _ratio(row["peak_memory_bytes"], base["peak_memory_bytes"])
        both = row["final_accuracy"] is not None and base["final_accuracy"] is not None
        row["accuracy_delta"] = row["final_accuracy"] - base["final_accuracy"] if both else None
    return rows


def _fmt(value: Optional[float], spec: str, unit: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec) + unit


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The comparison as a Markdown table (ratios and delta against the first row); a grid's has its label and a
    column per swept key first."""
    base, swept = label_of(rows[0]), extra_columns(rows[0])
    grid = ["point", *swept] if "point" in rows[0] else []
    header = [*grid, "preset", "status", "samples/s", f"speedup vs {base}", "peak memory (MiB)", f"memory vs {base}",
              "final accuracy", f"accuracy delta vs {base}", "skipped steps", "wall time (s)", "run id"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        peak = row["peak_memory_bytes"] / 2**20 if row["peak_memory_bytes"] is not None else None
        cells = [*(str(row[key]) for key in grid), row["preset"], row["status"], _fmt(row["samples_per_s"], ".1f"), _fmt(row["speedup"], ".2f", "x"),
                 _fmt(peak, ".1f"), _fmt(row["memory_ratio"], ".2f", "x"), _fmt(row["final_accuracy"], ".4f"),
                 _fmt(row["accuracy_delta"], "+.4f"), _fmt(row["skipped_steps"], ".0f"),
                 _fmt(row["wall_time_s"], ".1f"), row["run_id"] or "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def verdict(rows: list[dict[str, Any]], max_accuracy_drop: float) -> str:
    """One line answering "which is fastest and smallest, and does it cost accuracy?"."""
    done = [row for row in rows if row["status"] == "FINISHED"]

    def best(key: str, pick) -> str:
        measured = [row for row in done if row[key] is not None]
        return label_of(pick(measured, key=lambda row: row[key])) if measured else "-"

    base = rows[0]
    if base["final_accuracy"] is None:
        losing = f"accuracy not compared ({label_of(base)} has no final accuracy)"
    else:
        lost = [label_of(row) for row in done[1:] if row["accuracy_delta"] is not None
                and row["accuracy_delta"] < -max_accuracy_drop]
        losing = (f"losing more than {max_accuracy_drop:g} accuracy vs {label_of(base)}: "
                  f"{', '.join(lost) if lost else 'none'}")
    failed = [label_of(row) for row in rows if row["status"] != "FINISHED"]
    return (f"Fastest: {best('samples_per_s', max)}; smallest peak memory: {best('peak_memory_bytes', min)}; "
            f"most accurate: {best('final_accuracy', max)}; {losing}"
            + (f"; not finished: {', '.join(failed)}" if failed else "") + ".")


def comparison_figure(rows: list[dict[str, Any]]):
    """Bars of samples/s and of peak memory per preset, final accuracy written above the throughput bars."""
    plt = _pyplot()
    presets = [label_of(row) for row in rows]
    figure, (speed, memory) = plt.subplots(1, 2, figsize=(10, 4))
    bars = speed.bar(presets, [row["samples_per_s"] or 0.0 for row in rows], color="tab:blue")
    for bar, row in zip(bars, rows):
        label = "FAILED" if row["status"] != "FINISHED" else f"acc {_fmt(row['final_accuracy'], '.3f')}"
        speed.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                       fontsize=8, xytext=(0, 2), textcoords="offset points")
    speed.set_ylabel("samples/s (higher is faster)")
    speed.set_title("Throughput (final accuracy above)")
    speed.margins(y=0.15)
    memory.bar(presets, [(row["peak_memory_bytes"] or 0.0) / 2**20 for row in rows], color="tab:orange")
    memory.set_ylabel("peak memory, MiB (lower is smaller)")
    memory.set_title("Peak memory")
    for axis in (speed, memory):
        axis.tick_params(axis="x", labelrotation=20)
    figure.tight_layout()
    return figure
