"""`ampflow tune` against bad input and faults: every refusal comes before the probe (exit 2, one line naming what
to change), never after minutes of work; nothing is written where it was not asked for, and the job file is never
replaced without `--force`. The torchao cases run the real command in a fresh interpreter whose import path hides
torchao, or holds one that fails to import."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from conftest import REPO, small_job
from orchestrator.cli.tune import main
from orchestrator.config.loader import load_job

PROBE_LINE = "probing "
"""What the tune says as its probe starts (`orchestrator.autotune.run.tune`): absent, no work was done."""


@pytest.fixture
def job(tmp_path, monkeypatch, mlflow_uri):
    """A tiny tune of the CNN on digits (one probe batch, costs modelled for an H100, no validation), in tmp_path."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(small_job(
        scaling={"num_workers": 1}, run={"batch_size": 16}, tracking={"uri": mlflow_uri, "experiment": "tune"},
        tune={"target": "h100", "batches": 1, "validate_steps": 0})))
    return path


def tune_runs(uri: str) -> list:
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("tune")
    return [] if experiment is None else client.search_runs([experiment.experiment_id])


def refused_port() -> int:
    """A port on 127.0.0.1 nothing listens on: connections to it are refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with socket.socket() as check:
        assert check.connect_ex(("127.0.0.1", port)) != 0
    return port


@pytest.mark.parametrize("output, says", [
    ("/proc/nope/t.yaml", "--output /proc/nope/t.yaml: the directory /proc/nope does not exist"),
    (".", "--output .: is a directory; give the file to write, e.g. --output tuned.yaml"),
    ("/proc/t.yaml", "--output /proc/t.yaml: cannot write in the directory /proc"),
])
def test_an_output_that_cannot_be_written_is_refused_before_the_tune(job, capsys, output, says):
    assert main([str(job), "--output", output]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {says}") and err.count("\n") == 1, err
    assert PROBE_LINE not in err and not tune_runs(load_job(job).tracking.uri)


def test_the_job_file_as_output_is_refused_unless_forced(job, capsys):
    written = job.read_bytes()
    assert main([str(job), "--output", str(job)]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --output {job} is the job file {job}: the tuned job would replace it. Write it elsewhere, "
                   "or add --force to replace the job file.\n")
    assert job.read_bytes() == written and not tune_runs(load_job(job).tracking.uri)
    # The same file by another name (a link) is the same file.
    (job.parent / "link.yaml").symlink_to(job)
    assert main([str(job), "--output", "link.yaml"]) == 2
    assert "is the job file" in capsys.readouterr().err and job.read_bytes() == written

    assert main([str(job), "--output", str(job), "--force", "-q"]) == 0
    tuned = job.read_text()
    assert tuned.startswith(f"# Written by `ampflow tune {job}`") and "rules:" in tuned
    assert "tune" not in yaml.safe_load(tuned) and load_job(job).precision.rules  # a job, with the tune's rules


def test_force_is_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--force" in capsys.readouterr().out


def test_mlflow_refusing_connections_is_refused_before_the_tune(job, capsys):
    uri = f"http://127.0.0.1:{refused_port()}"
    assert main([str(job), f"tracking.uri={uri}", "--output", "tuned.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: tracking: MLflow at {uri} cannot be reached") and err.count("\n") == 1, err
    assert "set tracking.required: false to tune anyway" in err
    assert PROBE_LINE not in err and not Path("tuned.yaml").exists()


def test_mlflow_refusing_connections_under_required_false_tunes_without_a_run_saying_so_once(job, capsys):
    uri = f"http://127.0.0.1:{refused_port()}"
    assert main([str(job), f"tracking.uri={uri}", "tracking.required=false", "--output", "tuned.yaml"]) == 0
    out = capsys.readouterr()
    assert out.err.count("cannot be reached") == 1 and "tuning anyway (tracking.required: false)" in out.err
    assert "Traceback" not in out.err and "MlflowException" not in out.err
    assert out.out == "wrote tuned.yaml\n"  # no tune run to point at
    assert load_job("tuned.yaml").precision.rules


HIDDEN = "import sys\nsys.modules['torchao'] = None  # as if it were not installed\n"
BROKEN = "raise ImportError('torchao was built for another torch (undefined symbol: _ZN3c104cuda)')\n"


def tune_command(job: Path, tmp_path: Path, torchao: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m orchestrator.tune JOB ARGS`, in a fresh interpreter whose import path first holds a directory
    where torchao is `hidden` (a sitecustomize that blocks its import) or `broken` (a package whose import
    raises)."""
    shadow = tmp_path / f"torchao-{torchao}"
    if torchao == "hidden":
        shadow.mkdir()
        (shadow / "sitecustomize.py").write_text(HIDDEN)
    else:
        (shadow / "torchao").mkdir(parents=True)
        (shadow / "torchao" / "__init__.py").write_text(BROKEN)
    return subprocess.run([sys.executable, "-m", "orchestrator.tune", str(job), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{shadow}{os.pathsep}{REPO}"})


@pytest.mark.parametrize("torchao, asked, says", [
    ("hidden", "tune.candidates=[float8]",
     "tune.candidates: float8 cannot be tried: float8 rules need torchao, which is not installed: "
     "pip install 'ampflow[fp8]' (torchao). Otherwise leave float8 out of tune.candidates"),
    ("broken", "tune.emulate_float8=true",
     "tune.emulate_float8: float8 cannot be probed: float8 needs torchao, which is installed but fails to import "
     "(ImportError: torchao was built for another torch (undefined symbol: _ZN3c104cuda)); reinstall it: "
     "pip install 'ampflow[fp8]' (torchao). Otherwise set tune.emulate_float8=false"),
])
def test_float8_asked_for_where_torchao_cannot_run_is_refused_naming_the_key(job, tmp_path, torchao, asked, says):
    done = tune_command(job, tmp_path, torchao, asked, "--output", "tuned.yaml")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: {job}: {says}") and "Traceback" not in done.stderr, done.stderr
    assert PROBE_LINE not in done.stderr and not (tmp_path / "tuned.yaml").exists()


def test_the_default_candidates_without_torchao_tune_the_rest_and_say_why_float8_was_not_tried(job, tmp_path):
    done = tune_command(job, tmp_path, "hidden", "tune.emulate_float8=false", "--output", "tuned.yaml")
    assert done.returncode == 0, done.stderr
    assert "  float8 not tried on any layer:\n    features.0, features.3: float8 applies to Linear layers\n" \
           "    classifier.1, classifier.3: float8 rules need torchao, which is not installed" in done.stderr
    rules = yaml.safe_load((tmp_path / "tuned.yaml").read_text())["precision"]["rules"]
    assert rules and all(rule["dtype"] in ("float16", "bfloat16") for rule in rules)
