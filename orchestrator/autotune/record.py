"""The tune's MLflow run: its settings as params, its predictions and validation as metrics, and as artifacts the
per-layer sensitivity table (`tune/sensitivity.json`), its chart (`tune/sensitivity.png`) and the chosen policy
(`tune/policy.yaml`, the job file written)."""

import math
import time
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from orchestrator.tracking.tracker import RunTracker, standard_tags, view_hint
from orchestrator.autotune.plan import chart
from orchestrator.autotune.run import Tune, linked_job


def log_tune(uri: str, cfg, job_path: Path, result: Tune, job_text: str,
             output: Optional[Path] = None) -> tuple[str, str]:
    """One MLflow run in the job's experiment (`tracking.experiment`), FINISHED, named like a submit's run
    (`tune-<job>-<date>-<time>`); returns its id and how to view it. With `output` (the tuned job file written),
    the run names it (tag `tune.output`) and the file is written again linked to the run (`tracking.tags`).
    Written through `RunTracker`, as every run is: what reaches MLflow (the job text included) is redacted."""
    import matplotlib.pyplot as plt

    target = str(cfg.tune.target or result.device)  # the target planned for: the device at hand by default
    tags = {**standard_tags(job_path, job_path.resolve().parent), "ampflow.kind": "tune", "device": result.device,
            "tune.target": target, **({"tune.output": str(output.resolve())} if output is not None else {})}
    run_name = f"tune-{job_path.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    tracker = RunTracker.create(uri, cfg.tracking.experiment, run_name=run_name, tags=tags)
    try:
        if output is not None:
            job_text = linked_job(job_text, tracker.run_id)
            output.write_text(job_text)
        params = {f"tune.{key}": value for key, value in OmegaConf.to_container(cfg.tune).items()}
        tracker.log_params({**params, "tune.target": target})
        tracker.log_params({"model.name": cfg.model.name, "job_file": str(job_path)})
        tracker.log_metrics({f"tune/{name}": value for name, value in result.predicted.items() if math.isfinite(value)})
        if result.validations:
            last = result.validations[-1]
            tracker.log_metrics({"tune/validation_gap": last.gap if math.isfinite(last.gap) else -1.0,
                                 "tune/validation_rounds": float(len(result.validations)),
                                 "tune/validation_skipped_steps": float(last.skipped_steps)})
            for step, (fp32, policy) in enumerate(zip(last.fp32_losses, last.policy_losses), start=1):
                tracker.log_metrics({"tune/loss_fp32": fp32, **({"tune/loss_policy": policy}
                                                                 if math.isfinite(policy) else {})}, step=step)
        tracker.log_dict({"rows": [{k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                                    for k, v in row.items()} for row in result.table],
                          "assignment": result.assignment, "moved_up": [list(m) for m in result.moved_up]},
                         "tune/sensitivity.json")
        figure = chart(result.table, cfg.tune.tolerance)
        tracker.log_figure(figure, "tune/sensitivity.png")
        plt.close(figure)
        tracker.log_text(job_text, "tune/policy.yaml")
    except BaseException:
        tracker.finish("FAILED")
        raise
    tracker.finish("FINISHED")
    return tracker.run_id, view_hint(uri, tracker.experiment_id, tracker.run_id)
