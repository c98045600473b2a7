"""The `optim` section's checks when a job is loaded: the optimizer and schedule it names exist and take what
the section gives them (their classes are imported and their signatures read; nothing is built). Building
them is `orchestrator.train.optim`'s.
"""

import inspect
import math
from typing import Any, Iterable, Optional

import torch
from omegaconf import OmegaConf
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from orchestrator.config.imports import is_import_path, resolve_import_path
from orchestrator.errors import BadInput

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
SCHEDULES = ("none", "cosine", "onecycle")
# `optim.implementation` -> the constructor flags torch's optimizers take.
IMPLEMENTATION_FLAGS = {
    "auto": {},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
    "for_loop": {"foreach": False},
}
# Constructor arguments the section sets itself: kwargs must not set them again.
SECTION_KEYS = {"lr": "optim.lr", "weight_decay": "optim.weight_decay", "foreach": "optim.implementation",
                "fused": "optim.implementation"}
BUILT_IN_KEYS = {"sgd": ("momentum", "nesterov"), "adam": ("betas", "eps"), "adamw": ("betas", "eps")}


def optimizer_class(optim_cfg) -> type:
    """The class `optim.name` names; BadInput (naming `optim.name`) for anything but an Optimizer subclass."""
    name = optim_cfg.name
    if name in OPTIMIZERS:
        return OPTIMIZERS[name]
    if not is_import_path(name):
        raise BadInput(f"optim.name: unknown optimizer '{name}'. Use one of {', '.join(OPTIMIZERS)}, or an import "
                       "path 'package.module:Class' to a torch.optim.Optimizer subclass (e.g. torch.optim:RMSprop).")
    cls = resolve_import_path(name, "optim.name", kind="optimizer")
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
        raise BadInput(f"optim.name: '{name}' is not a torch.optim.Optimizer subclass. Name an optimizer class "
                       "(e.g. torch.optim:RMSprop, or your own subclass of torch.optim.Optimizer).")
    return cls


def parameters(target) -> Optional[dict[str, inspect.Parameter]]:
    """The keyword arguments `target` takes; None when it takes any (**kwargs) or cannot be inspected."""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return dict(params)


def accepts(target, key: str) -> bool:
    params = parameters(target)
    return params is None or key in params


def plain(value: Any) -> Any:
    """A config value as the optimizer takes it: lists (betas) become tuples, OmegaConf containers plain."""
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    return tuple(value) if isinstance(value, list) else value


def schedule_target(optim_cfg):
    """The class or factory an import-path `optim.schedule` names (BadInput naming `optim.schedule`)."""
    name = optim_cfg.schedule
    target = resolve_import_path(name, "optim.schedule", kind="learning-rate schedule")
    if inspect.isclass(target) and (not issubclass(target, LRScheduler) or issubclass(target, ReduceLROnPlateau)):
        raise BadInput(f"optim.schedule: '{name}' is not an LRScheduler stepped once per optimizer step (ampflow "
                       "calls step() without a metric). Name a torch.optim.lr_scheduler class (e.g. "
                       "torch.optim.lr_scheduler:StepLR) or a factory (optimizer, total_steps) -> LRScheduler.")
    return target


def schedule_call(target, optim_cfg, optimizer: Any, total_steps: int) -> tuple[tuple, dict[str, Any]]:
    """The arguments an import-path schedule is called with."""
    kwargs = {key: plain(value) for key, value in optim_cfg.schedule_kwargs.items()}
    if not inspect.isclass(target):
        return (optimizer, total_steps), kwargs
    params = parameters(target)
    if params is not None and "total_steps" in params and "total_steps" not in kwargs:  # OneCycleLR's length
        kwargs["total_steps"] = total_steps
    return (optimizer,), kwargs


def _refuse_unknown_keys(keys: Iterable[str], target, where: str, what: str) -> None:
    params = parameters(target)
    if params is None:
        return
    taken = sorted(set(params) - {"self", "params", "optimizer"})
    for key in keys:
        if key not in params or key in ("self", "params", "optimizer"):
            raise BadInput(f"{where}.{key}: {what} takes no argument '{key}'. It takes: {', '.join(taken)}.")


def check(optim_cfg) -> None:
    """Config-time checks of the optimizer and the schedule (imports the named classes, builds nothing):
    BadInput naming the key."""
    cls = optimizer_class(optim_cfg)
    name = optim_cfg.name
    what = f"optimizer {cls.__module__}.{cls.__qualname__}"
    reserved = {**SECTION_KEYS, **{key: f"optim.{key}" for key in BUILT_IN_KEYS.get(name, ())}}
    for key in optim_cfg.kwargs:
        if key in reserved:
            raise BadInput(f"optim.kwargs.{key}: set {reserved[key]} instead (the section passes it).")
    _refuse_unknown_keys(optim_cfg.kwargs, cls, "optim.kwargs", what)
    if name not in OPTIMIZERS:
        if not accepts(cls, "lr"):
            raise BadInput(f"optim.name: {what} takes no 'lr': ampflow's learning rate, groups and schedules set "
                           "each group's 'lr'. Use an optimizer that takes one.")
        if not accepts(cls, "weight_decay") and optim_cfg.weight_decay != 0:
            raise BadInput(f"optim.weight_decay: {what} takes no 'weight_decay'; set optim.weight_decay: 0 (its own "
                           "decay argument, if any, goes in optim.kwargs).")
        for flag in IMPLEMENTATION_FLAGS[optim_cfg.implementation]:
            if not accepts(cls, flag):
                raise BadInput(f"optim.implementation: {what} takes no '{flag}'; set optim.implementation: auto.")
    for index, entry in enumerate(optim_cfg.param_groups):
        where = f"optim.param_groups[{index}]"
        if not isinstance(entry.get("match"), str) or not entry["match"]:
            raise BadInput(f"{where}.match: each group needs a glob, e.g. {{match: '*.bias', weight_decay: 0}} "
                           "(a parameter's qualified name, or its module's class name such as 'BatchNorm*').")
        _refuse_unknown_keys([key for key in entry if key != "match"], cls, where, what)
        lr = entry.get("lr")
        if lr is not None and not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
            raise BadInput(f"{where}.lr: must be a finite number >= 0, got {lr}.")
    _check_schedule(optim_cfg)


def _check_schedule(optim_cfg) -> None:
    schedule, warmup = optim_cfg.schedule, optim_cfg.warmup_fraction
    if not is_import_path(schedule):
        if schedule not in SCHEDULES:
            raise BadInput(f"optim.schedule: unknown schedule '{schedule}'. Use one of {', '.join(SCHEDULES)}, or an "
                           "import path to an LRScheduler class or a factory (optimizer, total_steps) -> LRScheduler.")
        if optim_cfg.schedule_kwargs:
            raise BadInput("optim.schedule_kwargs: only for an import-path optim.schedule; the built-in schedules "
                           "take optim.warmup_fraction.")
        if warmup is not None and not (math.isfinite(warmup) and 0 <= warmup < 1):
            raise BadInput(f"optim.warmup_fraction: must be in [0, 1) or null, got {warmup}.")
        return
    if warmup is not None:
        raise BadInput("optim.warmup_fraction: applies to the built-in schedules; put the warmup in your own "
                       f"schedule '{schedule}' (or leave optim.warmup_fraction null).")
    target = schedule_target(optim_cfg)
    args, kwargs = schedule_call(target, optim_cfg, "optimizer", 1)
    try:
        inspect.signature(target).bind(*args, **kwargs)
    except TypeError as exc:
        call = "its class" if inspect.isclass(target) else "(optimizer, total_steps, **optim.schedule_kwargs)"
        raise BadInput(f"optim.schedule_kwargs: '{schedule}' cannot be called as {call} with "
                       f"{sorted(kwargs)}: {exc}.") from None
    except ValueError:  # no signature to check: the pre-flight build does
        pass
