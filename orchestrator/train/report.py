"""What a rank hands over at a report: one typed record, and its plain wire form.

The training loop builds a `Report` and its hooks fill it in (`Hook.collect`). `to_wire()` turns it into
plain dicts, lists, numbers and strings: that is what travels through `ray.train.report` to the Ray Train
controller, whose relay callback merges the ranks' reports into one (`Report.merged`) for the driver's MLflow
writer, and what checkpoints keep of reports (they load with `torch.load(weights_only=True)`).

Ray Train reads a checkpoint's score from the wire form flattened with "/": the metric `eval/accuracy` is
`metrics/eval/accuracy` there (`score_attribute`).
"""

import json
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Sequence


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
    replay: list["Report"] = field(default_factory=list)
    """Reports of a resumed run that the previous driver may not have logged, sent again, oldest first."""

    def to_wire(self) -> dict[str, Any]:
        """Plain types only (numbers as floats or ints), loadable with `torch.load(weights_only=True)`."""
        wire = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "replay"}
        wire["replay"] = [report.to_wire() for report in self.replay]
        return json.loads(json.dumps(wire, default=float))  # tensors and numpy scalars become numbers

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


def score_attribute(metric: str) -> str:
    """The key Ray Train scores checkpoints by for `metric` (its report flattened with "/")."""
    return f"metrics/{metric}"
