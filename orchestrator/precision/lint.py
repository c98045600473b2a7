"""Dangerous precision combinations, found on the driver before Ray starts.

Each finding says what is wrong, where, and the fix. `precision.lint` decides
whether findings stop the job (`error`, exit 2), are printed (`warn`), or skipped.
"""

import torch
from torch import nn

from orchestrator.precision.amp import dtype_name
from orchestrator.precision.mixed import bf16_unsupported
from orchestrator.precision.policy import NORM_TYPES, Policy, plan, unmatched_rules


def _underflows(value: float, dtype: torch.dtype) -> bool:
    return value > 0 and torch.tensor(value, dtype=dtype).item() == 0.0


def lint(cfg, model: nn.Module) -> list[str]:
    policy = Policy.from_config(cfg.precision)
    amp = policy.amp
    plans = plan(model, policy)
    findings = []

    half_layers = {p.name: p.param_dtype for p in plans.values() if p.has_params and p.param_dtype != torch.float32}
    if cfg.optim.name in ("adam", "adamw") and half_layers and not policy.master_weights:
        for dtype in sorted(set(half_layers.values()), key=str):
            if _underflows(cfg.optim.eps, dtype):
                findings.append(
                    f"optim.eps={cfg.optim.eps:g} underflows to 0 in {dtype_name(dtype)}, the dtype of "
                    f"{len(half_layers)} layers' parameters, without master weights: Adam divides by ~0 and "
                    "the weights become NaN. Fix: set precision.master_weights: true (or raise optim.eps).")

    fp16_norms = [p.name for name, p in plans.items()
                  if p.param_dtype == torch.float16 and isinstance(model.get_submodule(name), NORM_TYPES)]
    if fp16_norms:
        findings.append(
            f"normalisation layers in float16 ({', '.join(fp16_norms[:4])}{', ...' if len(fp16_norms) > 4 else ''}): "
            "their running statistics and variance overflow or lose precision, in train and eval mode. "
            "Fix: set precision.keep_norm_fp32: true (or a rule {match: 'BatchNorm*', dtype: float32}).")

    uses_fp16 = policy.compute_dtype == torch.float16 or any(d == torch.float16 for d in half_layers.values())
    if uses_fp16 and not amp.scaler_enabled:
        findings.append(
            "float16 without loss scaling (precision.loss_scale: none): small gradients underflow to zero. "
            "Fix: set precision.loss_scale: dynamic" + ("" if policy.master_weights or not half_layers
                                                        else " and precision.master_weights: true") + ".")

    if half_layers and amp.scaler_enabled and not policy.master_weights:
        findings.append(
            "float16 parameters with loss scaling but without master weights: GradScaler cannot unscale "
            "float16 gradients. Fix: set precision.master_weights: true.")

    if cfg.scaling.use_gpu and torch.cuda.is_available():  # this machine's GPU; the workers check their own
        problem = bf16_unsupported(policy, torch.device("cuda"))
        if problem:
            findings.append(problem)

    for rule in unmatched_rules(model, policy):
        findings.append(
            f"precision.rules: '{rule.match}' matches no layer of {cfg.model.name}. Fix: match a class name "
            "(e.g. Linear, BatchNorm2d) or a qualified name (e.g. features.0, classifier.*); "
            "`python -m orchestrator.submit JOB --dry-run` shows the config, the audit lists layer names.")
    return findings
