"""The tune's MLflow run: its settings as params, its predictions and validation as metrics, and as artifacts the
per-layer sensitivity table (`tune/sensitivity.json`), its chart (`tune/sensitivity.png`) and the chosen policy
(`tune/policy.yaml`, the job file written)."""

import math
from pathlib import Path

from omegaconf import OmegaConf

from orchestrator.tracking.tracker import standard_tags, view_hint
from orchestrator.autotune.plan import chart
from orchestrator.autotune.run import Tune


def log_tune(uri: str, cfg, job_path: Path, result: Tune, job_text: str) -> str:
    """One MLflow run in the job's experiment (`tracking.experiment`), FINISHED; returns how to view it."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    experiment = mlflow.set_experiment(cfg.tracking.experiment)
    tags = {**standard_tags(job_path, job_path.resolve().parent), "ampflow.kind": "tune", "device": result.device,
            "tune.target": str(cfg.tune.target or result.device)}
    with mlflow.start_run(run_name=f"tune-{job_path.stem}", tags=tags) as run:
        mlflow.log_params({f"tune.{key}": value for key, value in OmegaConf.to_container(cfg.tune).items()})
        mlflow.log_params({"model.name": cfg.model.name, "job_file": str(job_path)})
        mlflow.log_metrics({f"tune/{name}": value for name, value in result.predicted.items() if math.isfinite(value)})
        if result.validations:
            last = result.validations[-1]
            mlflow.log_metrics({"tune/validation_gap": last.gap if math.isfinite(last.gap) else -1.0,
                                "tune/validation_rounds": float(len(result.validations)),
                                "tune/validation_skipped_steps": float(last.skipped_steps)})
            for step, (fp32, policy) in enumerate(zip(last.fp32_losses, last.policy_losses), start=1):
                mlflow.log_metrics({"tune/loss_fp32": fp32, **({"tune/loss_policy": policy}
                                                                if math.isfinite(policy) else {})}, step=step)
        mlflow.log_dict({"rows": [{k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                                   for k, v in row.items()} for row in result.table],
                         "assignment": result.assignment, "moved_up": [list(m) for m in result.moved_up]},
                        "tune/sensitivity.json")
        mlflow.log_figure(chart(result.table), "tune/sensitivity.png")
        mlflow.log_text(job_text, "tune/policy.yaml")
        return run.info.run_id, view_hint(uri, experiment.experiment_id, run.info.run_id)
