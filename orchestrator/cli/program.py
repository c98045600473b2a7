"""The command as the user typed it, for usage lines: `ampflow submit` or `python -m orchestrator.submit`."""

import sys
from pathlib import Path


def prog(command: str) -> str:
    """`ampflow COMMAND` when this process is the `ampflow` command, else `python -m orchestrator.COMMAND`."""
    return f"ampflow {command}" if Path(sys.argv[0]).stem == "ampflow" else f"python -m orchestrator.{command}"
