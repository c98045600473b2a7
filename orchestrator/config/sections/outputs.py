"""What a run keeps and how it survives failures: the `tracking`, `checkpoint`, `failure` and `export` sections."""

from dataclasses import dataclass, field
from typing import Dict, Optional


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
    """Sample each rank's CPU %, resident memory and (CUDA) GPU utilisation, memory and power every N seconds
    (sooner early on: a tenth of the time so far, at least 0.5 s, so a short run has 10 samples or more), logged as
    MLflow system metrics `system/rank_<r>/...`; 0 turns it off. Else >= 0.1 and at most 3,600 (an hour)."""
    tags: Dict[str, str] = field(default_factory=dict)
    """More tags on the run (name: text), beside ampflow's own (which win on a clash); `ampflow tune` writes
    `tune_run_id` here, linking a tuned job's runs to the tune that chose their policy."""
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
class ExportSection:
    dtype: Optional[str] = None
    """After training, export the model in this dtype (`float16` or `bfloat16`); None: no export."""
    max_accuracy_drop: float = 0.01
    """Refuse the export when its eval accuracy is lower than fp32's by more than this (0.01 = 1 point)."""
