"""How much the commands say: `-q` (errors, warnings and results), the default (plus progress), `-v` (plus
MLflow's and Ray's own INFO lines, which stay off the console otherwise).

Set once per command through `logging`: the `ampflow` logger's level is the verbosity; MLflow's and
Ray's loggers are one notch quieter than it. Ray's driver-side level is handed to `ray.init`.
"""

import logging
import os
import sys

QUIET, NORMAL, VERBOSE = logging.WARNING, logging.INFO, logging.DEBUG

logger = logging.getLogger("ampflow")


class _Stderr(logging.Handler):
    """Writes the bare message to the current sys.stderr (replaced by notebooks and tests after import)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # a console that went away must not end the run
            self.handleError(record)


def add_arguments(parser) -> None:
    """`-v/--verbose` and `-q/--quiet` on a command's parser."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-v", "--verbose", action="store_true",
                       help="also show MLflow's and Ray's own INFO lines and ampflow's debug lines")
    group.add_argument("-q", "--quiet", action="store_true",
                       help="only errors, warnings and the results: no progress line")


def ensure_console() -> None:
    """ampflow's lines reach stderr at the default verbosity even when no command set one (the Python API)."""
    if not any(isinstance(handler, _Stderr) for handler in logger.handlers):
        logger.addHandler(_Stderr())
        logger.propagate = False
    if logger.level == logging.NOTSET:
        logger.setLevel(NORMAL)


def set_verbosity(level: int) -> None:
    """The command's verbosity (QUIET, NORMAL or VERBOSE), for ampflow, MLflow and Ray alike."""
    logger.setLevel(level)
    ensure_console()
    chatter = logging.INFO if level <= VERBOSE else logging.WARNING if level <= NORMAL else logging.ERROR
    os.environ["MLFLOW_LOGGING_LEVEL"] = logging.getLevelName(chatter)  # read when mlflow is imported
    logging.getLogger("mlflow").setLevel(chatter)  # and applied now, if it is imported already


def from_args(args) -> int:
    """Set the verbosity from parsed `-v` / `-q`; returns it."""
    level = VERBOSE if getattr(args, "verbose", False) else QUIET if getattr(args, "quiet", False) else NORMAL
    set_verbosity(level)
    return level


def verbosity() -> int:
    """The command's verbosity (NORMAL when none was set: the Python API)."""
    return logger.level or NORMAL


def ray_logging_level() -> int:
    """What `ray.init(logging_level=...)` gets: Ray's INFO lines and its start-up warnings (e.g. token
    authentication being on) only with -v."""
    return logging.INFO if verbosity() <= VERBOSE else logging.ERROR


def progress_shown() -> bool:
    return verbosity() <= NORMAL
