"""Range and name checks the schema's types cannot express; each error names its key."""

import math
import re
from dataclasses import dataclass
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from orchestrator.config import names, optim, workers
from orchestrator.config.imports import is_import_path
from orchestrator.errors import BadInput
from orchestrator.precision import float8
from orchestrator.precision.dtypes import parse_dtype
from orchestrator.precision.policy import Policy

LINT_LEVELS = ("error", "warn", "off")
ON_COLLAPSE = ("abort", "rollback", "promote")
ON_NAN_LOSS = ("abort", "skip")
ON_NONFINITE_GRADS = ("skip", "fail", "warn")
LOADERS = ("auto", "dataloader", "device")
OPTIM_IMPLEMENTATIONS = ("auto", "foreach", "fused", "for_loop")
COMM_HOOKS = ("none", "fp16", "bf16")
STRATEGIES = ("ddp", "fsdp")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager", "cudagraphs")
WORKER_OUTPUT = ("rank0", "all", "none")
TUNE_TARGETS = ("h100", "a100", "cpu")
TUNE_DTYPES = ("float16", "bfloat16", "float8")
# A run name becomes a directory under checkpoint.storage_path: no '/', no '..', nothing hidden.
RUN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class Seconds:
    """The range of a duration key (`..._s`): finite, above `low` (or from it, `from_low`), at most `high`."""

    high: float
    """The upper bound, stated in the key's doc line: a wait past it is a mistake, and 1e300 or infinity would
    overflow the timer or `timedelta` it is given (on SIGTERM the preemption timer raised OverflowError)."""
    low: float = 0.0
    from_low: bool = False
    """`low` itself is allowed (>=), else only what is above it (>)."""
    zero: Optional[str] = None
    """What 0 means where it is allowed below `low` (`off`); None: it is not."""
    null: Optional[str] = None
    """What null means where it is allowed; None: it is not (the schema's type refuses it first)."""

    def problem(self, value: Optional[float]) -> Optional[str]:
        """What is wrong with `value` (NaN, infinite, out of range), or None."""
        if value is None and self.null is not None:
            return None
        if value == 0 and self.zero is not None:
            return None
        if value is not None and math.isfinite(value) and (value >= self.low if self.from_low else value > self.low) \
                and value <= self.high:
            return None
        return f"must be {self.describe()}, got {value}."

    def describe(self) -> str:
        """`a finite number of seconds > 0 and at most 86,400 (a day), or null for ...`."""
        text = (f"{'0 (' + self.zero + ') or ' if self.zero else ''}a finite number of seconds "
                f"{'>=' if self.from_low else '>'} {self.low:g} and at most {self.high:,g}{_NAMED.get(self.high, '')}")
        return text + (f", or null for {self.null}" if self.null else "")


ONE_HOUR_S = 3600.0
ONE_DAY_S = 86400.0
_NAMED = {ONE_HOUR_S: " (an hour)", ONE_DAY_S: " (a day)"}

DURATIONS = {
    "scaling.resize_check_s": Seconds(ONE_DAY_S),
    "tracking.flush_timeout_s": Seconds(ONE_DAY_S, from_low=True),
    "tracking.system_metrics_interval_s": Seconds(ONE_HOUR_S, low=0.1, from_low=True, zero="off"),
    "failure.step_timeout_s": Seconds(ONE_DAY_S, null="no watchdog"),
    "failure.preemption_grace_s": Seconds(ONE_HOUR_S, null="SIGTERM to end a worker at once"),
}
"""Every duration key of the schema (its name ends in `_s`) and its range; each is checked by `Seconds.problem`."""


def _require(ok: bool, source: str, key: str, message: str) -> None:
    if not ok:
        raise BadInput(f"{source}: {key}: {message}")


def validate(cfg: DictConfig, source: str) -> None:
    r = lambda ok, key, msg: _require(ok, source, key, msg)  # noqa: E731

    wrong = workers.problem(cfg.scaling.num_workers, cfg.run.batch_size, cfg.run.accumulate_steps)
    r(wrong is None, "scaling.num_workers", str(wrong))
    for key, seconds in DURATIONS.items():
        wrong = seconds.problem(OmegaConf.select(cfg, key))
        r(wrong is None, key, str(wrong))
    for name, amount in cfg.scaling.resources_per_worker.items():
        r(amount >= 0, f"scaling.resources_per_worker.{name}", f"must be >= 0, got {amount}.")
    r(cfg.model.num_classes >= 1, "model.num_classes", f"must be >= 1, got {cfg.model.num_classes}.")
    name = cfg.run.name
    r(name is None or RUN_NAME.fullmatch(name) is not None, "run.name",
      f"'{name}' is not a safe run name: use only letters, digits, '.', '_' and '-', and it must not start "
      "with '.' (the name becomes a directory under checkpoint.storage_path).")
    r(cfg.run.epochs >= 1, "run.epochs", f"must be >= 1, got {cfg.run.epochs}.")
    r(cfg.run.batch_size >= 1, "run.batch_size", f"must be >= 1, got {cfg.run.batch_size}.")
    r(cfg.run.eval_every_n_epochs >= 1, "run.eval_every_n_epochs", "must be >= 1.")
    every = cfg.run.eval_every_n_steps
    r(every is None or every >= 1, "run.eval_every_n_steps", f"must be >= 1 or null, got {every}.")
    steps = cfg.run.max_steps_per_epoch
    r(steps is None or steps >= 1, "run.max_steps_per_epoch", f"must be >= 1 or null, got {steps}.")

    _validate_tune(cfg.tune, r)
    for i, rule in enumerate(cfg.precision.rules):
        r(rule.scaling in float8.SCALINGS, f"precision.rules[{i}].scaling",
          f"unknown scaling '{rule.scaling}'. Use one of {', '.join(float8.SCALINGS)}.")
        if rule.dtype == float8.FLOAT8:
            reason = float8.unavailable()
            r(reason is None, f"precision.rules[{i}].dtype", f"{reason}.")

    lr = cfg.optim.lr
    r(0 <= cfg.task.label_smoothing < 1, "task.label_smoothing", f"must be in [0, 1), got {cfg.task.label_smoothing}.")
    r(math.isfinite(lr) and lr >= 0, "optim.lr", f"must be a finite number >= 0, got {lr}.")
    r(len(cfg.optim.betas) == 2, "optim.betas", "must be a list of two numbers [beta1, beta2].")

    r(cfg.optim.implementation in OPTIM_IMPLEMENTATIONS, "optim.implementation",
      f"unknown implementation '{cfg.optim.implementation}'. Use one of {', '.join(OPTIM_IMPLEMENTATIONS)}.")
    r(cfg.data.loader in LOADERS, "data.loader", f"unknown loader '{cfg.data.loader}'. Use one of {', '.join(LOADERS)}.")
    r(cfg.data.loader != "device" or cfg.data.loader_workers == 0, "data.loader_workers",
      "must be 0 with data.loader: device (the data is already on the device; there is nothing for "
      "loader processes to do).")
    for key, given in (("data.collate", cfg.data.collate is not None), ("task.inputs", bool(cfg.task.inputs)),
                       ("task.target", cfg.task.target is not None)):
        r(cfg.data.loader != "device" or not given, "data.loader",
          f"device slices (inputs, targets) tensors out of a dataset held on the device, so it takes no {key}: use "
          "data.loader: dataloader for batches a collate function makes or batches of named parts.")
    transforms = cfg.data.transforms
    r((transforms.mean is None) == (transforms.std is None)
      and (transforms.mean is None or len(transforms.mean) == len(transforms.std)), "data.transforms",
      "mean and std go together, one value per channel each.")
    shape = list(cfg.data.synthetic_shape)
    r(len(shape) >= 1 and all(d >= 1 for d in shape), "data.synthetic_shape",
      f"must be a list of sizes >= 1 (e.g. [3, 32, 32]), got {shape}.")
    _check_strategy(cfg, r)
    r(cfg.ddp.bucket_cap_mb > 0, "ddp.bucket_cap_mb", f"must be > 0 MiB, got {cfg.ddp.bucket_cap_mb}.")
    r(cfg.ddp.comm_hook in COMM_HOOKS, "ddp.comm_hook", f"unknown hook '{cfg.ddp.comm_hook}'. Use one of {', '.join(COMM_HOOKS)}.")
    peak = cfg.perf.peak_tflops
    r(peak is None or (math.isfinite(peak) and peak > 0), "perf.peak_tflops",
      f"must be a device's peak TFLOP/s, a finite number > 0 (an H100 SXM's bf16: 989.4), got {peak}.")
    r(cfg.perf.compile_backend in COMPILE_BACKENDS, "perf.compile_backend",
      f"unknown backend '{cfg.perf.compile_backend}'. Use one of {', '.join(COMPILE_BACKENDS)}.")

    try:  # these raise BadInput naming their key; add the file
        Policy.from_config(cfg.precision)
        parse_dtype(cfg.precision.reduce_dtype, "precision.reduce_dtype")
        names.check_dataset_name(cfg.data.name)
        names.check_model_name(cfg.model.name)
        names.check_task(cfg.task)
        names.check_collate(cfg.data.collate)
        optim.check(cfg.optim)
        names.check_callbacks(cfg.callbacks)
    except BadInput as exc:
        raise BadInput(f"{source}: {exc}") from None

    r(cfg.precision.lint in LINT_LEVELS, "precision.lint", f"must be one of {', '.join(LINT_LEVELS)}.")
    guard = cfg.precision.scaler
    r(guard.on_collapse in ON_COLLAPSE, "precision.scaler.on_collapse", f"must be one of {', '.join(ON_COLLAPSE)}.")
    r(guard.on_nan_loss in ON_NAN_LOSS, "precision.scaler.on_nan_loss", f"must be one of {', '.join(ON_NAN_LOSS)}.")
    r(cfg.precision.on_nonfinite_grads in ON_NONFINITE_GRADS, "precision.on_nonfinite_grads",
      f"must be one of {', '.join(ON_NONFINITE_GRADS)}.")
    r(guard.min_scale is None or (math.isfinite(guard.min_scale) and guard.min_scale >= 0),
      "precision.scaler.min_scale", f"must be a finite number >= 0, or null to disable, got {guard.min_scale}.")
    r(guard.max_consecutive_skips is None or guard.max_consecutive_skips >= 0,
      "precision.scaler.max_consecutive_skips", "must be >= 0, or null to disable.")
    clip = cfg.optim.clip_grad_norm
    r(clip is None or (math.isfinite(clip) and clip > 0), "optim.clip_grad_norm",
      f"must be a finite number > 0, or null for no clipping, got {clip}.")
    r(cfg.run.accumulate_steps >= 1, "run.accumulate_steps", f"must be >= 1, got {cfg.run.accumulate_steps}.")
    r(cfg.run.worker_output in WORKER_OUTPUT, "run.worker_output",
      f"must be one of {', '.join(WORKER_OUTPUT)}, got '{cfg.run.worker_output}'.")
    stopping = cfg.run.early_stopping
    if stopping is not None:
        r(stopping.metric.startswith("eval/"), "run.early_stopping.metric",
          f"'{stopping.metric}' is not an evaluation metric: use eval/loss or eval/<one of task.metrics>.")
        r(stopping.mode in ("min", "max"), "run.early_stopping.mode", f"must be min or max, got '{stopping.mode}'.")
        r(stopping.patience >= 1, "run.early_stopping.patience", f"must be >= 1 evaluation, got {stopping.patience}.")
        r(math.isfinite(stopping.min_delta) and stopping.min_delta >= 0, "run.early_stopping.min_delta",
          f"must be a finite number >= 0, got {stopping.min_delta}.")
    score = cfg.checkpoint.score_metric
    r(score is None or score.startswith("eval/"), "checkpoint.score_metric",
      f"'{score}' is not an evaluation metric: use eval/loss or eval/<one of task.metrics>.")
    r(cfg.checkpoint.score_mode in ("min", "max"), "checkpoint.score_mode",
      f"must be min or max, got '{cfg.checkpoint.score_mode}'.")
    every = cfg.checkpoint.every_n_steps
    r(every is None or every >= 1, "checkpoint.every_n_steps", f"must be >= 1 or null, got {every}.")
    export_dtype = cfg.export.dtype
    r(export_dtype in (None, "float16", "bfloat16"), "export.dtype", "must be float16, bfloat16 or null.")
    r(cfg.export.max_accuracy_drop >= 0, "export.max_accuracy_drop", "must be >= 0 (0.01 = one point).")
    # Class scores: cross-entropy's outputs, or your own loss's when you evaluate accuracy on them.
    scores = cfg.task.loss in names.CLASSIFICATION_LOSSES or (
        (is_import_path(cfg.task.loss) or cfg.task.loss == "model")
        and "accuracy" in [metric.name for metric in cfg.task.metrics])
    r(export_dtype is None or scores, "export.dtype",
      f"the export is checked by its accuracy drop, which needs class scores; task.loss is '{cfg.task.loss}'. "
      "Leave export.dtype null for this task (with a classification loss of your own, add 'accuracy' to "
      "task.metrics).")
    r(cfg.tracking.log_every_n_steps >= 1, "tracking.log_every_n_steps", "must be >= 1.")
    r(cfg.checkpoint.every_n_epochs >= 1, "checkpoint.every_n_epochs", "must be >= 1.")
    r(cfg.checkpoint.num_to_keep >= 1, "checkpoint.num_to_keep", "must be >= 1.")
    r(cfg.failure.max_failures >= -1, "failure.max_failures", "must be >= 0, or -1 for unlimited.")


def _check_strategy(cfg: DictConfig, r) -> None:
    """`scaling.strategy` and what goes with it; what needs the model (the FSDP units) is pre-flight's."""
    strategy = cfg.scaling.strategy
    r(strategy in STRATEGIES, "scaling.strategy", f"unknown strategy '{strategy}'. Use one of {', '.join(STRATEGIES)}.")
    for index, glob in enumerate(cfg.scaling.fsdp.wrap):
        r(isinstance(glob, str) and glob.strip() != "", f"scaling.fsdp.wrap[{index}]",
          "must be a glob on a module's class name (e.g. 'Block') or qualified name (e.g. 'layers.*'), not empty.")
    r(strategy != "fsdp" or cfg.ddp.comm_hook == "none", "ddp.comm_hook",
      f"'{cfg.ddp.comm_hook}' compresses DDP's all-reduce, which scaling.strategy fsdp does not use: FSDP "
      "reduce-scatters gradients in precision.reduce_dtype. Set ddp.comm_hook: none (and precision.reduce_dtype: "
      "bfloat16 to halve the bytes sent).")
    r(strategy != "fsdp" or not cfg.perf.channels_last, "perf.channels_last",
      "torch's FSDP2 shards contiguous parameters only, and channels-last convolution weights are not: with "
      "scaling.strategy fsdp set perf.channels_last: false.")


def _validate_tune(tune, r) -> None:
    r(tune.target is None or tune.target in TUNE_TARGETS, "tune.target",
      f"unknown target '{tune.target}'. Use one of {', '.join(TUNE_TARGETS)}, or null to measure on this device.")
    r(math.isfinite(tune.tolerance) and tune.tolerance > 0, "tune.tolerance",
      f"must be a number > 0 (a relative error, e.g. 0.05), got {tune.tolerance}.")
    unknown = [name for name in tune.candidates if name not in TUNE_DTYPES]
    r(not unknown and len(tune.candidates) > 0, "tune.candidates",
      f"{unknown or 'empty'}: list one or more of {', '.join(TUNE_DTYPES)}.")
    r(tune.batches >= 1, "tune.batches", f"must be >= 1, got {tune.batches}.")
    r(tune.validate_steps >= 0, "tune.validate_steps", f"must be >= 0, got {tune.validate_steps}.")
    r(tune.max_rounds >= 0, "tune.max_rounds", f"must be >= 0, got {tune.max_rounds}.")
