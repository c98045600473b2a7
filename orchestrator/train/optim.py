"""Optimizer and per-step learning-rate schedule from the `optim` section.

`optim.name` is a built-in (`sgd`, `adam`, `adamw`) or an import path to a `torch.optim.Optimizer` subclass
(`torch.optim:RMSprop`, a third-party `Lion`), with `optim.kwargs`. `optim.param_groups` split the parameters:
each entry `{match: GLOB, ...settings}` takes the parameters whose qualified name (`backbone.layer1.0.weight`)
or owning module's class name (`BatchNorm2d`) the glob matches, first match wins (as precision rules);
the rest form the default group, group 0, with the section's own settings. Groups are formed by parameter
name, so they hold the fp32 masters where the policy keeps some.

`optim.schedule` is a built-in (`none`, `cosine`, `onecycle`; `optim.warmup_fraction` puts a linear warmup
first) or an import path to an `LRScheduler` class (with `optim.schedule_kwargs`) or to a factory
`(optimizer, total_steps, **schedule_kwargs) -> LRScheduler`. The schedule advances once per optimizer step
that is taken (`should_step_schedule`), as soon as the host knows the step was taken: at the latest before the
next step's update, so every update runs at the rate a host-decided schedule would give it.

The section is checked when the config is loaded (`orchestrator.config.optim`); `check_on_model()` builds
both in pre-flight, on the model.
"""

import fnmatch
from typing import Any, Iterable, Optional, Sequence, Union

import torch
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler, OneCycleLR, SequentialLR

from orchestrator.config.imports import is_import_path
from orchestrator.config.optim import (IMPLEMENTATION_FLAGS, OPTIMIZERS, accepts, optimizer_class, plain,
                                       schedule_call, schedule_target)
from orchestrator.errors import BadInput
from orchestrator.precision.step_outcome import StepOutcome

ONECYCLE_WARMUP = 0.25
"""onecycle's warmup (its `pct_start`) when `optim.warmup_fraction` is null."""
PREFLIGHT_TOTAL_STEPS = 100
"""The run length pre-flight builds the schedule for (the real one is known once the workers have their data)."""
DEFAULT_GROUP = "default"

Named = Sequence[tuple[str, torch.Tensor]]


# -- the optimizer --------------------------------------------------------------------------------


def section_settings(optim_cfg, fused: bool = False) -> dict[str, Any]:
    """The constructor's keyword arguments from the section (its default group's settings).

    A built-in gets its own fields (`momentum`, `betas`, ...); an import-path optimizer gets `lr`, `weight_decay`
    when it takes one, and the `implementation` flag; `optim.kwargs` go to both. `fused`: `auto` means the fused
    kernel (`orchestrator.train.cuda_defaults.fused_optimizer`)."""
    cls = optimizer_class(optim_cfg)
    name = optim_cfg.name
    settings: dict[str, Any] = {"lr": optim_cfg.lr}
    if name == "sgd":
        settings.update(momentum=optim_cfg.momentum, nesterov=optim_cfg.nesterov and optim_cfg.momentum > 0)
    elif name in ("adam", "adamw"):
        settings.update(betas=tuple(optim_cfg.betas), eps=optim_cfg.eps)
    if name in OPTIMIZERS or accepts(cls, "weight_decay"):
        settings["weight_decay"] = optim_cfg.weight_decay
    settings.update({"fused": True} if fused and optim_cfg.implementation == "auto"
                    else IMPLEMENTATION_FLAGS[optim_cfg.implementation])
    settings.update({key: plain(value) for key, value in optim_cfg.kwargs.items()})
    return settings


def group_overrides(optim_cfg) -> list[dict[str, Any]]:
    """Each `optim.param_groups` entry's settings (without `match`), in order."""
    return [{key: plain(value) for key, value in entry.items() if key != "match"} for entry in optim_cfg.param_groups]


def group_labels(optim_cfg) -> list[str]:
    """What each of the optimizer's groups is called: `default` (group 0), then `param_groups[i]: GLOB`."""
    return [DEFAULT_GROUP] + [f"param_groups[{i}]: {entry['match']}" for i, entry in enumerate(optim_cfg.param_groups)]


def owner_classes(model: Optional[nn.Module]) -> dict[str, str]:
    """Each parameter's qualified name -> the class name of the module that holds it."""
    if model is None:
        return {}
    return {f"{module_name}.{name}" if module_name else name: type(module).__name__
            for module_name, module in model.named_modules() for name, _ in module.named_parameters(recurse=False)}


def group_index(optim_cfg, name: str, owner_class: Optional[str]) -> int:
    """The group a parameter lands in: 1 + the first `param_groups` entry whose glob matches its qualified name
    or its owning module's class name; 0 (the default group) when none does."""
    for index, entry in enumerate(optim_cfg.param_groups, start=1):
        glob = str(entry["match"])
        if fnmatch.fnmatchcase(name, glob) or (owner_class is not None and fnmatch.fnmatchcase(owner_class, glob)):
            return index
    return 0


def groups_of(optim_cfg, model: nn.Module) -> dict[str, int]:
    """Each parameter of `model` (qualified name) -> the index of the group it lands in."""
    owners = owner_classes(model)
    return {name: group_index(optim_cfg, name, owners.get(name)) for name, _ in model.named_parameters()}


def assign_groups(optim_cfg, named: Named, model: Optional[nn.Module] = None) -> list[list[torch.Tensor]]:
    """The tensors of `named` (the parameter's name, the tensor the optimizer steps) split into the optimizer's
    groups, default group first. `model` gives the owning modules' class names."""
    owners = owner_classes(model)
    groups: list[list[torch.Tensor]] = [[] for _ in range(1 + len(optim_cfg.param_groups))]
    for name, tensor in named:
        groups[group_index(optim_cfg, name, owners.get(name))].append(tensor)
    return groups


def build_grouped(optim_cfg, groups: Sequence[Sequence[torch.Tensor]], fused: bool = False) -> torch.optim.Optimizer:
    """The optimizer over `groups` (the default group's tensors, then one list per `optim.param_groups` entry,
    empty ones kept so a group's index is its place in the config)."""
    cls, settings = optimizer_class(optim_cfg), section_settings(optim_cfg, fused)
    if not optim_cfg.param_groups:  # one group, as torch builds it from a plain list of tensors
        return cls(list(groups[0]), **settings)
    param_groups = [{"params": list(groups[0])}]
    param_groups += [{"params": list(tensors), **overrides}
                     for tensors, overrides in zip(groups[1:], group_overrides(optim_cfg))]
    return cls(param_groups, **settings)


def build_optimizer(optim_cfg, params: Iterable[Union[torch.Tensor, tuple[str, torch.Tensor]]],
                    model: Optional[nn.Module] = None, fused: bool = False) -> torch.optim.Optimizer:
    """The job's optimizer over `params`: tensors, or (parameter name, tensor) pairs, which `optim.param_groups`
    needs (e.g. `Precision.named_tensors`: the fp32 master where there is one). `model` is the module the names
    are from (its modules' class names match too). `fused`: `optim.implementation: auto` means the fused kernel."""
    params = list(params)
    if params and isinstance(params[0], tuple):
        return build_grouped(optim_cfg, assign_groups(optim_cfg, params, model), fused)
    if optim_cfg.param_groups:
        raise ValueError("optim.param_groups needs the parameters' names: pass (name, tensor) pairs")
    return build_grouped(optim_cfg, [params], fused)


def param_group_table(optim_cfg, optimizer: torch.optim.Optimizer, named: Named) -> list[dict[str, Any]]:
    """One row per parameter: its name, the group it landed in (index and label), the shape and dtype of the
    tensor the optimizer steps, and that group's learning rate (before any schedule) and weight decay."""
    names = {id(tensor): name for name, tensor in named}
    labels = group_labels(optim_cfg)
    rows = []
    for index, group in enumerate(optimizer.param_groups):
        for tensor in group["params"]:
            rows.append({"parameter": names.get(id(tensor), "?"), "group": index, "match": labels[index],
                         "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                         "lr": float(group.get("initial_lr", group["lr"])),
                         "weight_decay": group.get("weight_decay")})
    return rows


# -- the schedule ---------------------------------------------------------------------------------


def should_step_schedule(outcome: StepOutcome) -> bool:
    """The schedule counts optimizer updates: a step the loss scaler skipped (inf/nan gradients) or a non-finite
    loss skipped changed no weight, so it does not advance the schedule either (as Accelerate's scheduler)."""
    return outcome.stepped


def warmup_steps(optim_cfg, total_steps: int) -> int:
    """Optimizer steps of linear warmup before a built-in `none` or `cosine` schedule (0: none)."""
    fraction = optim_cfg.warmup_fraction
    if not fraction or total_steps < 2:
        return 0
    return min(max(1, round(fraction * total_steps)), total_steps - 1)


def build_scheduler(optim_cfg, optimizer: torch.optim.Optimizer, total_steps: int) -> Optional[LRScheduler]:
    """Stepped once per optimizer step taken; None for a constant learning rate."""
    total_steps = max(total_steps, 1)
    schedule = optim_cfg.schedule
    if is_import_path(schedule):
        target = schedule_target(optim_cfg)
        args, kwargs = schedule_call(target, optim_cfg, optimizer, total_steps)
        scheduler = target(*args, **kwargs)
        if not isinstance(scheduler, LRScheduler):
            raise BadInput(f"optim.schedule: '{schedule}' returned a {type(scheduler).__name__}, not a "
                           "torch.optim.lr_scheduler.LRScheduler. Return one built on the optimizer it is given.")
        return scheduler
    if schedule == "onecycle":
        warmup = ONECYCLE_WARMUP if optim_cfg.warmup_fraction is None else optim_cfg.warmup_fraction
        if total_steps >= 3:  # OneCycleLR divides by each phase's length in steps: keep both >= 1 step
            warmup = min(max(warmup, 2 / total_steps), (total_steps - 1) / total_steps)
        return OneCycleLR(optimizer, max_lr=[group["lr"] for group in optimizer.param_groups],
                          total_steps=total_steps, pct_start=warmup)
    warmup = warmup_steps(optim_cfg, total_steps)
    # Step k of the warmup runs at k / (warmup + 1) of each group's rate; the next step at the full rate.
    ramp = LinearLR(optimizer, start_factor=1 / (warmup + 1), end_factor=1.0, total_iters=warmup) if warmup else None
    if schedule == "cosine":
        cosine = CosineAnnealingLR(optimizer, T_max=total_steps - warmup)
        return SequentialLR(optimizer, [ramp, cosine], milestones=[warmup]) if ramp else cosine
    return ramp  # `none`: constant, after the warmup if there is one


# -- checks ---------------------------------------------------------------------------------------


def unmatched_groups(optim_cfg, model: nn.Module) -> list[str]:
    """Warnings for `optim.param_groups` globs no parameter of `model` lands under (a typo, or an earlier
    group took them all)."""
    named = list(model.named_parameters())
    sizes = [len(tensors) for tensors in assign_groups(optim_cfg, named, model)]
    examples = ", ".join(name for name, _ in named[:3])
    return [f"optim.param_groups[{index}]: '{entry['match']}' matches no parameter of the model that an earlier "
            f"group has not taken (parameters are named like {examples}; module classes like BatchNorm2d match too)."
            for index, entry in enumerate(optim_cfg.param_groups) if sizes[index + 1] == 0]


def check_on_model(optim_cfg, model: nn.Module) -> list[str]:
    """Pre-flight: build the job's optimizer and schedule on `model` (the CPU one pre-flight built), so that what
    their constructors refuse is bad input before anything starts; returns the warnings (`unmatched_groups`)."""
    try:
        optimizer = build_optimizer(optim_cfg, list(model.named_parameters()), model)
    except BadInput:
        raise
    except Exception as exc:  # whatever the class raises on a value it refuses (ValueError, TypeError, ...)
        raise BadInput(f"optim: {optim_cfg.name} refuses this job's settings ({type(exc).__name__}: {exc}). "
                       "Check optim.lr, optim.kwargs and optim.param_groups.") from None
    try:
        build_scheduler(optim_cfg, optimizer, PREFLIGHT_TOTAL_STEPS)
    except BadInput:
        raise
    except Exception as exc:
        raise BadInput(f"optim.schedule: '{optim_cfg.schedule}' fails on this job's optimizer "
                       f"({type(exc).__name__}: {exc}). Check optim.schedule_kwargs.") from None
    return unmatched_groups(optim_cfg, model)
