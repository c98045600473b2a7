"""The tune's MLflow run: its settings as params, its predictions and validation as metrics, and as artifacts the
per-layer sensitivity table (`tune/sensitivity.json`), its chart (`tune/sensitivity.png`) and the chosen policy
(`tune/policy.yaml`, the job file written)."""

import math
import time
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from orchestrator.tracking.tracker import standard_tags, training_experiment, view_hint
from orchestrator.tune.plan import chart
from orchestrator.tune.run import Tune, linked_job


def log_tune(uri: str, cfg, job_path: Path, result: Tune, job_text: str,
             output: Optional[Path] = None) -> tuple[str, str]:
    """One MLflow run in the job's experiment (`tracking.experiment`), FINISHED, named like a submit's run
    (`tune-<job>-<date>-<time>`); returns its id and how to view it. With `output` (the tuned job file written),
    the run names it (tag `tune.output`) and the file is written again linked to the run (`tracking.tags`)."""
    import matplotlib.pyplot as plt
    import mlflow
    from mlflow import MlflowClient

    mlflow.set_tracking_uri(uri)
    experiment_id = training_experiment(MlflowClient(tracking_uri=uri), cfg.tracking.experiment)
    target = str(cfg.tune.target or result.device)  # the target planned for: the device at hand by default
    tags = {**standard_tags(job_path, job_path.resolve().parent), "ampflow.kind": "tune", "device": result.device,
            "tune.target": target, **({"tune.output": str(output.resolve())} if output is not None else {})}
    run_name = f"tune-{job_path.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    with mlflow.start_run(experiment_id=experiment_id, run_name=run_name, tags=tags) as run:
        if output is not None:
            job_text = linked_job(job_text, run.info.run_id)
            output.write_text(job_text)
        params = {f"tune.{key}": value for key, value in OmegaConf.to_container(cfg.tune).items()}
        mlflow.log_params({**params, "tune.target": target})
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
        figure = chart(result.table, cfg.tune.tolerance)
        mlflow.log_figure(figure, "tune/sensitivity.png")
        plt.close(figure)
        mlflow.log_text(job_text, "tune/policy.yaml")
        return run.info.run_id, view_hint(uri, experiment_id, run.info.run_id)
