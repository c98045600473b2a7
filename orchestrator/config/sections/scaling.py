"""How the job is spread over workers and run fast: the `scaling` (workers, strategy, FSDP units), `ddp` and
`perf` sections."""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from orchestrator.config.strategies import DDP


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
    # An int >= 1 or [min, max]: declared Any and checked when the job is loaded (`config.workers.problem`), then
    # built once (`config.job.Job.workers`). Typed as a union, OmegaConf would refuse a wrong value at the merge with
    # its own type message instead of the one that names both forms.
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
    strategy: str = DDP.name
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
