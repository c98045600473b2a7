"""Dangerous precision combinations of a job, found on the driver before Ray starts.

The precision lint runs on the driver (`orchestrator.runner.preflight`), not in `orchestrator.precision`: it
judges the policy together with the job's real optimizer (`orchestrator.train.optim`), which it runs on a toy
parameter.

Each finding says what is wrong, where, and the fix, and is an error or a warning.
`precision.lint` decides what they do: `error` (errors stop the job with exit 2, warnings are
printed), `warn` (everything is printed, training goes on), or `off` (not checked).
"""

import math

import torch
from torch import nn

from orchestrator.config.job import Job
from orchestrator.precision.dtypes import dtype_name
from orchestrator.precision.float8 import unavailable as float8_unavailable
from orchestrator.precision.precision import bf16_unsupported
from orchestrator.precision.policy import NORM_TYPES, plan, unmatched_rules
from orchestrator.train.optim import build_grouped, group_labels, groups_of

SIMULATED_STEPS = 100
SIMULATED_GRADIENT = 1e-5
"""A small but ordinary gradient: its square (1e-10) is below float16's smallest subnormal (6e-8)."""


class Finding(str):
    """A lint message with its severity: `error` or `warning`."""

    severity: str

    def __new__(cls, message: str, severity: str = "error") -> "Finding":
        finding = super().__new__(cls, message)
        finding.severity = severity
        return finding


def _adam_drift(cfg, model: nn.Module, plans, dtype: torch.dtype) -> list[tuple[str, float, float]]:
    """For each of the job's parameter groups holding `dtype` parameters: (which group, where the job's optimizer
    moves a weight in `dtype`, where it moves it in fp32) after SIMULATED_STEPS steps of a constant
    SIMULATED_GRADIENT: the optimizer's real class and kernels with the group's settings, state in the dtype."""
    held = {index for name, index in groups_of(cfg.optim, model).items()
            if plans[name.rpartition(".")[0]].param_dtype == dtype}
    labels = group_labels(cfg.optim)
    moved = []
    for param_dtype in (dtype, torch.float32):
        params = [nn.Parameter(torch.zeros(4, dtype=param_dtype)) for _ in labels]
        optimizer = build_grouped(cfg.optim, [[param] for param in params])
        for group in optimizer.param_groups:  # decay pulls toward 0: not what is measured
            if "weight_decay" in group:
                group["weight_decay"] = 0.0
        for _ in range(SIMULATED_STEPS):
            for param in params:
                param.grad = torch.full_like(param, SIMULATED_GRADIENT)
            optimizer.step()
        moved.append([float(param.detach().float().mean()) for param in params])
    where = [f", group {label}" if len(labels) > 1 else "" for label in labels]
    return [(where[i], moved[0][i], moved[1][i]) for i in sorted(held)]


def _smallest_surviving_update(dtype: torch.dtype) -> float:
    """The smallest change of a weight of magnitude 1 that rounding to `dtype` keeps (half its spacing)."""
    return torch.finfo(dtype).eps / 2


def lint(cfg, model: nn.Module) -> list[Finding]:
    policy = Job.of(cfg).policy
    amp = policy.amp
    plans = plan(model, policy)
    findings: list[Finding] = []

    half_layers = {p.name: p.param_dtype for p in plans.values() if p.has_params and p.param_dtype != torch.float32}
    half_state = sorted(set(half_layers.values()), key=str) if not policy.master_weights else []
    for dtype in half_state:
        if cfg.optim.name != "sgd":  # adam, adamw or an optimizer of the user's: measured
            adam = cfg.optim.name in ("adam", "adamw")
            for where, moved, reference in _adam_drift(cfg, model, plans, dtype):
                if math.isfinite(moved) and abs(moved - reference) <= 0.1 * abs(reference):
                    continue
                why = (f"v = g^2 underflows there (a gradient of {SIMULATED_GRADIENT:g} squares to "
                       f"{SIMULATED_GRADIENT ** 2:g}) and the update divides by ~optim.eps={cfg.optim.eps:g}. " if adam
                       else "")
                findings.append(Finding(
                    f"optim.name={cfg.optim.name} keeps its state in {dtype_name(dtype)} ({len(half_layers)} layers' "
                    f"parameters, no master weights): {why}Measured with this job's optimizer (optim.implementation="
                    f"{cfg.optim.implementation}, optim.lr={cfg.optim.lr:g}{where}): {SIMULATED_STEPS} steps of a "
                    f"gradient of {SIMULATED_GRADIENT:g} move a weight by {moved:.3g} instead of {reference:.3g}. "
                    "Fix: set precision.master_weights: true (the optimizer steps fp32 copies), or use bfloat16 "
                    "(fp32's exponent range).")
                )
        elif cfg.optim.name == "sgd":
            smallest = _smallest_surviving_update(dtype)
            findings.append(Finding(
                f"optim.name=sgd steps {dtype_name(dtype)} parameters without master weights: an update smaller than "
                f"half the {dtype_name(dtype)} spacing is rounded away. At optim.lr={cfg.optim.lr:g} a weight of "
                f"magnitude 1 changes only when lr x |gradient| >= {smallest:.3g}, i.e. |gradient| >= "
                f"{smallest / cfg.optim.lr:.3g}; smaller updates are lost. Fix: set precision.master_weights: true.",
                severity="warning"))

    fp16_norms = [p.name for name, p in plans.items()
                  if p.param_dtype == torch.float16 and isinstance(model.get_submodule(name), NORM_TYPES)]
    if fp16_norms:
        findings.append(Finding(
            f"normalisation layers in float16 ({', '.join(fp16_norms[:4])}{', ...' if len(fp16_norms) > 4 else ''}): "
            "their running statistics and variance overflow or lose precision, in train and eval mode. "
            "Fix: set precision.keep_norm_fp32: true (or a rule {match: 'BatchNorm*', dtype: float32})."))

    if policy.fp16_gradients and amp.loss_scale == "none":
        where = " and ".join(part for part in (
            "float16 autocast" if policy.autocast and policy.compute_dtype == torch.float16 else "",
            f"float16 parameters in {sum(d == torch.float16 for d in half_layers.values())} layers"
            if torch.float16 in half_layers.values() else "") if part)
        findings.append(Finding(
            f"float16 gradients ({where}) without loss scaling (precision.loss_scale: none): gradients below "
            "float16's smallest value (6e-8) underflow to zero. Fix: set precision.loss_scale: dynamic."))

    if cfg.scaling.use_gpu and torch.cuda.is_available():  # this machine's GPU; the workers check their own
        problem = bf16_unsupported(policy, torch.device("cuda"))
        if problem:
            findings.append(Finding(problem))
        problem = float8_unavailable(torch.device("cuda")) if any(p.float8 for p in plans.values()) else None
        if problem:
            findings.append(Finding(problem))

    not_linear = [f"{p.name} ({p.type})" for name, p in plans.items()
                  if p.float8 and not isinstance(model.get_submodule(name), nn.Linear)]
    if not_linear:
        findings.append(Finding(
            f"precision.rules: a float8 rule matches {', '.join(not_linear[:4])}: float8 applies to Linear layers "
            "only (torchao's Float8Linear). Fix: make the rule's match name only Linear layers."))

    for rule in unmatched_rules(model, policy):
        if rule.checkpoint or rule.compile:  # refused whatever precision.lint says (pre-flight's check_plan)
            continue
        findings.append(Finding(
            f"precision.rules: '{rule.match}' matches no layer of {cfg.model.name}. Fix: match a class name "
            "(e.g. Linear, BatchNorm2d) or a qualified name (e.g. features.0, classifier.*); "
            "`python -m orchestrator.submit JOB --dry-run` shows the config, the audit lists layer names."))
    return findings
