"""Every command's usage line names the command the user typed: `ampflow submit --help` says `ampflow submit`,
`python -m orchestrator.submit --help` says that."""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

COMMANDS = ("submit", "sweep", "jobs", "summary", "export")


@pytest.mark.parametrize("command", COMMANDS)
def test_the_usage_line_names_the_command_as_typed(command):
    ampflow = Path(sys.executable).with_name("ampflow")
    for argv, typed in (([str(ampflow), command, "--help"], f"ampflow {command}"),
                        ([sys.executable, "-m", f"orchestrator.{command}", "--help"], f"python -m orchestrator.{command}")):
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: {typed} "), done.stdout[:200]
