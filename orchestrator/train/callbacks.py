"""The job's own callbacks (`callbacks`): objects with any of the loop's hook methods, by import path.

Each is built on every rank from its `name` and `kwargs`, runs after the built-in hooks, and is called like
them (`orchestrator.train.hooks`); a callback with `rank_zero_only = True` runs on rank 0 alone. What a
callback adds to a report (`collect(loop, report)` or `end_epoch(loop, report)`: `report.metrics`, `.tags`,
`.tables`) reaches MLflow like the built-in metrics, and is checked as it is added: a metric that is not a
number, a name MLflow refuses or a table that is not JSON would otherwise surface on the driver, far from the
callback. A callback that raises fails the run with its name, the hook method and the line that raised
(`CallbackFailed`).
"""

import json
import numbers
import posixpath
import re
import traceback
from typing import Any, Callable, Sequence

import torch

from orchestrator.config.imports import resolve_import_path
from orchestrator.config.names import CALLBACK_METHODS

MLFLOW_NAME = re.compile(r"[/\w.\- :]*")
"""The characters MLflow takes in a metric or tag name (mlflow.utils.validation)."""
REPORTING_METHODS = ("end_epoch", "collect")
"""The hook methods given the report: what a callback adds there is checked."""


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
                result = function(*args)
            except Exception as exc:
                frame = traceback.extract_tb(exc.__traceback__)[-1]
                # Raised with the callback's own traceback: its last frame, which Ray Train's error shows, is
                # the line that raised.
                raise CallbackFailed(f"callback {self.name} raised in {method}: {type(exc).__name__}: {exc} "
                                     f"(at {frame.filename}:{frame.lineno})").with_traceback(exc.__traceback__) \
                    from exc
            if method in REPORTING_METHODS:
                try:
                    check_report(args[-1])
                except BadReport as exc:
                    raise CallbackFailed(f"callback {self.name} added to the report in {method} what MLflow "
                                         f"would not take: {exc}") from None
            return result

        return call


class BadReport(ValueError):
    """A callback added something to a report that MLflow would not take."""


def check_report(report: Any) -> None:
    """Metrics are numbers under names MLflow takes, tags are named as MLflow takes, tables are JSON."""
    for kind, names in (("metrics", report.metrics), ("tags", report.tags), ("tables", report.tables)):
        for name in names:
            if not (isinstance(name, str) and MLFLOW_NAME.fullmatch(name) and posixpath.normpath(name) == name
                    and not name.startswith(("/", ".."))):
                raise BadReport(f"report.{kind}[{name!r}]: MLflow takes names of letters, digits and _ - . / : or "
                                "space, not starting with / or .., without // or /./ in them.")
    for name, value in report.metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise BadReport(f"report.metrics[{name!r}] = {value!r} ({type(value).__name__}): a metric is a number "
                            "(or a one-element tensor). Put text in report.tags, structures in report.tables.")
    for name, value in report.tables.items():
        try:
            json.dumps(value, default=float)  # as `Report.to_wire` turns it into plain types
        except (TypeError, ValueError) as exc:
            raise BadReport(f"report.tables[{name!r}]: not JSON ({exc}). A table is lists, dicts, strings and "
                            "numbers.") from None


def build_callbacks(specs: Sequence[Any]) -> list[Callback]:
    """The job's `callbacks`, built (import paths were checked when the job was loaded)."""
    callbacks = []
    for index, spec in enumerate(specs):
        factory = resolve_import_path(spec.name, f"callbacks[{index}].name", kind="callback")
        name = f"callbacks[{index}] {spec.name}"
        try:
            target = factory(**spec.kwargs)
        except Exception as exc:
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            raise CallbackFailed(f"callback {name} raised when built: {type(exc).__name__}: {exc} "
                                 f"(at {frame.filename}:{frame.lineno})").with_traceback(exc.__traceback__) from exc
        callbacks.append(Callback(name, target))
    return callbacks
