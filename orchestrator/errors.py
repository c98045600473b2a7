"""Errors the CLI turns into exit codes, and the exit codes themselves (one definition for every command).

Bad input exits 2 before Ray starts; a run that trained and failed exits 1; Ctrl-C exits 130.
"""

EXIT_OK = 0
"""Done: the run finished, the job SUCCEEDED, the command did what was asked."""

EXIT_FAILED = 1
"""Training (or a remote job, or an export's accuracy check) failed; the MLflow run says FAILED."""

EXIT_BAD_INPUT = 2
"""Refused before anything started: no Ray, no MLflow run, nothing submitted."""

EXIT_INTERRUPTED = 130
"""Ctrl-C (SIGINT), numbered as shells number it (128 + 2)."""


class BadInput(Exception):
    """A job file, override or name that cannot run: exit 2, nothing started.

    The message says what is wrong, where (file and key path) and what to do.
    """


class DataUnavailable(BadInput):
    """A dataset that cannot be found or downloaded; the message says where to put it."""
