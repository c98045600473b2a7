"""Early stopping (`run.early_stopping`): stop when an evaluation metric has not improved for `patience`
evaluations in a row. Evaluation metrics are reduced over all ranks, so every rank decides the same."""

from typing import Any, Optional


class EarlyStopping:
    def __init__(self, section, state: Optional[dict[str, Any]] = None):
        """`section`: the `run.early_stopping` config; `state`: where a checkpoint left it (`state()`)."""
        self.metric, self.mode = section.metric, section.mode
        self.patience, self.min_delta = section.patience, section.min_delta
        self.best: Optional[float] = (state or {}).get("best")
        self.evaluations_without_improvement: int = (state or {}).get("evaluations_without_improvement", 0)

    def should_stop(self, metrics: dict[str, float]) -> bool:
        """Take an evaluation's metrics; True once the metric has not improved for `patience` evaluations."""
        value = float(metrics[self.metric])
        if self.best is None or (value < self.best - self.min_delta if self.mode == "min"
                                 else value > self.best + self.min_delta):
            self.best, self.evaluations_without_improvement = value, 0
        else:
            self.evaluations_without_improvement += 1
        return self.evaluations_without_improvement >= self.patience

    def state(self) -> dict[str, Any]:
        return {"best": self.best, "evaluations_without_improvement": self.evaluations_without_improvement}
