"""Shared fixtures: one real local Ray for the whole session, real MLflow stores in tmp dirs."""

import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _sigint_left_as_found():
    """Every test leaves SIGINT as it found it: its handler, and unblocked. The processes a test starts inherit both,
    so a SIGINT left ignored or blocked here never reaches them, and a later test of Ctrl-C fails for no reason of
    its own. A test that changed it fails, naming the change; the state is put back for the next one."""
    import signal

    handler = signal.getsignal(signal.SIGINT)
    yield
    problems = []
    if signal.getsignal(signal.SIGINT) is not handler:
        problems.append(f"the SIGINT handler was {handler!r} and is now {signal.getsignal(signal.SIGINT)!r}")
        signal.signal(signal.SIGINT, handler)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    if blocked & {signal.SIGINT, signal.SIGTERM}:
        problems.append(f"signals left blocked: {sorted(blocked)}")
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    if problems:
        pytest.fail("the test changed the process's SIGINT: " + "; ".join(problems))


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


def ray_actor_names(ray_tmpdir: Path) -> set[str]:
    """The classes of the actors the Rays started in `ray_tmpdir` ran (each actor's worker log names it)."""
    names = set()
    for log in (ray_tmpdir / "ray").glob("session_2*/logs/worker-*.out"):
        names.update(line.removeprefix(":actor_name:").strip() for line in log.read_text(errors="replace").splitlines()
                     if line.startswith(":actor_name:"))
    return names


@pytest.fixture
def write_job(tmp_path):
    """Write a job mapping as YAML in tmp_path and return its path."""

    def write(job: dict, name: str = "job.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(job, sort_keys=False))
        return path

    return write


@pytest.fixture(scope="session")
def _mlflow_template(tmp_path_factory) -> Path:
    """An empty SQLite MLflow store with every table made: MLflow's migrations take seconds on a small machine, so
    each test's store starts as a copy of this one."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def new_store(_mlflow_template):
    """`new_store(directory)`: the URI of an empty MLflow store at `directory/mlflow.db` (a copy of the template)."""

    def make(directory: Path) -> str:
        path = Path(directory) / "mlflow.db"
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_mlflow_template, path)
        return f"sqlite:///{path}"

    return make


@pytest.fixture
def mlflow_uri(tmp_path, new_store) -> str:
    """An empty MLflow store of the test's own."""
    return new_store(tmp_path)


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
