"""The job's own callbacks (`callbacks`): objects with any of the loop's hook methods, by import path.

Each is built on every rank from its `name` and `kwargs`, runs after the built-in hooks, and is called like
them (`orchestrator.train.hooks`); a callback with `rank_zero_only = True` runs on rank 0 alone. What a
callback adds to a report (`collect(loop, report)`: `report.metrics`, `.tags`, `.tables`) reaches MLflow like
the built-in metrics. A callback that raises fails the run with its name, the hook method and the line that
raised (`CallbackFailed`).
"""

import traceback
from typing import Any, Callable, Sequence

from orchestrator.config.imports import resolve_import_path
from orchestrator.config.names import CALLBACK_METHODS


class CallbackFailed(RuntimeError):
    """A callback of the job raised: the run fails, naming it."""


class Callback:
    """A user callback, called through: what its hook methods raise becomes `CallbackFailed` naming it."""

    def __init__(self, name: str, target: Any):
        self.name, self.target = name, target
        self.rank_zero_only = bool(getattr(target, "rank_zero_only", False))

    def __getattr__(self, method: str) -> Callable[..., Any]:
        function = getattr(self.target, method, None) if method in CALLBACK_METHODS else None
        if not callable(function):
            raise AttributeError(method)

        def call(*args: Any) -> Any:
            try:
                return function(*args)
            except Exception as exc:
                frame = traceback.extract_tb(exc.__traceback__)[-1]
                raise CallbackFailed(f"callback {self.name} raised in {method}: {type(exc).__name__}: {exc} "
                                     f"(at {frame.filename}:{frame.lineno})") from exc

        return call


def build_callbacks(specs: Sequence[Any]) -> list[Callback]:
    """The job's `callbacks`, built (import paths were checked when the job was loaded)."""
    callbacks = []
    for index, spec in enumerate(specs):
        factory = resolve_import_path(spec.name, f"callbacks[{index}].name", kind="callback")
        callbacks.append(Callback(f"callbacks[{index}] {spec.name}", factory(**spec.kwargs)))
    return callbacks
