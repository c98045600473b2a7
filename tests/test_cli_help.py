"""Every command's usage line names the command the user typed: `ampflow submit --help` says `ampflow submit`,
`python -m orchestrator.submit --help` says that. And submit's and sweep's help print at once:
without torch, Ray or MLflow."""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

COMMANDS = ("submit", "sweep", "jobs", "summary", "export", "tune")


@pytest.mark.parametrize("command", COMMANDS)
def test_the_usage_line_names_the_command_as_typed(command):
    ampflow = Path(sys.executable).with_name("ampflow")
    for argv, typed in (([str(ampflow), command, "--help"], f"ampflow {command}"),
                        ([sys.executable, "-m", f"orchestrator.{command}", "--help"], f"python -m orchestrator.{command}")):
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: {typed} "), done.stdout[:200]


HELP_IMPORTS = """
import runpy, sys
sys.argv = [sys.argv[1], sys.argv[2]]
try:
    runpy.run_module(sys.argv[0], run_name="__main__")
except SystemExit as exc:
    assert exc.code == 0, exc.code
print("IMPORTED", sorted(m for m in ("torch", "ray", "mlflow") if m in sys.modules))
"""


@pytest.mark.parametrize("command", ["submit", "sweep"])
@pytest.mark.parametrize("flag", ["--help", "--help-config"])
def test_submit_and_sweep_print_their_help_without_importing_torch_ray_or_mlflow(command, flag):
    done = subprocess.run([sys.executable, "-c", HELP_IMPORTS, f"orchestrator.{command}", flag], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "run.epochs" in done.stdout  # the config reference is there
    assert done.stdout.splitlines()[-1] == "IMPORTED []", done.stdout[-300:]
