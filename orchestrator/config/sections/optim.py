"""The `optim` section: the optimizer, its parameter groups and the learning-rate schedule."""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from orchestrator.config.strategies import DDP


@dataclass
class OptimSection:
    name: str = "sgd"
    """Optimizer: `sgd`, `adam`, `adamw`, or an import path `package.module:Class` to a torch.optim.Optimizer
    subclass (`torch.optim:RMSprop`, a third-party `Lion`), given `lr`, `weight_decay` (when it takes one), the
    `implementation` flag and `kwargs`."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """More keyword arguments for the optimizer's constructor (`{alpha: 0.9}` for RMSprop, `{amsgrad: true}` for
    Adam): checked against its signature before anything starts."""
    param_groups: List[Dict[str, Any]] = field(default_factory=list)
    """Parameter groups: `{match: GLOB, ...settings}` (e.g. `{match: '*.bias', weight_decay: 0}`, `{match:
    'backbone.*', lr: 1e-4}`). The glob is matched against each parameter's qualified name or the class name of
    the module holding it (`*Norm*` takes every BatchNorm, LayerNorm and GroupNorm parameter); the first group
    that matches takes the parameter; the rest keep the section's settings (group 0)."""
    lr: float = 0.05
    """Peak learning rate."""
    momentum: float = 0.9
    """SGD momentum (the built-in `sgd`; another optimizer's goes in `kwargs`)."""
    nesterov: bool = False
    """Use Nesterov momentum with SGD."""
    weight_decay: float = 5e-4
    """L2 penalty (SGD, Adam) or decoupled weight decay (AdamW)."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam/AdamW beta1, beta2 (the built-ins; another optimizer's go in `kwargs`)."""
    eps: float = 1e-8
    """Adam/AdamW epsilon."""
    schedule: str = "none"
    """Learning-rate schedule, stepped once per optimizer step taken: `none`, `cosine` (to 0 over the run),
    `onecycle`, or an import path to a torch.optim.lr_scheduler class (given `schedule_kwargs`, and `total_steps`
    when it takes one) or to a factory `(optimizer, total_steps, **schedule_kwargs) -> LRScheduler`."""
    schedule_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for an import-path schedule (`{step_size: 100, gamma: 0.5}` for StepLR)."""
    warmup_fraction: Optional[float] = None
    """Fraction of the run's optimizer steps spent warming up linearly to each group's `lr` before a built-in
    schedule (`none` then stays constant, `cosine` anneals over the rest); onecycle's own warmup (its
    `pct_start`, 0.25 when null). null: no warmup."""
    implementation: str = "auto"
    """Optimizer kernels: `auto` (the fused kernel for sgd, adam and adamw on a CUDA device under DDP, else torch's
    choice: foreach on accelerators), `foreach` (one kernel per op over all tensors), `fused` (one kernel per step;
    CUDA and CPU) or `for_loop` (one op per tensor)."""
    clip_grad_norm: Optional[float] = None
    """Clip the gradients to this total norm every step (null: no clipping): after the loss scale is taken out,
    on the fp32 masters where there are some, never on a step the scaler skips. `train/grad_norm` logs the norm
    before clipping."""
