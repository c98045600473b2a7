"""Shared fixtures: one real local Ray for the whole session, real MLflow stores in tmp dirs."""

import os
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ray_session():
    """One `ray.init(num_cpus=2)` shared by every test that trains; stopped at the end."""
    import ray

    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


@pytest.fixture
def ray_tmpdir():
    """A Ray temp dir (`RAY_TMPDIR`) of the test's own, short (unix socket paths are limited to ~107 bytes), for
    the Ray a driver process the test runs starts; the Ray processes it left running under it are stopped after."""
    import shutil
    import tempfile

    import psutil

    directory = Path(tempfile.mkdtemp(prefix="ampflow-rt-", dir="/tmp"))
    (directory / "ray").mkdir()
    yield directory
    left = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if str(directory) in " ".join(process.info["cmdline"] or []):
                left.append(process)
        except psutil.Error:
            pass
    for process in left:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=10)
    shutil.rmtree(directory, ignore_errors=True)


def own_ray_env(ray_tmpdir: Path, **extra: str) -> dict:
    """The environment of a driver process starting a Ray of its own in `ray_tmpdir`: no RAY_* of ours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**env, "RAY_TMPDIR": str(ray_tmpdir), "PYTHONPATH": str(REPO), **extra}


def ray_sessions(ray_tmpdir: Path) -> list[str]:
    """The Ray sessions started in `ray_tmpdir` (one directory each)."""
    return sorted(p.name for p in (ray_tmpdir / "ray").glob("session_2*"))


@pytest.fixture
def write_job(tmp_path):
    """Write a job mapping as YAML in tmp_path and return its path."""

    def write(job: dict, name: str = "job.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(job, sort_keys=False))
        return path

    return write


@pytest.fixture
def mlflow_uri(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def small_job(**sections) -> dict:
    """A tiny digits job: 2 workers, fp32, a few steps. Sections given replace or extend the defaults."""
    job = {
        "model": {"name": "simple_cnn"},
        "data": {"name": "digits"},
        "scaling": {"num_workers": 2},
        "run": {"epochs": 1, "batch_size": 32, "max_steps_per_epoch": 4},
        "tracking": {"log_every_n_steps": 2, "log_model": False},
    }
    for name, values in sections.items():
        job[name] = values if isinstance(values, list) else {**job.get(name, {}), **values}
    return job


def drill(name: str, **kwargs) -> dict:
    """A job's `callbacks` entry for one of tests/drills.py's deliberate failures."""
    return {"name": f"drills:{name}", "kwargs": kwargs}


_MAIN_RUNNER = """
import contextlib, importlib, io, json, os, sys
import ray
main = importlib.import_module(sys.argv[1]).main
results = {}
for name, argv in json.loads(sys.argv[2]).items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    results[name] = {"rc": rc, "stderr": err.getvalue(), "ray": ray.is_initialized(), "files": sorted(os.listdir("."))}
print(json.dumps(results))
"""


def run_mains(module: str, argvs: dict[str, list[str]], workdir: Path) -> dict[str, dict]:
    """Call `module.main(argv)` for each case in one fresh interpreter in `workdir` (startup is the slow part).

    Per case: the exit code, stderr, whether Ray got started, and the files left in `workdir`.
    """
    import json
    import subprocess

    out = subprocess.run([sys.executable, "-c", _MAIN_RUNNER, module, json.dumps(argvs)], cwd=workdir,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def python() -> str:
    return sys.executable
