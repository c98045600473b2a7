"""The job schema: one typed dataclass per section, a doc line under each field.

OmegaConf turns these into a strict structured config, so an unknown key or a
value of the wrong type fails while loading, before Ray or MLflow is touched.
Range checks that types cannot express live in `orchestrator.config.validate`.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING


@dataclass
class ModelSection:
    name: str = MISSING
    """Registry name (`simple_cnn`, `resnet18`, `three_conv`, `transformer_lm`) or an import path
    `package.module:Name`."""
    num_classes: int = 10
    """Size of the classifier's output layer (>= 1)."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed to the model's constructor."""


@dataclass
class TransformsSection:
    grayscale: bool = False
    """Convert images to one channel (ImageFolder reads every image as RGB)."""
    resize: Optional[int] = None
    """Resize images so the shorter side is this many pixels (null: as they are)."""
    crop: Optional[int] = None
    """Crop to this square size: a random crop for training (with `data.augment`), the centre for evaluation."""
    crop_padding: int = 0
    """Pixels of padding around a random training crop (4 with crop 32 is CIFAR's recipe)."""
    flip: bool = False
    """Random horizontal flips for training (with `data.augment`)."""
    mean: Optional[List[float]] = None
    """Per-channel mean to normalise with (with `std`); null: no normalisation."""
    std: Optional[List[float]] = None
    """Per-channel standard deviation to normalise with."""


@dataclass
class DataSection:
    name: str = MISSING
    """Dataset: `cifar10` (torchvision, with CIFAR's own recipe), `digits` (scikit-learn, offline), `synthetic`,
    `lm_text` (English text in blocks of token ids for a causal LM, offline; its settings in `kwargs`: docs/lm.md),
    a torchvision dataset by name (`MNIST`, `FashionMNIST`, `CIFAR100`, `SVHN`, ...), `ImageFolder` (over
    `root/train` and `root/val`), or an import path `package.module:factory` to your own function returning
    (train dataset, eval dataset)."""
    root: str = "data"
    """Where datasets are stored or downloaded to; relative paths are taken from submit's directory."""
    download: bool = True
    """Download CIFAR-10 into `root` when it is not there yet (needs internet)."""
    augment: bool = True
    """Training augmentation (random crop + horizontal flip for CIFAR-10)."""
    loader_workers: int = 0
    """DataLoader worker processes per Ray worker (0 loads in the training process)."""
    synthetic_samples: int = 4096
    """Number of training samples for `synthetic` (throughput runs only): 4096 distinct random ones, repeated."""
    synthetic_shape: List[int] = field(default_factory=lambda: [3, 32, 32])
    """Shape of one `synthetic` sample (channels, height, width, or any other); CIFAR's by default."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for an import-path dataset factory, or `lm_text`'s settings (`path`, `tokenizer`,
    `vocab_size`, `block_size`, `eval_fraction`)."""
    transforms: TransformsSection = field(default_factory=TransformsSection)
    """Image transforms for torchvision datasets and ImageFolder (ToTensor always)."""
    loader: str = "auto"
    """`auto` (`device` on a CUDA device for a dataset of (inputs, targets) tensors taking at most a quarter of the
    free device memory, with no loader processes, collate function or named inputs; `dataloader` otherwise),
    `dataloader` (torch DataLoader, `loader_workers` processes) or `device`: the whole dataset resident on the
    worker's device, each rank taking its shard, augmentation on the device, no loader processes. `device` holds
    (inputs, targets) tensors of any dtype (a TensorDataset, the built-in datasets); samples that need a collate
    function (`data.collate`) or a batch of named parts (`task.inputs`) need `dataloader`."""
    collate: Optional[str] = None
    """Import path `package.module:fn` to the collate function that turns a list of samples into a batch (e.g.
    padding variable-length sequences), for the training and evaluation loaders and pre-flight; null: each
    dataset's own `collate_fn` attribute when it has one, else torch's default_collate."""


@dataclass
class MetricSection:
    name: str = MISSING
    """`accuracy`, `top5`, `token_accuracy` (per-token outputs; targets of `-100` ignored), an import path to your own function `fn(outputs, targets) -> {name: (sum, count)}`, or
    to a torchmetrics.Metric class (`torchmetrics.classification:MulticlassF1Score`)."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for a torchmetrics Metric's constructor (`{num_classes: 4, average: macro}`)."""
    log_as: Optional[str] = None
    """A torchmetrics Metric is logged as `eval/<log_as>`; null: its class name in snake case
    (`MulticlassF1Score` -> `eval/multiclass_f1_score`). A function's names are the keys it returns."""


@dataclass
class TaskSection:
    loss: str = "cross_entropy"
    """`cross_entropy` (classification), `mse`, `bce_with_logits`, `next_token` (a causal language model's: the
    logits [N, T, vocab] at each position against the next position's label, -100 ignored), `model` (the loss the
    model returns, its outputs' `loss`: the model is given the targets as well, under `task.target`'s name or
    `labels`, as Hugging Face models take them), or an import path `package.module:fn` to your own
    `fn(outputs, targets) -> loss` (the batch mean)."""
    label_smoothing: float = 0.0
    """Label smoothing of `cross_entropy` (0: none)."""
    metrics: List[MetricSection] = field(default_factory=lambda: [MetricSection(name="accuracy")])
    """Evaluation metrics, logged as `eval/<name>`: `accuracy`, `top5`, `token_accuracy`, `perplexity` (exp of
    `eval/loss`), import paths to your own `fn(outputs, targets) -> {name: (sum, count)}` (summed over batches and
    ranks), or `{name: <torchmetrics Metric class>, kwargs: {...}}` (updated per batch, computed over all ranks by
    torchmetrics). A bare string is `{name: ...}`."""
    inputs: List[str] = field(default_factory=list)
    """The parts of a batch the model takes, by key (a dict batch), attribute (a dataclass or named tuple) or
    index (a tuple): named ones are passed as keyword arguments (`model(input_ids=..., attention_mask=...)`),
    indices positionally. Empty: a batch is `(inputs, targets)` (inputs a tensor, a tuple of positional inputs or
    a dict of keyword inputs), or, with `task.target` set, every part of the batch but the target."""
    target: Optional[str] = None
    """The part of a batch the loss and metrics compare the outputs with (`labels`, or an index); null: batches are
    `(inputs, targets)` pairs."""
    output: Optional[str] = None
    """The part of the model's outputs that is its prediction, for the built-in losses and metrics, torchmetrics,
    export and predict: a key (a dict, a Hugging Face `ModelOutput`), an attribute or an index (a tuple); null:
    `logits` where the outputs have it, else the outputs as they are."""


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


@dataclass
class RuleSection:
    match: str = MISSING
    """Glob matched against a module's class name (`BatchNorm*`) or qualified name (`layer1.*`, `fc*`)."""
    dtype: str = MISSING
    """What the matched layer stores its parameters in and computes in: float32, float16 or bfloat16; or float8
    (Linear layers: fp32 parameters, matmuls in float8 through torchao's Float8Linear; needs torchao, and a GPU
    with float8 tensor cores or the CPU's emulation)."""
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
    reduce_dtype: str = "float32"
    """Under `scaling.strategy: fsdp`: the dtype gradients are reduce-scattered in (`float32`, `bfloat16` or
    `float16`); each rank's gradient shard is then kept in its parameters' storage dtype. DDP reduces each gradient
    in its parameter's dtype (see `ddp.comm_hook`)."""


@dataclass
class ExportSection:
    dtype: Optional[str] = None
    """After training, export the model in this dtype (`float16` or `bfloat16`); None: no export."""
    max_accuracy_drop: float = 0.01
    """Refuse the export when its eval accuracy is lower than fp32's by more than this (0.01 = 1 point)."""


@dataclass
class CallbackSection:
    name: str = MISSING
    """Import path `package.module:Class` of an object with any of the training loop's hook methods
    (`setup`, `before_step`, `after_backward`, `after_step`, `end_epoch`, `collect`, `on_checkpoint`,
    `state_dict`/`load_state_dict`, `teardown`; see docs/own-code.md)."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for its constructor."""


@dataclass
class FsdpSection:
    """How `scaling.strategy: fsdp` splits the model into units (each gathered, reduced and stored as one group)."""

    wrap: List[str] = field(default_factory=list)
    """Globs on a module's class name (`Block`) or qualified name (`layers.*`) naming the modules that become FSDP
    units (each glob the outermost modules it matches); empty: the model's own `fsdp_units` (an attribute or method
    listing qualified names), else each direct child holding parameters. A module a precision rule gives another
    dtype than its unit's becomes a unit too; the root always is."""


@dataclass
class ScalingSection:
    num_workers: Any = 2
    """Ray Train workers (DDP ranks): a number, or an elastic range `[min, max]`: the run starts with as many as
    the cluster has room for (at least min), shrinks when a node goes and grows when one joins, each time going on
    from the newest checkpoint, with the same global batch (`run.batch_size x run.accumulate_steps x max`). At most
    100,000 workers."""
    resize_check_s: float = 60.0
    """An elastic run (`num_workers: [min, max]`) looks this often whether more workers fit, and grows when they do
    (Ray Train's `elastic_resize_monitor_interval_s`). Seconds, > 0 and at most 86,400 (a day)."""
    use_gpu: bool = False
    """Give each worker one GPU (NCCL backend); CPU workers use gloo."""
    resources_per_worker: Dict[str, float] = field(default_factory=dict)
    """Ray resources per worker, e.g. {CPU: 4, GPU: 1}; empty means Ray Train's default (1 CPU, plus 1 GPU with use_gpu)."""
    strategy: str = "ddp"
    """`ddp`: every rank holds the whole model, its gradients and optimizer state (DistributedDataParallel).
    `fsdp`: each rank holds a shard of them (FSDP2 `fully_shard`), each unit with the precision policy's dtypes."""
    fsdp: FsdpSection = field(default_factory=FsdpSection)
    """FSDP units (with `strategy: fsdp`)."""


@dataclass
class DdpSection:
    """Knobs of torch's DistributedDataParallel (used when there is more than one worker)."""

    bucket_cap_mb: float = 25.0
    """Gradients are all-reduced in buckets of about this many MiB, overlapping backward."""
    gradient_as_bucket_view: bool = False
    """Gradients are views into the all-reduce buckets: saves one gradient-sized copy of memory."""
    static_graph: bool = False
    """The model uses the same parameters every step: DDP may skip per-step bookkeeping."""
    find_unused_parameters: bool = False
    """Needed only by models whose forward leaves some parameters out; costs a graph traversal per step."""
    comm_hook: str = "none"
    """Gradient compression for the all-reduce: `none`, `fp16` or `bf16` (halves the bytes sent; gradients
    are rounded to that dtype for the exchange, then restored to their own dtype)."""


@dataclass
class PerfSection:
    """Execution switches that change speed, not the maths (see docs/performance.md)."""

    channels_last: Optional[bool] = None
    """Store 4-D activations and conv weights as NHWC (faster convolutions on tensor cores). null: on for a model
    with 2-D convolutions on a CUDA device (not under FSDP), off elsewhere."""
    cudnn_benchmark: Optional[bool] = None
    """cuDNN times its convolution algorithms once per input shape and keeps the fastest (torch.backends.cudnn
    .benchmark). null: on for a CUDA device."""
    pinned_transfers: bool = True
    """On a CUDA device, a DataLoader's batches are pinned in host memory and copied to the device without
    blocking (false: pageable memory, blocking copies)."""
    compile: bool = False
    """Compile the model with torch.compile (slower first steps, faster steady state)."""
    compile_backend: str = "inductor"
    """torch.compile backend (`inductor`; `aot_eager` or `eager` to debug)."""
    compile_mode: Optional[str] = None
    """torch.compile mode (`default`, `reduce-overhead`, `max-autotune`); null is torch's default."""
    peak_tflops: Optional[float] = None
    """The peak dense TFLOP/s of one device for the run's dtypes, which `perf/mfu` divides by. null: ampflow's
    table of peaks (H100, H200, A100, L4, L40S by fp8/bf16/fp16/tf32/fp32; docs/telemetry.md); on a device not in
    it, and on a CPU, `perf/mfu` is not logged unless this is set."""
    keep_freed_memory: bool = True
    """Ray Train workers (and the Ray-free loop's ranks) start with glibc malloc keeping freed memory
    (`MALLOC_MMAP_THRESHOLD_` 32 MiB, `MALLOC_TRIM_THRESHOLD_` 4 GiB, unless the driver's environment sets them):
    each step's activations reuse pages instead of faulting fresh ones in (measured on CPUs: 50,000-100,000 page
    faults/s per worker, up to a quarter of a step). A worker's resident memory then stays at its peak."""


@dataclass
class EarlyStoppingSection:
    metric: str = "eval/loss"
    """The evaluation metric watched (`eval/loss`, `eval/accuracy`)."""
    mode: str = "min"
    """`min`: lower is better; `max`: higher is better."""
    patience: int = 3
    """Evaluations in a row without improvement after which training stops."""
    min_delta: float = 0.0
    """The least change that counts as an improvement."""


@dataclass
class RunSection:
    name: Optional[str] = None
    """Name of the Ray Train run and the MLflow run; defaults to `<job file stem>-<timestamp>`.
    Letters, digits, `.`, `_`, `-`, not starting with `.`: it names a directory under `checkpoint.storage_path`."""
    epochs: int = 1
    """Passes over the training set."""
    batch_size: int = 64
    """Batch size per worker (the global batch is this times num_workers, times `accumulate_steps`; elastic, times
    the range's max)."""
    seed: int = 0
    """Base seed; rank r seeds its RNGs with seed + r."""
    eval_every_n_epochs: int = 1
    """Evaluate on the held-out split every N epochs (and always after the last)."""
    eval_every_n_steps: Optional[int] = None
    """Also evaluate every N optimizer steps, mid-epoch included, logged with that step's report (Lightning's
    `val_check_interval`); a checkpoint taken at that step is scored by it (`checkpoint.score_metric`). Early
    stopping watches the evaluations at epoch ends. Null: at epoch ends only."""
    max_steps_per_epoch: Optional[int] = None
    """Stop each epoch after this many steps (for smoke runs); None trains on the whole shard."""
    freeze_norm: bool = False
    """Keep every normalisation layer in eval mode for the whole run (running statistics frozen, as when
    fine-tuning), under every preset, resume included."""
    accumulate_steps: int = 1
    """Micro-batches of `batch_size` per optimizer step (gradient accumulation): DDP syncs gradients on the last
    only, the loss scale is updated once per step. Effective batch: batch_size x accumulate_steps x num_workers (elastic:
    its max, whatever the workers now);
    steps, `max_steps_per_epoch` and checkpoints count optimizer steps."""
    worker_output: str = "rank0"
    """What the user's code prints on the workers (stdout, stderr) reaches the console, each line prefixed by its
    rank: `rank0` (rank 0's only), `all`, or `none` (kept in Ray's worker logs only)."""
    early_stopping: Optional[EarlyStoppingSection] = None
    """Stop when an evaluation metric stops improving (null: train all `epochs`)."""


@dataclass
class TrackingSection:
    uri: Optional[str] = None
    """MLflow tracking URI; else $MLFLOW_TRACKING_URI; else sqlite:///<submit dir>/mlflow.db."""
    experiment: str = "ampflow"
    """MLflow experiment the run is created in."""
    log_every_n_steps: int = 10
    """Report training metrics (and update the progress line) every N optimizer steps."""
    log_model: bool = True
    """Log the final fp32 model with mlflow.pytorch.log_model."""
    required: bool = True
    """MLflow must be reachable at the start (else exit 2); false: train anyway and log once it is back."""
    flush_timeout_s: float = 120.0
    """At the end, how long to keep retrying metrics MLflow has not taken yet before giving up on them. Seconds, >= 0
    and at most 86,400 (a day)."""
    system_metrics_interval_s: float = 10.0
    """Sample each rank's CPU %, resident memory and (CUDA) GPU utilisation, memory and power every N seconds,
    logged as MLflow system metrics `system/rank_<r>/...`; 0 turns it off. Else >= 0.1 and at most 3,600 (an
    hour)."""
    register_model: Optional[str] = None
    """Register the logged model as a new version of this registered model (tagged with the preset, the run
    and its final metrics); a registry that refuses is a warning, never a failed run. Null: not registered."""


@dataclass
class CheckpointSection:
    every_n_epochs: int = 1
    """Save a checkpoint every N epochs (and always after the last)."""
    every_n_steps: Optional[int] = None
    """Also save one every N optimizer steps, mid-epoch included (null: only at epoch ends)."""
    num_to_keep: int = 2
    """Newest checkpoints kept in storage."""
    storage_path: Optional[str] = None
    """Ray Train storage (local dir or URI); defaults to <submit dir>/ray_results."""
    score_metric: Optional[str] = None
    """Keep and log the best checkpoint by this evaluation metric (`eval/loss`, `eval/<metric>`), not the newest:
    the `num_to_keep` best of the checkpoints taken with an evaluation are kept, and always the newest, to resume
    from (a checkpoint without an evaluation, mid-epoch or between `run.eval_every_n_epochs`, is kept only while
    it is the newest); the logged model is the best one. Null: the newest checkpoints are kept and the final
    model is logged."""
    score_mode: str = "max"
    """`max`: a higher `score_metric` is better; `min`: lower is better."""


@dataclass
class FailureSection:
    max_failures: int = 0
    """Worker-group restarts Ray Train may do before the job fails (-1: unlimited)."""
    step_timeout_s: Optional[float] = 600.0
    """Seconds a rank may go without finishing a step (or an evaluation, or staging a checkpoint) before its
    watchdog saves every thread's stack to `diagnostics/stacks/` and ends the attempt (a worker failure, which
    `max_failures` retries); the collective timeout is this plus 60 s. At most 86,400 (a day). null: no watchdog,
    and torch's collective timeout (30 min) stays."""
    preemption_grace_s: Optional[float] = 25.0
    """Seconds a Ray Train worker has, after a SIGTERM (Kubernetes' eviction notice), to checkpoint at the next
    step boundary and end its attempt, which Ray Train restarts from that checkpoint (`max_failures`); then it
    exits. Keep it under the pods' `terminationGracePeriodSeconds` (k8s/: 30 s), after which Kubernetes kills; at
    most 3,600 (an hour). null: SIGTERM ends a worker at once, as in Ray."""


@dataclass
class TuneSection:
    target: Optional[str] = None
    """The device the policy is planned for (`ampflow tune`): `h100`, `a100` or `cpu`, whose costs come from a model
    (each layer's FLOPs and bytes over that device's rates); null: each layer's cost is measured on the device at
    hand."""
    tolerance: float = 0.05
    """The relative error the chosen policy may add: to the model's output and to its gradients (predicted as the
    root sum of squares of the lowered layers' errors), and to the validation run's loss against fp32."""
    candidates: List[str] = field(default_factory=lambda: ["float16", "bfloat16", "float8"])
    """The dtypes each layer with parameters is tried in (fp32 is always the fallback); float8 for Linear layers
    only, where torchao is installed and the device has float8 matmuls (or `emulate_float8`)."""
    emulate_float8: bool = False
    """Probe float8 on a device without float8 matmuls (the CPU, a GPU before compute capability 8.9) through
    emulation: its errors are float8's, its measured cost is not (plan with `target`)."""
    batches: int = 2
    """Batches of the job's training data the probe runs (each layer and dtype is measured on all of them)."""
    validate_steps: int = 20
    """Optimizer steps of the validation run: the chosen policy beside fp32, from the same seed, on the same
    batches (0: no validation)."""
    max_rounds: int = 5
    """How many times a failed validation may move the riskiest lowered layer up one dtype and check again."""


@dataclass
class JobConfig:
    model: ModelSection = field(default_factory=ModelSection)
    """What to train."""
    data: DataSection = field(default_factory=DataSection)
    """What to train on."""
    task: TaskSection = field(default_factory=TaskSection)
    """The loss trained on and the metrics evaluated."""
    optim: OptimSection = field(default_factory=OptimSection)
    """Optimizer and learning-rate schedule."""
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    """Autocast dtype and loss scaling."""
    scaling: ScalingSection = field(default_factory=ScalingSection)
    """How many workers and what each gets."""
    ddp: DdpSection = field(default_factory=DdpSection)
    """DistributedDataParallel knobs: buckets, gradient views, static graph, gradient compression."""
    perf: PerfSection = field(default_factory=PerfSection)
    """Fast paths: channels_last, cudnn.benchmark, pinned transfers, torch.compile."""
    run: RunSection = field(default_factory=RunSection)
    """Epochs, batch size, seed, evaluation cadence."""
    tracking: TrackingSection = field(default_factory=TrackingSection)
    """Where the MLflow run goes."""
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    """When checkpoints are written and where."""
    failure: FailureSection = field(default_factory=FailureSection)
    """How many worker failures are retried, and how long a rank may make no progress."""
    export: ExportSection = field(default_factory=ExportSection)
    """Half-precision export of the trained model for deployment."""
    tune: TuneSection = field(default_factory=TuneSection)
    """How `ampflow tune` chooses a per-layer precision policy for this job."""
    callbacks: List[CallbackSection] = field(default_factory=list)
    """Your own code at points of training, run on every rank (or rank 0 alone, as a callback declares), after
    the built-in hooks: `package.module:Class` or `{name: package.module:Class, kwargs: {...}}`."""
