"""The train state: everything a checkpoint holds, typed, captured and restored in one place.

`TrainState` is what resume, rollback (`on_collapse: rollback`) and promotion
(`on_collapse: promote`) all go through: `Training.capture()` makes one, `build_training(state=...)`
builds from one. On disk it is two plain dicts (`to_files`/`from_files`): the shared part that rank
0 writes (`train_state.pt`) and each rank's own part (`rank<r>.pt`), only tensors, numbers and
strings, so both load with `torch.load(weights_only=True)`.
"""

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Optional, Sequence

import torch

FORMAT = 3
"""Written into train_state.pt. 1 (no `format` key): checkpoints written before the state was typed; 2: before
reports were typed (`report` and a rank's `unlogged` reports were flat dicts). Both load, converted."""


class IncompatibleCheckpoint(ValueError):
    """A checkpoint whose train state this version cannot read (missing fields, a newer format)."""


@dataclass
class RankState:
    """One rank's own part: its RNG states, its loss window not reported yet, and its hooks' states (among them
    the reports the driver may not have logged yet, `orchestrator.train.hooks.outbox`)."""

    rng: dict[str, Any]
    window: dict[str, float]
    hooks: dict[str, Any] = field(default_factory=dict)
    """Each hook's `state_dict()`, by hook name."""


@dataclass
class TrainState:
    model: dict[str, torch.Tensor]
    """fp32 weights and buffers (half parameters' values from their masters)."""
    optimizer: dict[str, Any]
    """The optimizer's state dict (over the fp32 masters where there are some)."""
    scheduler: dict[str, Any]
    """The LR schedule's state dict; {} without a schedule."""
    scaler: Optional[dict[str, Any]]
    """The GradScaler's state; None starts a fresh scale (after a promotion)."""
    counters: dict[str, int]
    """The loss-scale guardrail counters (`amp/*` totals)."""
    promoted: list[str] = field(default_factory=list)
    """Layers moved to fp32 at run time: part of the effective policy."""
    epoch: int = 0
    """The epoch the checkpoint was taken in (0-based)."""
    batches_done: int = 0
    """Batches of that epoch already trained on."""
    global_step: int = 0
    """Optimizer steps taken (skipped ones included) since the run began."""
    precision: dict[str, Any] = field(default_factory=dict)
    """The precision section the state was trained with."""
    run_id: Optional[str] = None
    """The MLflow run the state belongs to."""
    report: dict[str, Any] = field(default_factory=dict)
    """The report made with the checkpoint, its metrics only, in wire form (`Report.to_wire`): sent again on
    resume, logged once."""
    report_seq: int = 0
    """How many reports the run had made when the checkpoint was taken (reports are numbered from 1)."""
    early_stopping: dict[str, Any] = field(default_factory=dict)
    """Where `run.early_stopping` stood: the best value so far, evaluations without improvement since."""
    sample_shape: list[int] = field(default_factory=list)
    """The first training input's shape (no batch dimension), e.g. [1, 28, 28]."""
    input_example: dict[str, Any] = field(default_factory=dict)
    """The first training batch's inputs (its first samples) and the dims that varied between batches
    (`orchestrator.train.batch.InputExample.state()`): the logged model's signature and input example. Empty in
    checkpoints written before it was kept: the logged model then takes `sample_shape` float32 inputs."""
    layout: dict[str, Any] = field(default_factory=dict)
    """How the run walked its data (`orchestrator.config.layout.Layout`: world size, batch size, accumulation,
    training samples, steps per epoch, epochs, total steps, schedule); {} in checkpoints written before it was
    recorded."""
    rank: Optional[RankState] = None
    """This rank's own part; None for a rank the checkpoint has none of (the world grew)."""

    def to_files(self) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
        """(train_state.pt's dict, this rank's dict) as written to disk."""
        shared = {name: getattr(self, name) for name in SHARED}
        return {"format": FORMAT, **shared}, (asdict(self.rank) if self.rank is not None else None)

    @classmethod
    def from_files(cls, shared: dict[str, Any], own: Optional[dict[str, Any]]) -> "TrainState":
        version = shared.get("format", 1)
        if not isinstance(version, int) or version > FORMAT:
            raise IncompatibleCheckpoint(f"train state format {version!r} is newer than this ampflow reads "
                                         f"({FORMAT}): resume it with the version that wrote it.")
        missing = [name for name in REQUIRED if name not in shared]
        if missing:
            raise IncompatibleCheckpoint(f"train state lacks {', '.join(missing)}: it was not written by ampflow's "
                                         "training loop. Start the job afresh (without --resume).")
        values = {name: shared[name] for name in SHARED if name in shared}
        rank = None
        if own is not None:
            if not {"rng", "window"} <= own.keys():
                raise IncompatibleCheckpoint("a rank's part lacks its RNG states or loss window. Start the job afresh "
                                             "(without --resume).")
            hooks = own.get("hooks", {})
            if version < 3:
                hooks = {"replay": {"unlogged": [flat_report_to_wire(kept) for kept in own.get("unlogged", [])]}}
            rank = RankState(own["rng"], own["window"], hooks)
        if version < 3 and "report" in values:
            values["report"] = flat_report_to_wire(values["report"])
        return cls(**values, rank=rank)

    def at(self, *, epoch: int, batches_done: int, global_step: int, precision: dict[str, Any],
           run_id: Optional[str], report: dict[str, Any], rank: Optional[RankState],
           report_seq: int = 0, early_stopping: Optional[dict[str, Any]] = None,
           sample_shape: Sequence[int] = (), input_example: Optional[dict[str, Any]] = None,
           layout: Optional[dict[str, Any]] = None) -> "TrainState":
        """This state placed in the run: where it was taken, and what was reported with it."""
        return replace(self, epoch=epoch, batches_done=batches_done, global_step=global_step, precision=precision,
                       run_id=run_id, report=report, rank=rank, report_seq=report_seq,
                       early_stopping=early_stopping or {}, sample_shape=list(sample_shape),
                       input_example=input_example or {}, layout=layout or {})

    def detached(self) -> "TrainState":
        """A copy with every tensor cloned to the CPU (a snapshot that training cannot change)."""
        return replace(self, **{f.name: _detached(getattr(self, f.name)) for f in fields(self) if f.name != "rank"})


SHARED = tuple(f.name for f in fields(TrainState) if f.name != "rank")
REQUIRED = ("model", "optimizer", "scheduler", "scaler", "counters")


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _detached(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(item) for item in value)
    return value


_PLACE = ("seq", "step", "epoch", "epochs", "total_steps")
_FLAT_RECORDS = {"amp/overflow_log": "overflow_records", "system_samples": "system_samples"}


def flat_report_to_wire(flat: dict[str, Any]) -> dict[str, Any]:
    """A report as checkpoints of format 1 and 2 kept it (one flat dict of metrics and control keys), in the
    wire form of `orchestrator.common.report.Report`."""
    wire: dict[str, Any] = {key: int(flat[key]) for key in _PLACE if key in flat}
    wire["metrics"] = {key: value for key, value in flat.items() if key not in _PLACE
                       and isinstance(value, (int, float)) and not isinstance(value, bool)}
    wire["tags"] = dict(flat.get("tags", {}))
    wire["warnings"] = list(flat.get("warnings", []))
    wire["replay"] = [flat_report_to_wire(report) for report in flat.get("replay", [])]
    for key, field_name in _FLAT_RECORDS.items():
        wire[field_name] = list(flat.get(key, []))
    wire["tables"] = {key: value for key, value in flat.items() if isinstance(value, (list, dict))
                      and key not in ("tags", "warnings", "replay", *_FLAT_RECORDS)}
    return wire
