"""What a rank hands over at a report: one typed record, and its plain wire form.

The training loop builds a `Report` and its hooks fill it in (`Hook.collect`). `to_wire()` turns it into
plain dicts, lists, numbers and strings: that is what travels through `ray.train.report` to the Ray Train
controller, whose relay callback merges the ranks' reports into one (`Report.merged`) for the driver's MLflow
writer, and what checkpoints keep of reports (they load with `torch.load(weights_only=True)`).

A report with a checkpoint carries the checkpoint's score (`checkpoint_score`) when checkpoints are scored:
Ray Train ranks checkpoints by it (`CHECKPOINT_SCORE`) and keeps the best.
"""

import json
import math
import sys
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional, Sequence


@dataclass
class Report:
    seq: int = 0
    """This report's number in the run (from 1; every rank counts alike, resumed from the checkpoint)."""
    step: int = 0
    """The global optimizer step it was made at: the x-axis of its metrics."""
    epoch: int = 0
    """The epoch it was made in, from 1."""
    epochs: int = 0
    """Epochs in the run."""
    total_steps: int = 0
    """Optimizer steps in the run."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Numbers logged as MLflow metrics at `step` (`train/loss`, `eval/accuracy`, `amp/loss_scale`, ...)."""
    tags: dict[str, str] = field(default_factory=dict)
    """MLflow run tags to set (`resumed_from_step`, `precision.promoted`, ...)."""
    tables: dict[str, Any] = field(default_factory=dict)
    """JSON artifacts to log, by path without `.json` (`precision/audit`, `memory/breakdown`)."""
    overflow_records: list[dict[str, Any]] = field(default_factory=list)
    """Skipped steps' records (`amp/overflow_log.json`); every rank's, once merged."""
    system_samples: list[dict[str, Any]] = field(default_factory=list)
    """System metrics sampled since the last report: [{"t": ms, "step": int, "m": {name: value}}]; every
    rank's, once merged."""
    warnings: list[str] = field(default_factory=list)
    """Printed on the driver's console (and tagged on the run)."""
    checkpoint_score: Optional[float] = None
    """With `checkpoint.score_metric`, on a report with a checkpoint: what Ray Train ranks the checkpoint by
    (`CHECKPOINT_SCORE`, `checkpoint_score()`)."""
    replay: list["Report"] = field(default_factory=list)
    """Reports of a resumed run that the previous driver may not have logged, sent again, oldest first."""
    at: Optional[float] = None
    """When the rank made it (wall clock, seconds), where its window's `time/*` ends; a report the loop did not
    time gets the time the Ray worker's session hands it over. The driver times the run's attempts by it
    (`orchestrator.tracking.goodput`)."""

    def to_wire(self) -> dict[str, Any]:
        """Plain types only (numbers as floats or ints), loadable with `torch.load(weights_only=True)`."""
        wire = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "replay"}
        wire["replay"] = [report.to_wire() for report in self.replay]
        return json.loads(json.dumps(wire, default=float))  # tensors and numpy scalars become numbers

    def metrics_only(self) -> dict[str, Any]:
        """Its place in the run and its metrics, in wire form: what a checkpoint keeps of the report made with it
        (sent again on resume, logged once)."""
        return Report(seq=self.seq, step=self.step, epoch=self.epoch, epochs=self.epochs,
                      total_steps=self.total_steps, metrics=self.metrics).to_wire()

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> "Report":
        known = {f.name for f in fields(cls)}
        values = {key: value for key, value in wire.items() if key in known and key != "replay"}
        return cls(**values, replay=[cls.from_wire(item) for item in wire.get("replay", [])])

    @classmethod
    def merged(cls, ranks: Sequence["Report"]) -> "Report":
        """Rank 0's report (its metrics are already reduced over all ranks) with every rank's overflow records
        and system samples, in rank order."""
        first = ranks[0]
        return cls(**{f.name: getattr(first, f.name) for f in fields(cls)
                      if f.name not in ("overflow_records", "system_samples")},
                   overflow_records=[record for report in ranks for record in report.overflow_records],
                   system_samples=[sample for report in ranks for sample in report.system_samples])

    def progress(self) -> dict[str, Any]:
        """Where the run is and its metrics, flat: what the console's progress line shows."""
        return {"epoch": self.epoch, "epochs": self.epochs, "step": self.step, "total_steps": self.total_steps,
                **self.metrics}


CHECKPOINT_SCORE = "checkpoint_score"
"""The key of a report's wire form Ray Train scores its checkpoint by (`checkpoint_score_attribute`)."""

UNSCORED = sys.float_info.max
"""How far from any real score an unscored checkpoint is put: finite, because Ray Train keeps its checkpoint
bookkeeping as JSON through pydantic, which writes an infinity as null (and a resumed driver could not rank it)."""


def checkpoint_score(metrics: Mapping[str, float], metric: str, mode: str) -> float:
    """A checkpoint's score: `metric` when the report with it has that metric (an evaluation ran at its step), else
    the worst score for `mode`, so that Ray Train deletes it first once a newer checkpoint exists.

    Ray Train scores a report without the attribute -inf *before* applying the mode: under `min` that would be
    the best checkpoint there is, displacing every evaluated one."""
    value = metrics.get(metric)
    if value is None or not math.isfinite(value):
        return -UNSCORED if mode == "max" else UNSCORED
    return float(value)
