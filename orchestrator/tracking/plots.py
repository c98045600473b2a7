"""PNG plots logged to the run at its end: the loss scale over steps, and memory by category and dtype."""

import json
from typing import Callable, Optional

from orchestrator.precision.ledger import CATEGORIES


def _pyplot():
    # matplotlib: about a second to import, for the plots at a run's end only (pyplot after the backend is chosen)
    import matplotlib

    matplotlib.use("Agg")  # no display on workers, CI or clusters
    import matplotlib.pyplot as plt

    return plt


def loss_scale_figure(scale: list[tuple[int, float]], skipped: list[tuple[int, float]]):
    """Loss scale (log axis) and cumulative skipped steps, both against the global step."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(8, 4))
    if scale:
        axis.step([s for s, _ in scale], [v for _, v in scale], where="post", color="tab:blue", label="loss scale")
        axis.set_yscale("log", base=2)
    axis.set_xlabel("step")
    axis.set_ylabel("amp/loss_scale", color="tab:blue")
    skipped_axis = axis.twinx()
    if skipped:
        skipped_axis.step([s for s, _ in skipped], [v for _, v in skipped], where="post", color="tab:red",
                          label="skipped steps (cumulative)")
    skipped_axis.set_ylabel("amp/skipped_steps", color="tab:red")
    axis.set_title("Loss scale and skipped steps")
    figure.tight_layout()
    return figure


def memory_figure(bytes_by_category: dict[str, dict[str, float]], policy: str):
    """One stacked bar per category, stacked by dtype, in MiB."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(8, 4))
    categories = [c for c in CATEGORIES if bytes_by_category.get(c)]
    dtypes = sorted({d for c in categories for d in bytes_by_category[c]})
    bottoms = [0.0] * len(categories)
    for dtype in dtypes:
        heights = [bytes_by_category[c].get(dtype, 0.0) / 2**20 for c in categories]
        axis.bar(categories, heights, bottom=bottoms, label=dtype)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    axis.set_ylabel("MiB")
    axis.set_title(f"Memory by category and dtype ({policy})")
    axis.legend()
    figure.tight_layout()
    return figure


def log_run_plots(client, run_id: str, policy: Optional[str], log_figure: Callable) -> list[str]:
    """Draw both plots from what the run logged, each written by `log_figure(client, run_id, figure, path)` (the
    tracker's, which redacts); returns the artifact paths written."""
    plt = _pyplot()
    written = []
    history = {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
               for key in ("amp/loss_scale", "amp/skipped_steps")}
    if history["amp/loss_scale"]:
        figure = loss_scale_figure(sorted(history["amp/loss_scale"]), sorted(history["amp/skipped_steps"]))
        log_figure(client, run_id, figure, "plots/loss_scale.png")
        plt.close(figure)
        written.append("plots/loss_scale.png")
    memory: dict[str, dict[str, float]] = {}
    if any(a.path == "memory/breakdown.json" for a in client.list_artifacts(run_id, "memory")):
        with open(client.download_artifacts(run_id, "memory/breakdown.json")) as table:
            for row in json.load(table):  # the newest table: the policy as it ended (after any promotion)
                memory.setdefault(row["category"], {})[row["dtype"]] = row["bytes"]
    if memory:
        figure = memory_figure(memory, policy or "custom policy")
        log_figure(client, run_id, figure, "plots/memory.png")
        plt.close(figure)
        written.append("plots/memory.png")
    return written
