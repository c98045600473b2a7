"""A run as `submit` planned it (`RunPlan`: the job, its MLflow run, Ray) and how it ended (`RunResult`), read by
the driver that runs it (`orchestrator.runner.driver`), by the end of the run (`orchestrator.runner.run_end`,
`orchestrator.runner.outcome`) and by callers from Python (`orchestrator.run`)."""

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig

from orchestrator.runner.ray_start import RayStart


@dataclass
class RunResult:
    """How a run ended, for callers from Python (`from orchestrator import run`)."""

    run_id: Optional[str]
    """The MLflow run (None when MLflow never answered)."""
    status: str
    """FINISHED or FAILED (an interrupt raises instead)."""
    metrics: dict[str, float]
    """Each metric's final value (`eval/loss`, `eval/<metric>`, `train/loss`, `amp/*`, ...)."""
    checkpoint_path: Optional[str]
    """Where the run's checkpoints are (its directory in `checkpoint.storage_path`)."""
    model_uri: Optional[str]
    """The logged fp32 model (`mlflow.pytorch.load_model(model_uri)`), or None when none was logged."""
    error: Optional[str] = None
    """Why it FAILED: the worker's exception first."""



@dataclass
class RunPlan:
    cfg: DictConfig
    job_path: Path
    address: Optional[str]
    uri: str
    run_name: str
    resume: bool
    tracker: object
    """The MLflow run (RunTracker), or None while MLflow is unreachable and `tracking.required` is false."""
    parent_run_id: Optional[str] = None
    """The MLflow parent run (a sweep's) this run is a child of; None for a run of its own."""
    result: Optional[RunResult] = None
    """How the run ended, once `execute` has run it (what `orchestrator.run()` returns)."""
    datasets: Sequence = ()
    """The train and eval sets' lineage, for a run created once MLflow answers (`RunChoice.datasets`)."""
    ray: Optional[RayStart] = None
    """Ray as it was started for this run while its MLflow run was created (`plan_run_as_ray_starts`), or by
    `execute` (when None, it starts it); `execute` releases it once the run is closed."""
