"""What MLflow refused during a run: each write it refused counted by kind, shown once in one line, and what
the run lost by it (the records it never took), so that a run missing records never ends as a success.

A store that refuses every write (a read-only SQLite file, a full disk) makes MLflow log a traceback per
call; `Refusals.quiet_mlflow_errors()` turns the first of each kind into one line and drops the repeats,
and `summary()` says at the end how many of each there were:
`MLflow refused 46 write(s): OperationalError attempt to write a readonly database (first at step 12)`.
"""

import logging
import re
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

from orchestrator.tracking.secrets import redact

NOISY_LOGGERS = ("mlflow", "sqlalchemy", "alembic", "urllib3")
"""Where the tracebacks of a refused write come from: their records are summarised while a run is tracked."""

_DBAPI_ERROR = re.compile(r"\((?:[\w.]+\.)?(\w+(?:Error|Exception))\) ([^\n\[]+)")
"""SQLAlchemy's `(sqlite3.OperationalError) attempt to write a readonly database` inside a longer message."""


def describe(exc: BaseException) -> str:
    """The kind of a refusal in one line: the innermost error's type and first line (`OperationalError attempt to
    write a readonly database`), without the SQL, parameters and hints SQLAlchemy wraps around it."""
    text = str(exc)
    wrapped = _DBAPI_ERROR.search(text)
    if wrapped:
        return redact(f"{wrapped.group(1)} {wrapped.group(2).strip()}")[:200]
    cause = exc.__cause__ or exc.__context__
    if cause is not None and type(exc).__name__ == "MlflowException":
        return describe(cause)
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return redact(f"{type(exc).__name__} {first}".strip())[:200]


@dataclass
class Kind:
    count: int
    first_step: Optional[int]


class Refusals:
    """One run's refused writes (by kind) and lost records (by what they were: metric values, tags, params,
    artifacts). Shared by the run's tracker (which counts every write MLflow refused) and its writer (which
    counts what it still held at the end); thread-safe."""

    def __init__(self):
        self.kinds: dict[str, Kind] = {}
        self.lost: Counter = Counter()
        """What MLflow never took: `metric values`, `tags`, `params`, `artifacts` -> how many."""
        self.step: Optional[int] = None
        """The step of the report being logged (refusals are dated by it)."""
        self._lock = threading.Lock()
        self._shown: set[str] = set()

    def refused(self, exc: BaseException) -> str:
        """Count one refused write; returns its kind."""
        kind = describe(exc)
        with self._lock:
            entry = self.kinds.setdefault(kind, Kind(0, self.step))
            entry.count += 1
        return kind

    def first_time(self, kind: str) -> bool:
        """Whether `kind` is to be shown now (once per kind)."""
        with self._lock:
            fresh = kind not in self._shown
            self._shown.add(kind)
            return fresh

    def lose(self, what: str, count: int = 1) -> None:
        if count:
            with self._lock:
                self.lost[what] += count

    @property
    def any_lost(self) -> bool:
        return any(self.lost.values())

    def lost_text(self) -> str:
        """`19 metric values, 2 tags and 3 artifacts`."""
        parts = [f"{count} {what}" for what, count in sorted(self.lost.items()) if count]
        return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]

    def summary(self) -> list[str]:
        """One line per kind of refusal, with its count and the step it was first seen at."""
        lines = []
        for kind, entry in sorted(self.kinds.items(), key=lambda item: -item[1].count):
            where = f" (first at step {entry.first_step})" if entry.first_step is not None else ""
            lines.append(f"MLflow refused {entry.count} write(s): {kind}{where}")
        return lines

    @contextmanager
    def quiet_mlflow_errors(self) -> Iterator[None]:
        """While inside: a warning or error with a traceback from MLflow (or SQLAlchemy, Alembic, urllib3) is shown
        once per kind, in one line; repeats are dropped (`summary()` counts the writes)."""
        quiet = _OnePerKind(self)
        handlers = {h for name in ("", "ampflow", *NOISY_LOGGERS) for h in logging.getLogger(name).handlers}
        for handler in handlers:
            handler.addFilter(quiet)
        try:
            yield
        finally:
            for handler in handlers:
                handler.removeFilter(quiet)


class _OnePerKind(logging.Filter):
    def __init__(self, refusals: Refusals):
        super().__init__()
        self.refusals = refusals

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not record.name.startswith(NOISY_LOGGERS) or not record.exc_info \
                or record.exc_info[1] is None:
            return True
        kind = describe(record.exc_info[1])
        if not self.refusals.first_time(kind):
            return False
        record.msg, record.args = f"{record.getMessage()} {kind}", ()
        record.exc_info, record.exc_text = None, None
        return True
