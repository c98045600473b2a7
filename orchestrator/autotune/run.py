"""A whole tune, as `ampflow tune` runs it: probe, choose, validate (moving the riskiest layer up until the loss
curves agree), then the job file and one MLflow run."""

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import yaml
from omegaconf import OmegaConf

from orchestrator.config.loader import load_job, parse_overrides
from orchestrator.config.schema import TuneSection
from orchestrator.config.yamlsafe import load_yaml_mapping
from orchestrator.errors import BadInput
from orchestrator.precision.float8 import FLOAT8
from orchestrator.precision.policy import Policy, plan
from orchestrator.train import task
from orchestrator.train.data import build_rank_loaders
from orchestrator.train.models import build_model
from orchestrator.train.rng import seed_everything
from orchestrator.autotune.check import FP32, Validation, compare, losses
from orchestrator.autotune.plan import (failure, float8_missing, options, precision_section, predictions,
                                        sensitivity_table)
from orchestrator.autotune.probe import Probe
from orchestrator.autotune.search import by_layer, choose, one_up, riskiest


class ValidationFailed(RuntimeError):
    """No policy passed the validation within `tune.max_rounds` rounds."""


@dataclass
class Tune:
    """What a tune found."""

    assignment: dict[str, str]
    """Candidate -> dtype, for every candidate (a layer, or an attention block's layers lowered together)."""
    precision: dict[str, Any]
    """The tuned job's whole `precision` section: the job's own, its rules first, then the tuner's."""
    predicted: dict[str, float]
    table: list[dict[str, Any]]
    validations: list[Validation] = field(default_factory=list)
    """One per round, the last the one that passed."""
    moved_up: list[tuple[str, str, str]] = field(default_factory=list)
    """(layer, from dtype, to dtype) for each round a validation failed."""
    device: str = "cpu"
    kept: list[str] = field(default_factory=list)
    """The layers the job's own rules decide: kept as they are, never tuned."""

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


def tune_device() -> torch.device:
    """The device a tune probes and validates on: this machine's GPU, else its CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def refuse_unavailable_float8(cfg, source: str) -> None:
    """Before any work: BadInput (exit 2, naming the key) when the job asks for float8 and it cannot be tried here
    (torchao not installed, or failing to import where float8 would be probed): `tune.emulate_float8: true`, or
    float8 in a `tune.candidates` the job sets. The default candidates try float8 where it can run: without it
    the tune goes on, and its summary says why float8 was not tried."""
    settings = cfg.tune
    if FLOAT8 not in settings.candidates:
        return
    reason = float8_missing(tune_device(), settings.emulate_float8)
    if reason is None:
        return
    if settings.emulate_float8:
        raise BadInput(f"{source}: tune.emulate_float8: float8 cannot be probed: {reason}. Otherwise set "
                       "tune.emulate_float8=false and leave float8 out of tune.candidates.")
    if list(settings.candidates) != TuneSection().candidates:
        raise BadInput(f"{source}: tune.candidates: float8 cannot be tried: {reason}. Otherwise leave float8 out of "
                       "tune.candidates (e.g. tune.candidates=[float16,bfloat16]).")


def tune(cfg, say: Callable[[str], None] = print) -> Tune:
    """Tune `cfg`'s precision (its `tune` section) on this machine's device."""
    device = tune_device()
    settings = cfg.tune
    batches = job_batches(cfg, device, max(settings.batches, settings.validate_steps))
    seed_everything(cfg.run.seed)
    model = build_model(cfg.model)
    policy = Policy.from_config(cfg.precision)  # the job's own: its preset and rules are constraints the tune keeps
    plans = plan(model, policy)
    kept = [name for name, layer in plans.items()
            if name and layer.rule not in (None, "keep_norm_fp32") and layer.has_params]
    probe = Probe(model, batches[: settings.batches], task.build_loss(cfg.task), device, exclude=kept)
    base = OmegaConf.to_container(cfg.precision)

    def section(assignment: dict[str, str]) -> dict[str, Any]:
        layers = {layer: dtype for unit, dtype in assignment.items() for layer in probe.layers[unit].layers}
        return precision_section(layers, base, policy, plans)

    where = f"modelled for {settings.target}" if settings.target else f"measured on this {device.type}"
    say(f"probing {len(probe.layers)} layers in {', '.join(settings.candidates)} on {settings.batches} batch(es); "
        f"costs {where}")
    if kept:
        say(f"kept as the job's rules decide them (not tuned): {', '.join(kept[:8])}{', ...' if len(kept) > 8 else ''}")
    for block in probe.excluded_blocks:
        say(f"not tuned: {block} (the job's rules decide part of its attention; its layers stay as the job has them)")
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
        try:
            curve, skipped = losses(cfg, section(assignment), steps, device)
            validations.append(compare(reference, curve, skipped))
            why = f"loss {validations[-1].gap:.3g} from fp32's"
        except Exception as exc:  # the combination does not train: a failed round, the riskiest layer goes up
            validations.append(Validation(reference, [], math.inf, 0))
            why = f"the policy fails ({failure(exc)})"
        if validations[-1].passed(settings.tolerance):
            break
        layer = riskiest(assignment, table, exclude=pinned)
        if layer is None or round_ == settings.max_rounds:
            stayed = (f"the chosen policy's loss stayed {validations[-1].gap:.3g} (relative, mean over {len(steps)} "
                      f"steps) from fp32's, above tune.tolerance={settings.tolerance:g}"
                      if validations[-1].policy_losses else f"the chosen policy does not train: {why}")
            raise ValidationFailed(
                f"{stayed}, after {round_ + 1} validation round(s). Raise tune.max_rounds or tune.tolerance, or give "
                "tune.batches more batches.")
        pinned[layer] = one_up(layer, assignment[layer], table)
        moved.append((layer, assignment[layer], pinned[layer]))
        say(f"validation {round_ + 1}: {why}; {layer} goes from {assignment[layer]} to {pinned[layer]}")
        assignment = choose(rows, settings.tolerance, pinned=pinned)
    return Tune(assignment, section(assignment), predictions(assignment, rows, probe),
                sensitivity_table(rows, probe, assignment), validations, moved, device.type, kept)


def tuned_job(job_path: Path, overrides: list[str], precision: dict[str, Any]) -> str:
    """The job file as the user wrote it (with the command line's overrides), its `tune` section left out and its
    `precision` section as written (its preset and its settings) with what the tune changed in it: its rules (the
    job's own first), and `master_weights` and `loss_scale` where they had to change. What `submit` takes as it is."""
    job = OmegaConf.merge(OmegaConf.create(load_yaml_mapping(job_path)), parse_overrides(overrides))
    data = OmegaConf.to_container(job)
    data.pop("tune", None)
    resolved = OmegaConf.to_container(load_job(job_path, overrides).precision)
    written = dict(data.get("precision") or {})
    written.update({key: value for key, value in precision.items() if key != "rules" and value != resolved.get(key)})
    written["rules"] = [*written.get("rules", []), *precision["rules"][len(resolved["rules"]):]]  # the job's as written
    data["precision"] = written
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
