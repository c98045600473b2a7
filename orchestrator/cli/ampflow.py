"""`ampflow COMMAND ...`: one command on the PATH for every CLI, the same as `python -m orchestrator.COMMAND ...`."""

import importlib
import sys
from typing import NoReturn, Optional, Sequence

from orchestrator.errors import command_exit
from orchestrator.tracking.secrets import install_console_redaction

COMMANDS = {
    "submit": "train a job file on Ray Train workers, tracked in one MLflow run",
    "sweep": "run a job once per point of a grid (precision presets, or any keys) and compare the runs",
    "jobs": "status, logs or stop of a job submitted to a cluster's job server",
    "summary": "bytes by dtype of a model under a precision policy",
    "export": "export a run's trained model in half precision",
    "predict": "run a logged model over data in the precision it was trained or exported in",
    "tune": "find the cheapest per-layer precision policy that keeps the model's numbers",
}


def usage() -> str:
    listed = "\n".join(f"  {name:<8} {what}" for name, what in COMMANDS.items())
    return (f"usage: ampflow COMMAND [ARGS...]\n\ncommands:\n{listed}\n\n"
            "`ampflow COMMAND --help` shows a command's arguments.")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"error: unknown command '{command}'.\n{usage()}", file=sys.stderr)
        return 2
    install_console_redaction()  # every command's lines, from its first import on (each also installs it itself)
    module = importlib.import_module(f"orchestrator.cli.{command}")
    return module.main(rest)


def run() -> NoReturn:
    """The `ampflow` console script: `main()`, then the process ends as every command's does (`command_exit`)."""
    command_exit(main())


if __name__ == "__main__":
    run()
