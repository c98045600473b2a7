"""ampflow: mixed-precision distributed training on Ray Train, tracked in MLflow.

`from orchestrator import run` trains a job from Python (`orchestrator.api`); bad input raises `BadInput`,
Ctrl-C or SIGTERM `Interrupted`, and a run's outcome is a `RunResult`. `orchestrator.predict(run_id or
model_uri, data)` runs a logged model in the precision it was trained or exported in
(`orchestrator.runner.predict`). The commands are `python -m orchestrator.submit|sweep|jobs|summary|export|
predict` (or `ampflow ...`).
"""

from orchestrator.errors import BadInput, Interrupted

__all__ = ["run", "predict", "RunResult", "BadInput", "Interrupted"]


def __getattr__(name: str):
    # Imported on first use: every `orchestrator.*` import runs this file first, and `python -m orchestrator.jobs`
    # needs neither torch nor the API's imports.
    if name in ("run", "RunResult"):
        from orchestrator import api  # torch, omegaconf, the driver: seconds

        return getattr(api, name)
    if name == "predict":
        from orchestrator.runner.predict import predict  # mlflow and torch: seconds

        return predict
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
