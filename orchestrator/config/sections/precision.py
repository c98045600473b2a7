"""The `precision` section: the dtypes, the per-layer rules and loss scaling."""

from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import MISSING

from orchestrator.config.strategies import DDP


@dataclass
class RuleSection:
    match: str = MISSING
    """Glob matched against a module's class name (`BatchNorm*`) or qualified name (`layer1.*`, `fc*`)."""
    dtype: Optional[str] = None
    """What the matched layer stores its parameters in and computes in: float32, float16 or bfloat16; or float8
    (Linear layers: fp32 parameters, matmuls in float8 through torchao's Float8Linear; needs torchao, and a GPU
    with float8 tensor cores or the CPU's emulation). null: this rule decides no dtype (it only checkpoints or
    compiles); the layer's dtype comes from the next rule matching it, as if this one were not there."""
    checkpoint: Optional[str] = None
    """Activation checkpointing of each matched block: `full` (nothing inside the block is saved for backward but
    its inputs; its forward runs again in backward) or `selective` (the outputs of its matmuls and attention are
    saved, the cheap ops between them recomputed). null: none. The first rule matching a module that sets it
    decides; a block inside a checkpointed block is not checkpointed again."""
    compile: bool = False
    """Compile each matched block on its own (regional compilation, `module.compile()` with `perf.compile_backend`
    and `perf.compile_mode`): faster steps, with a first-step compile that does not grow with the depth of the
    model. A block inside a compiled block is not compiled again."""
    scaling: str = "tensorwise"
    """float8 rules: how the float8 casts are scaled, `tensorwise` (one scale per tensor; under FSDP2 the weights
    are all-gathered in float8) or `rowwise` (one per row: closer to bf16's accuracy, a little slower)."""


@dataclass
class ScalerGuardSection:
    min_scale: Optional[float] = 1.0
    """The loss scale has collapsed when it falls below this (null: never checked)."""
    max_consecutive_skips: Optional[int] = 25
    """The loss scale has collapsed after more consecutive skipped steps than this (null: never checked)."""
    on_collapse: str = "abort"
    """What a collapse does: `abort` (fail, naming the overflowing layers), `rollback` (restore the last
    checkpoint's weights, optimizer and scaler, and go on), `promote` (move the overflowing layers to fp32
    through the policy, and go on)."""
    on_nan_loss: str = "abort"
    """A non-finite loss (not a gradient overflow), found on any rank at its step: `abort`, or `skip` the step
    without backing off the scale (it counts toward `max_consecutive_skips`). The same decision on every rank."""


@dataclass
class PrecisionSection:
    preset: Optional[str] = None
    """A preset in configs/precision/ (O0..O3, bf16-mixed, bf16-true) or a Lightning alias (`16-mixed`)."""
    compute_dtype: str = "float32"
    """Autocast dtype: `float16`, `bfloat16`, or `float32` for no autocast."""
    param_dtype: str = "float32"
    """Storage dtype of parameters for layers no rule matches."""
    master_weights: bool = False
    """Keep fp32 copies of half parameters; the optimizer steps on those and copies back."""
    keep_norm_fp32: bool = False
    """Keep normalisation layers (BatchNorm, LayerNorm, GroupNorm) in fp32, after the rules (Apex's keep_batchnorm_fp32)."""
    rules: List[RuleSection] = field(default_factory=list)
    """Per-layer dtype rules; the first rule matching a module wins; a module without a match inherits its parent's."""
    autocast: Optional[bool] = None
    """Run the forward pass under torch.autocast in compute_dtype (torch picks the dtype per op); false: every
    layer computes in the dtype its parameters are stored in (Apex O2/O3, Lightning's *-true). null: on when
    compute_dtype is float16 or bfloat16."""
    loss_scale: str = "dynamic"
    """`dynamic` (GradScaler), `none`, or a fixed number; used whenever a gradient is float16 (fp16 autocast, or
    fp16 parameters)."""
    max_scale: float = 16777216.0
    """The dynamic loss scale never grows past this (2^24, as Apex)."""
    init_scale: float = 65536.0
    """GradScaler's initial scale."""
    growth_factor: float = 2.0
    """GradScaler multiplies the scale by this after `growth_interval` clean steps."""
    backoff_factor: float = 0.5
    """GradScaler multiplies the scale by this after a step with inf/nan gradients."""
    growth_interval: int = 2000
    """Clean steps between scale increases."""
    lint: str = "error"
    """What a dangerous combination found before training does: `error` (exit 2), `warn`, or `off`."""
    on_nonfinite_grads: str = "skip"
    """Without a GradScaler (fp32, bf16, `loss_scale: none`), gradients holding inf or nan, found on any rank:
    `skip` the step on every rank (it counts toward `scaler.max_consecutive_skips`), `fail` the run naming the
    layer, or `warn` and step anyway. Counted in `amp/nonfinite_grad_steps`; checked with one all-reduced flag
    per step, the skip decided on the device and the flag read late (docs/performance.md). With a GradScaler
    they are overflows: skipped, the scale backs off."""
    scaler: ScalerGuardSection = field(default_factory=ScalerGuardSection)
    """Guardrails on the loss scale and on non-finite losses."""
    float8_min_size: str = "auto"
    """Which Linear layers a `dtype: float8` rule leaves out as too small for float8 to gain (they compute as they
    would without the rule; the audit's `float8_skipped` and the console say why): `auto` applies torchao's
    measured H100 thresholds (dims multiples of 16, and K x N above a size per scaling) on GPUs with float8 tensor
    cores and skips nothing on the CPU's emulation; `torchao` applies them everywhere; `none` converts every layer
    the rules name."""
    reduce_dtype: str = "float32"
    """Under `scaling.strategy: fsdp`: the dtype gradients are reduce-scattered in (`float32`, `bfloat16` or
    `float16`); each rank's gradient shard is then kept in its parameters' storage dtype. DDP reduces each gradient
    in its parameter's dtype (see `ddp.comm_hook`)."""
