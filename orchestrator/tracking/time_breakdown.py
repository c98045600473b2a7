"""The run's goodput in MLflow: `goodput/*` metrics, `perf/time_breakdown.json` and `perf/time_breakdown.png` (one
stacked bar per attempt), logged by the driver once the run is over (`orchestrator.tracking.goodput`)."""

import logging
import sys
import time
from typing import Optional

from orchestrator.tracking.goodput import CAUSES, WORDS, Breakdown, RunClock
from orchestrator.tracking.plots import _pyplot

logger = logging.getLogger("ampflow.tracking")

JSON_PATH = "perf/time_breakdown.json"
PNG_PATH = "perf/time_breakdown.png"

STACKED = ("startup", "restarts", "training", "redone", "data", "eval", "checkpoint", "other", "end")
"""Each bar's parts from the bottom up, roughly in the order they happen."""

COLOURS = {"training": "tab:green", "startup": "tab:gray", "restarts": "tab:red", "redone": "tab:pink",
           "checkpoint": "tab:purple", "eval": "tab:blue", "data": "tab:orange", "other": "tab:olive",
           "end": "tab:brown"}


def breakdown_figure(breakdown: Breakdown):
    """One bar per attempt that trained, stacked by part (seconds), labelled with its steps and how it ended."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(8, 4))
    attempts = breakdown.attempts
    labels = [f"attempt {row['attempt']}\nsteps {(row['resumed_from_step'] or 0) + 1}-{row['last_step']}"
              + (f"\nended by {CAUSES.get(row['ended_by'], row['ended_by'])}" if row["ended_by"] else "")
              for row in attempts]
    bottoms = [0.0] * len(attempts)
    for part in STACKED:
        heights = [row["parts_s"][part] for row in attempts]
        if any(height > 0 for height in heights):
            axis.bar(labels, heights, bottom=bottoms, label=WORDS[part], color=COLOURS[part])
            bottoms = [bottom + height for bottom, height in zip(bottoms, heights)]
    axis.set_ylabel("seconds")
    axis.set_title(f"Goodput {100 * breakdown.fraction:.0f}% of {breakdown.wall_s:.0f} s: the time of each attempt")
    axis.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    return figure


def log_goodput(tracker, clock: Optional[RunClock], step: int, end_at: Optional[float] = None) -> Optional[Breakdown]:
    """Log the run's goodput at `step` (its last); returns the breakdown, or None when there is no clock or MLflow
    refused it (a warning: the run stands either way)."""
    if tracker is None or clock is None:
        return None
    breakdown = clock.breakdown(time.time() if end_at is None else end_at)
    try:
        tracker.log_metrics(breakdown.metrics(), step)
        tracker.log_dict(breakdown.to_json(), JSON_PATH)
        if breakdown.attempts:
            figure = breakdown_figure(breakdown)
            try:
                tracker.log_figure(figure, PNG_PATH)
            finally:
                _pyplot().close(figure)
    except Exception as exc:  # noqa: BLE001 - the goodput is told on the console still
        print(f"warning: the run's goodput could not be logged to MLflow ({type(exc).__name__}: {exc})",
              file=sys.stderr)
    return breakdown
