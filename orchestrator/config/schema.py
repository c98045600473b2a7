"""The job schema: one typed dataclass per section (`orchestrator.config.sections`), a doc line under each field.

OmegaConf turns these into a strict structured config, so an unknown key or a
value of the wrong type fails while loading, before Ray or MLflow is touched.
Range checks that types cannot express live in `orchestrator.config.validate`.
"""

from dataclasses import dataclass, field
from typing import List

from orchestrator.config.sections.model_data import DataSection, ModelSection, TransformsSection
from orchestrator.config.sections.task import MetricSection, TaskSection
from orchestrator.config.sections.optim import OptimSection
from orchestrator.config.sections.precision import PrecisionSection, RuleSection, ScalerGuardSection
from orchestrator.config.sections.scaling import DdpSection, FsdpSection, PerfSection, ScalingSection
from orchestrator.config.sections.run import CallbackSection, EarlyStoppingSection, RunSection
from orchestrator.config.sections.outputs import CheckpointSection, ExportSection, FailureSection, TrackingSection
from orchestrator.config.sections.tune import TuneSection

__all__ = ["JobConfig", "CallbackSection", "CheckpointSection", "DataSection", "DdpSection", "EarlyStoppingSection",
           "ExportSection", "FailureSection", "FsdpSection", "MetricSection", "ModelSection", "OptimSection",
           "PerfSection", "PrecisionSection", "RuleSection", "RunSection", "ScalerGuardSection", "ScalingSection",
           "TaskSection", "TrackingSection", "TransformsSection", "TuneSection"]


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
