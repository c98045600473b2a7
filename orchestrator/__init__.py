"""ampflow: mixed-precision distributed training on Ray Train, tracked in MLflow.

`from orchestrator import run` trains a job from Python (`orchestrator.api`); the commands are
`python -m orchestrator.submit|sweep|jobs|summary|export` (or `ampflow ...`).
"""

__all__ = ["run", "RunResult"]


def __getattr__(name: str):
    # Imported on first use: `python -m orchestrator.submit` should not pay for the Python API's imports.
    if name in __all__:
        from orchestrator import api

        return getattr(api, name if name == "run" else "RunResult")
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
