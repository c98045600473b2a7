"""Tables a person reads in the MLflow UI: HTML artifacts (the UI renders them) made from a run's JSON tables.

`precision/audit_summary.html` (and `.json`) sums up `precision/audit.json`, one entry per layer, in four small
tables: layers by stored and computed dtype, layers by the rule that decided them, the layers that computed
in float32 while the rest of the model ran in a half dtype (kept by a rule, by autocast, or promoted after a loss
scale collapse), and what rules did besides dtypes (blocks checkpointed or compiled, float8 left out as too
small). `memory/breakdown.html` shows `memory/breakdown.json`.
"""

import html
from collections import Counter
from typing import Any, Sequence

HALF = ("float16", "bfloat16")


def audit_summary(entries: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """{"by_dtype": ..., "by_rule": ..., "fell_back": ..., "blocks": ...}: rows of the four tables."""
    by_dtype = Counter((e.get("param_dtype") or "-", e.get("output_dtype") or "-") for e in entries)
    rules: dict[str, Counter] = {}
    for entry in entries:
        rules.setdefault(entry.get("rule") or "(no rule)", Counter())[entry.get("type", "?")] += 1
    half = any(e.get("output_dtype") in HALF for e in entries)
    fell_back = [e for e in entries if half and e.get("output_dtype") == "float32"]
    return {
        "by_dtype": [{"stored in": stored, "computed in": computed, "layers": count}
                     for (stored, computed), count in sorted(by_dtype.items())],
        "by_rule": [{"rule": rule, "layers": sum(types.values()),
                     "types": ", ".join(f"{t} x{n}" if n > 1 else t for t, n in sorted(types.items()))}
                    for rule, types in sorted(rules.items())],
        "fell_back": [{"layer": e["name"], "type": e.get("type", "?"), "stored in": e.get("param_dtype") or "-",
                       "why": _why(e)} for e in fell_back],
        "blocks": [{"layer": e["name"], "type": e.get("type", "?"), "checkpoint": e.get("checkpoint") or "-",
                    "compiled": "yes" if e.get("compiled") else "-", "float8 skipped": e.get("float8_skipped") or "-"}
                   for e in entries if e.get("checkpoint") or e.get("compiled") or e.get("float8_skipped")],
    }


def _why(entry: dict[str, Any]) -> str:
    if entry.get("rule") == "promoted":
        return "promoted to float32 after a loss-scale collapse"
    if entry.get("rule"):
        return f"rule {entry['rule']}"
    return "autocast runs this op in float32" if entry.get("autocast") else "stored in float32"


CSS = ("body{font-family:sans-serif;font-size:14px;margin:16px;color:#1f272d}h1{font-size:18px}"
       "h2{font-size:15px;margin-top:20px}table{border-collapse:collapse;margin:6px 0}"
       "th,td{border:1px solid #d1d9e1;padding:4px 10px;text-align:left}th{background:#f3f5f7}"
       "td.n{text-align:right}p.note{color:#5f7281}")


def table_html(rows: Sequence[dict[str, Any]], empty: str = "none") -> str:
    if not rows:
        return f"<p class='note'>{html.escape(empty)}</p>"
    columns = list(rows[0])
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in columns)
    body = "".join("<tr>" + "".join(
        f"<td class='n'>{value}</td>" if isinstance(value, (int, float)) else f"<td>{html.escape(str(value))}</td>"
        for value in (row.get(c, "") for c in columns)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def page(title: str, sections: Sequence[tuple[str, str]]) -> str:
    """A small HTML page: a title, then (heading, HTML) sections."""
    parts = "".join(f"<h2>{html.escape(heading)}</h2>{content}" for heading, content in sections)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>{parts}</body></html>")


def audit_summary_html(entries: Sequence[dict[str, Any]]) -> str:
    summary = audit_summary(entries)
    return page(f"Precision audit: {len(entries)} layers", [
        ("Layers by dtype", table_html(summary["by_dtype"])),
        ("Layers by rule", table_html(summary["by_rule"])),
        ("Layers in float32 among half-precision ones", table_html(
            summary["fell_back"], "none: every layer computed in the model's dtype")),
        ("Blocks checkpointed or compiled, float8 left out", table_html(
            summary["blocks"], "none: the rules chose dtypes only")),
    ])


def memory_html(rows: Sequence[dict[str, Any]]) -> str:
    total = sum(row.get("bytes", 0) for row in rows)
    return page(f"Memory by category and dtype: {total / 2**20:.2f} MiB", [("Measured on the first step",
                                                                             table_html(rows))])


RENDERED = {"precision/audit": ("precision/audit_summary", audit_summary_html, audit_summary),
            "memory/breakdown": ("memory/breakdown", memory_html, None)}
"""JSON table -> (artifact path without suffix, its HTML page, its JSON summary or None)."""
