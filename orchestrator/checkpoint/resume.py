"""Whether a checkpoint can go on under the job about to resume it, and where it goes on.

A checkpoint records the run that wrote it (`CheckpointFacts`): its position, its layout (world size, batch
size, micro-batches per step, training samples, steps per epoch, epochs, total steps, the schedule), its
model's state-dict shapes and its precision section. They are part of the train state and are also written
beside it as `ampflow_checkpoint.json`, small enough for the driver to read from any storage before Ray starts
(`orchestrator.checkpoint.stored`); the workers check again on what they load.

`check_resume` compares them with the job now. Handled exactly:
- a checkpoint taken at the end of an epoch goes on at the start of the next one, whatever the world size,
  batch size, accumulation or data set size are now: an epoch's order depends only on the seed and the epoch;
- more or fewer epochs, or another `run.max_steps_per_epoch`, when the schedule does not depend on the run's
  length (`optim.schedule: none` without warmup); a shorter `max_steps_per_epoch` ends the epoch sooner;
- an elastic run (`scaling.num_workers: [min, max]`) in the middle of an epoch on another number of workers, the
  max unchanged: each step is the same global batch, the same samples, on any number of ranks.
Refused (`IncompatibleResume`, exit 2 before Ray starts), naming the key and both values:
- another model (a parameter or buffer missing, added, or of another shape);
- in the middle of an epoch, another world size, batch size, accumulation or data set size: the samples left
  in the epoch would not be those the run has not seen;
- another schedule (`optim.schedule`, `optim.warmup_fraction`, `optim.schedule_kwargs`), or other total steps
  for a schedule that depends on them (anything but `none` without warmup).
A changed precision section is allowed; the driver records it on the run (`orchestrator.runner.driver`).
"""

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

from orchestrator.config.layout import Layout, depends_on_length
from orchestrator.errors import BadInput

FACTS_FORMAT = 1


class IncompatibleResume(BadInput):
    """The job about to resume a run differs from it in a way the checkpoint cannot go on under."""


@dataclass
class CheckpointFacts:
    """What a checkpoint says about the run that wrote it (`ampflow_checkpoint.json`)."""

    global_step: int
    epoch: int
    """The epoch it was taken in (0-based)."""
    batches_done: int
    """Optimizer steps of that epoch done."""
    layout: Optional[Layout]
    """None: written before layouts were recorded (only the model is checked then)."""
    model_shapes: dict[str, list[int]]
    precision: dict[str, Any]
    run_id: Optional[str] = None
    finite: bool = True
    """Its weights and optimizer state are finite (always, for checkpoints ampflow writes since it checks)."""

    @classmethod
    def of_state(cls, state) -> "CheckpointFacts":
        """The facts of a `TrainState` (its layout is None when it has none recorded)."""
        return cls(state.global_step, state.epoch, state.batches_done,
                   Layout.from_dict(state.layout) if state.layout else None,
                   {name: list(tensor.shape) for name, tensor in state.model.items()}, dict(state.precision),
                   state.run_id)

    def to_json(self) -> dict[str, Any]:
        values = asdict(self)
        values["layout"] = self.layout.to_dict() if self.layout is not None else None
        return {"format": FACTS_FORMAT, **values}

    @classmethod
    def from_json(cls, values: Mapping[str, Any]) -> "CheckpointFacts":
        layout = values.get("layout")
        return cls(int(values["global_step"]), int(values["epoch"]), int(values["batches_done"]),
                   Layout.from_dict(layout) if layout else None, dict(values["model_shapes"]),
                   dict(values.get("precision") or {}), values.get("run_id"), bool(values.get("finite", True)))

    @property
    def epoch_done(self) -> bool:
        return self.layout is not None and self.batches_done >= self.layout.steps_per_epoch


@dataclass(frozen=True)
class Resumed:
    """Where a resumed run goes on, and how long it is."""

    epoch: int
    batches_done: int
    total_steps: int


def model_mismatch(saved: Mapping[str, list[int]], job: Mapping[str, list[int]]) -> Optional[str]:
    """The first difference between two models' state-dict shapes, described; None when they match."""
    for name, shape in saved.items():
        if name not in job:
            return f"the checkpoint has `{name}` ({_shape(shape)}), which this job's model does not"
        if list(job[name]) != list(shape):
            return f"`{name}` is {_shape(shape)} in the checkpoint and {_shape(job[name])} in this job's model"
    extra = [name for name in job if name not in saved]
    if extra:
        return f"this job's model has `{extra[0]}` ({_shape(job[extra[0]])}), which the checkpoint does not"
    return None


def _shape(shape) -> str:
    return "x".join(map(str, shape)) or "a scalar"


def check_model(facts: CheckpointFacts, job_shapes: Mapping[str, list[int]], cfg, where: str) -> None:
    """IncompatibleResume when the job's model does not take the checkpoint's weights."""
    problem = model_mismatch(facts.model_shapes, job_shapes)
    if problem:
        raise IncompatibleResume(
            f"--resume: model: {problem} (model.name={cfg.model.name}). {where} was trained with another model: "
            "set model.name / model.kwargs / model.num_classes back, or start a new run without --resume.")


_CHANGEABLE_AT_EPOCH_END = (("scaling.num_workers", "world_size"),
                            ("scaling.num_workers (elastic max)", "max_world_size"), ("run.batch_size", "batch_size"),
                            ("run.accumulate_steps", "accumulate_steps"), ("data (training samples)", "train_samples"))


def _changeable_mid_epoch(saved: Layout, job: Layout) -> tuple[tuple[str, str], ...]:
    """What must match to go on in the middle of an epoch: an elastic run's steps are the same samples on any
    number of ranks (the same global batch), so its world size may change (within the job's range)."""
    elastic = saved.max_world_size is not None and saved.max_world_size == job.max_world_size
    return tuple(entry for entry in _CHANGEABLE_AT_EPOCH_END if not (elastic and entry[1] == "world_size"))


def check_resume(facts: CheckpointFacts, job: Layout, where: str) -> Resumed:
    """Where the run goes on under `job` (the job's layout from the start), or IncompatibleResume naming what
    differs. `where`: the checkpoint, for messages."""
    saved = facts.layout
    epoch, done = facts.epoch, facts.batches_done
    if saved is None:  # written before layouts were recorded: the position is taken as it is
        if done >= job.steps_per_epoch:
            epoch, done = epoch + 1, 0
        return Resumed(epoch, done, facts.global_step + _remaining(epoch, done, job))

    def refuse(key: str, before: Any, now: Any, why: str) -> IncompatibleResume:
        fix = (f"Train on the data the run trained on ({before} samples)" if key.startswith("data")
               else f"Set {key} back to {before!r}")
        return IncompatibleResume(
            f"--resume: {key}: {before!r} in the run, {now!r} in this job. {why} {fix} to resume {where} (step "
            f"{facts.global_step}), or start a new run without --resume.")

    if done >= saved.steps_per_epoch:
        epoch, done = epoch + 1, 0
    else:
        for key, name in _changeable_mid_epoch(saved, job):
            before, now = getattr(saved, name), getattr(job, name)
            if before != now:
                raise refuse(key, before, now,
                             f"The checkpoint was taken in the middle of epoch {epoch + 1} (step {done} of "
                             f"{saved.steps_per_epoch}): with another value the rest of that epoch would not be "
                             "the samples the run has not seen yet (a checkpoint at an epoch's end resumes under "
                             "any).")
        if done >= job.steps_per_epoch:  # a smaller run.max_steps_per_epoch ends this epoch here
            epoch, done = epoch + 1, 0
    for key in ("schedule", "warmup_fraction", "schedule_kwargs"):
        before, now = saved.schedule.get(key), job.schedule.get(key)
        if saved.schedule and before != now:
            raise refuse(f"optim.{key}", before, now, "The checkpoint's learning-rate schedule cannot go on as "
                                                      "another one.")
    total = facts.global_step + _remaining(epoch, done, job)
    if total != saved.total_steps and saved.schedule and depends_on_length(saved.schedule):
        changed = [f"{key} {getattr(saved, name)!r} -> {getattr(job, name)!r}" for key, name in
                   (*_CHANGEABLE_AT_EPOCH_END, ("run.epochs", "epochs"), ("steps per epoch", "steps_per_epoch"))
                   if getattr(saved, name) != getattr(job, name)]
        raise IncompatibleResume(
            f"--resume: the schedule's total steps: {saved.total_steps} in the run, {total} in this job"
            f"{' (' + ', '.join(changed) + ')' if changed else ''}. optim.schedule "
            f"'{saved.schedule['schedule']}'{' with warmup' if saved.schedule['warmup_fraction'] is not None else ''}"
            f" was built for {saved.total_steps} steps and cannot be stretched exactly. Set them back to resume "
            f"{where} (step {facts.global_step}), or start a new run without --resume.")
    return Resumed(epoch, done, total)


def _remaining(epoch: int, done: int, job: Layout) -> int:
    """Optimizer steps left from (epoch, done) to the end of the job's epochs."""
    if epoch >= job.epochs:
        return 0
    return (job.steps_per_epoch - done) + job.steps_per_epoch * (job.epochs - epoch - 1)
