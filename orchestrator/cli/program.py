"""What every command does the same way: the command as the user typed it, for usage lines (`ampflow submit` or
`python -m orchestrator.submit`); the arguments of a command that takes a job and overrides; a refusal or an
interrupt said in one line with the exit code it ends with."""

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from orchestrator import console
from orchestrator.config import reference
from orchestrator.errors import EXIT_BAD_INPUT, BadInput, Interrupted
from orchestrator.tracking.secrets import redact


def prog(command: str) -> str:
    """`ampflow COMMAND` when this process is the `ampflow` command, else `python -m orchestrator.COMMAND`."""
    return f"ampflow {command}" if Path(sys.argv[0]).stem == "ampflow" else f"python -m orchestrator.{command}"


def parse_job_args(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """A job command's arguments, with `--help-config` and the console's flags added. Intermixed: overrides may
    come after options (`JOB --address URL run.epochs=2`), as users type them."""
    reference.add_help_config(parser)
    console.add_arguments(parser)
    return parser.parse_intermixed_args(argv)


def refused(exc: BaseException, exit_code: int = EXIT_BAD_INPUT) -> int:
    """Says why the command stopped in one line on stderr, secrets redacted, and gives back its exit code."""
    print(f"error: {redact(str(exc))}", file=sys.stderr)
    return exit_code


def interrupted(exc: BaseException) -> int:
    """Says which signal stopped the command, and gives back the exit code it ends with (130 or 143)."""
    stopped = Interrupted.of(exc)
    print(f"\n{stopped.describe()}", file=sys.stderr)
    return stopped.exit_code


def check_output_file(output: Path, example: str) -> None:
    """`--output` before any work: a file (not a directory) that can be written, in a directory that exists and can
    be written in (probed with a temporary file, removed at once). BadInput naming `--output` otherwise; `example`:
    a file name the message suggests in place of a directory."""
    if output.is_dir():
        raise BadInput(f"--output {output}: is a directory; give the file to write, e.g. --output {output / example}.")
    directory = output.parent
    if not directory.is_dir():
        what = "is not a directory" if directory.exists() else "does not exist"
        raise BadInput(f"--output {output}: the directory {directory} {what}; create it or write elsewhere.")
    if output.exists():
        try:
            open(output, "a").close()  # opened for writing, nothing written
        except OSError as exc:
            raise BadInput(f"--output {output}: cannot be written ({exc.strerror or exc}); write elsewhere.") from None
        return
    try:
        tempfile.NamedTemporaryFile(dir=directory, prefix=".ampflow-write-check-").close()  # created, then removed
    except OSError as exc:
        raise BadInput(f"--output {output}: cannot write in the directory {directory} ({exc.strerror or exc}); "
                       "write elsewhere.") from None
