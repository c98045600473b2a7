"""Optimizer and per-step learning-rate schedule from the `optim` section."""

from typing import Iterable, Optional

import torch


# `optim.implementation` -> the constructor flags torch's optimizers take.
IMPLEMENTATION_FLAGS = {
    "auto": {},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
    "for_loop": {"foreach": False},
}


def build_optimizer(optim_cfg, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    name = optim_cfg.name
    flags = IMPLEMENTATION_FLAGS[optim_cfg.implementation]
    if name == "sgd":
        return torch.optim.SGD(
            params, lr=optim_cfg.lr, momentum=optim_cfg.momentum,
            nesterov=optim_cfg.nesterov and optim_cfg.momentum > 0, weight_decay=optim_cfg.weight_decay, **flags,
        )
    adam_cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    return adam_cls(
        params, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.eps,
        weight_decay=optim_cfg.weight_decay, **flags,
    )


def build_scheduler(
    optim_cfg, optimizer: torch.optim.Optimizer, total_steps: int
) -> Optional[torch.optim.lr_scheduler.LRScheduler]:
    """Stepped once per optimizer step; None for a constant learning rate."""
    total_steps = max(total_steps, 1)
    if optim_cfg.schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    if optim_cfg.schedule == "onecycle":
        warmup = optim_cfg.warmup_fraction
        if total_steps >= 3:  # OneCycleLR divides by each phase's length in steps: keep both >= 1 step
            warmup = min(max(warmup, 2 / total_steps), (total_steps - 1) / total_steps)
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=optim_cfg.lr, total_steps=total_steps, pct_start=warmup,
        )
    return None
