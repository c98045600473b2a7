"""A whole tune, as `ampflow tune` runs it: probe, choose, validate (moving the riskiest layer up until the loss
curves agree), then the job file and one MLflow run."""

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import yaml
from omegaconf import OmegaConf

from orchestrator.config.loader import parse_overrides
from orchestrator.config.yamlsafe import load_yaml_mapping
from orchestrator.train import task
from orchestrator.train.data import build_rank_loaders
from orchestrator.train.models import build_model
from orchestrator.train.rng import seed_everything
from orchestrator.tune.check import FP32, Validation, compare, losses
from orchestrator.tune.plan import options, precision_section, predictions, sensitivity_table
from orchestrator.tune.probe import Probe
from orchestrator.tune.search import by_layer, choose, one_up, riskiest


class ValidationFailed(RuntimeError):
    """No policy passed the validation within `tune.max_rounds` rounds."""


@dataclass
class Tune:
    """What a tune found."""

    assignment: dict[str, str]
    """Layer -> dtype, for every candidate layer."""
    precision: dict[str, Any]
    """The `precision` section written to the job."""
    predicted: dict[str, float]
    table: list[dict[str, Any]]
    validations: list[Validation] = field(default_factory=list)
    """One per round, the last the one that passed."""
    moved_up: list[tuple[str, str, str]] = field(default_factory=list)
    """(layer, from dtype, to dtype) for each round a validation failed."""
    device: str = "cpu"

    @property
    def lowered(self) -> dict[str, str]:
        return {layer: dtype for layer, dtype in self.assignment.items() if dtype != "float32"}


def job_batches(cfg, device: torch.device, count: int) -> list:
    """The first `count` batches of the job's training data (cycled when the split has fewer), on the device."""
    train, _, position = build_rank_loaders(cfg, 0, 1, device)
    position.set_position(0, 0, cfg.run.batch_size)
    batches: list = []
    while len(batches) < count:
        before = len(batches)
        for batch in train:
            batches.append(batch.to(device))
            if len(batches) == count:
                break
        if len(batches) == before:
            raise ValueError("the job's training split yields no batch (data, run.batch_size)")
    return batches


def tune(cfg, say: Callable[[str], None] = print) -> Tune:
    """Tune `cfg`'s precision (its `tune` section) on this machine's device."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    settings = cfg.tune
    batches = job_batches(cfg, device, max(settings.batches, settings.validate_steps))
    seed_everything(cfg.run.seed)
    probe = Probe(build_model(cfg.model), batches[: settings.batches], task.build_loss(cfg.task), device)
    where = f"modelled for {settings.target}" if settings.target else f"measured on this {device.type}"
    say(f"probing {len(probe.layers)} layers in {', '.join(settings.candidates)} on {settings.batches} batch(es); "
        f"costs {where}")
    rows = options(probe, list(settings.candidates), settings.target, settings.emulate_float8)
    table = by_layer(rows)
    assignment, pinned = choose(rows, settings.tolerance), {}
    validations, moved = [], []
    reference = None
    for round_ in range(settings.max_rounds + 1):
        if settings.validate_steps == 0 or all(d == "float32" for d in assignment.values()):
            break
        steps = batches[: settings.validate_steps]
        if reference is None:
            reference, _ = losses(cfg, FP32, steps, device)
        curve, skipped = losses(cfg, precision_section(assignment), steps, device)
        validations.append(compare(reference, curve, skipped))
        if validations[-1].passed(settings.tolerance):
            break
        layer = riskiest(assignment, table, exclude=pinned)
        if layer is None or round_ == settings.max_rounds:
            raise ValidationFailed(
                f"the chosen policy's loss stayed {validations[-1].gap:.3g} (relative, mean over "
                f"{len(steps)} steps) from fp32's, above tune.tolerance={settings.tolerance:g}, after "
                f"{round_ + 1} validation round(s). Raise tune.max_rounds or tune.tolerance, or give tune.batches "
                "more batches.")
        pinned[layer] = one_up(layer, assignment[layer], table)
        moved.append((layer, assignment[layer], pinned[layer]))
        say(f"validation {round_ + 1}: loss {validations[-1].gap:.3g} from fp32's; {layer} goes from "
            f"{assignment[layer]} to {pinned[layer]}")
        assignment = choose(rows, settings.tolerance, pinned=pinned)
    return Tune(assignment, precision_section(assignment), predictions(assignment, rows, probe),
                sensitivity_table(rows, probe, assignment), validations, moved, device.type)


def tuned_job(job_path: Path, overrides: list[str], precision: dict[str, Any]) -> str:
    """The job file as the user wrote it (with the command line's overrides), its `precision` section replaced by
    `precision` and its `tune` section left out: what `submit` takes as it is."""
    job = OmegaConf.merge(OmegaConf.create(load_yaml_mapping(job_path)), parse_overrides(overrides))
    data = OmegaConf.to_container(job)
    data.pop("tune", None)
    data["precision"] = {key: value for key, value in precision.items() if value is not None}
    return yaml.safe_dump(data, sort_keys=False)


TUNE_RUN_TAG = "tune_run_id"
"""The tag (`tracking.tags`) a tuned job gives its runs: the id of the tune run that chose its policy."""


def linked_job(text: str, tune_run_id: str) -> str:
    """The tuned job's text (its header comment kept) with `tracking.tags.tune_run_id` set to the tune's run."""
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    data = yaml.safe_load(text)
    tracking = data.setdefault("tracking", {}) or {}
    data["tracking"] = {**tracking, "tags": {**(tracking.get("tags") or {}), TUNE_RUN_TAG: tune_run_id}}
    return header + yaml.safe_dump(data, sort_keys=False)


def finite(value: float) -> Optional[float]:
    return value if math.isfinite(value) else None
