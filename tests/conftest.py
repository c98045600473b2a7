"""Shared fixtures: one real Ray head for the whole test session, real MLflow stores in tmp dirs.

The suite runs side by side in several test processes (pytest-xdist, `-n auto`: `pytest_xdist_auto_num_workers`).
What a session builds once is built once for all of them, in the session's shared directory
(`$AMPFLOW_TEST_SHARED`, made by the first pytest process, the controller, and removed by it at the end): the
migrated MLflow store that every test's store copies, and the Ray head the tests that only train on a Ray connect
to. Everything else is each test's own: its temporary directory, MLflow store, Ray temp dir and ports.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

WORKERS_ENV = "AMPFLOW_TEST_WORKERS"
"""How many test processes `-n auto` runs; by default `auto_workers()`."""

MEMORY_PER_WORKER = 5 * 2**30
"""What one test process may hold at once, with what it starts: itself (~2 GiB), a fit's two Ray Train workers and
controller (~1 GiB each), or a driver and its own Ray."""

SHARED_ENV = "AMPFLOW_TEST_SHARED"
"""The session's shared directory, inherited by every test process."""


def auto_workers() -> int:
    """One test process more than the machine has cores (a test waits on process start-ups, Ray and servers a
    good part of its time), as many as the available memory holds."""
    import psutil

    by_memory = psutil.virtual_memory().available // MEMORY_PER_WORKER
    return max(1, min((os.cpu_count() or 1) + 1, by_memory))


@pytest.hookimpl(optionalhook=True)  # xdist's hook: the suite still runs with -p no:xdist
def pytest_xdist_auto_num_workers(config) -> int:
    value = os.environ.get(WORKERS_ENV, "").strip()
    if not value:
        return auto_workers()
    if not value.isdigit() or int(value) < 1:
        raise pytest.UsageError(f"{WORKERS_ENV}={value!r}: give a number of test processes, 1 or more")
    return int(value)


def pytest_configure(config):
    if SHARED_ENV not in os.environ:  # the controller, or the one process without xdist: it owns the directory
        os.environ[SHARED_ENV] = tempfile.mkdtemp(prefix="ampflow-suite-", dir="/tmp")
        config.stash[_SHARED_OWNER] = True


def pytest_unconfigure(config):
    if config.stash.get(_SHARED_OWNER, False):  # every test process is done by now
        from ray_head import stop_shared_head

        shared = Path(os.environ.pop(SHARED_ENV))
        stop_shared_head(shared)
        shutil.rmtree(shared, ignore_errors=True)


_SHARED_OWNER = pytest.StashKey[bool]()


def shared_dir() -> Path:
    return Path(os.environ[SHARED_ENV])


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: the order is of the tests that run
def pytest_collection_modifyitems(config, items):
    """The longest files first (`suite_order.file_order`): side by side, the long files start at once and the short
    ones fill in at the end (`--dist loadscope --no-loadscope-reorder` hands out whole files in this order)."""
    from suite_order import file_order

    rank = {path: index for index, path in enumerate(
        file_order((item.nodeid.split("::", 1)[0], item.get_closest_marker("slow") is not None) for item in items))}
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])  # stable: each file's own order kept


LONG_TEST_S = 60.0
"""A test whose call takes longer says why in its docstring, in a paragraph that starts with `Long:`."""

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each call's report carries whether the test's docstring says why it may be long (reports travel from the
    test processes to the controller, which prints the summary)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        report.user_properties.append(("says_why_long", "Long:" in (getattr(item, "function", None).__doc__ or "")))


def pytest_runtest_logreport(report):
    _durations.append((report.nodeid, report.duration))
    if report.when == "call" and report.duration > LONG_TEST_S and not dict(report.user_properties).get(
            "says_why_long", True):
        _unexplained.append((report.duration, report.nodeid))


_unexplained: list = []
_durations: list = []


@pytest.hookimpl(trylast=True)  # after the slowest tests
def pytest_terminal_summary(terminalreporter, config):
    """Under the slowest tests (`--durations`), the slowest files (to keep `suite_order.FILE_SECONDS` up to date),
    then the tests over `LONG_TEST_S` whose docstring does not say why."""
    if config.getoption("durations", None) is not None and _durations:
        from suite_order import slowest_files

        terminalreporter.section("slowest files (tests/suite_order.py orders the suite by them)")
        for line in slowest_files(_durations):
            terminalreporter.write_line(line)
    if _unexplained:
        terminalreporter.section(f"tests over {LONG_TEST_S:.0f} s that do not say why (a `Long:` paragraph in "
                                 "the docstring)")
        for duration, nodeid in sorted(_unexplained, reverse=True):
            terminalreporter.write_line(f"{duration:7.2f}s {nodeid}")


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


@pytest.fixture(autouse=True)
def _fast_tests_start_no_ray_and_no_training_processes(request, monkeypatch):
    """`make test-fast` runs the tests not marked `slow`: each of those starts no Ray and trains in no process of
    its own (the Ray-free loop's ranks, `torch.multiprocessing`). One that does fails, saying to mark it."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    import torch.multiprocessing  # noqa: F401 - `spawn` below is its module

    def refuse(*args, **kwargs):
        pytest.fail("this test starts processes with torch.multiprocessing (a training's ranks): mark it "
                    "@pytest.mark.slow, or train in this process")

    monkeypatch.setattr(sys.modules["torch.multiprocessing.spawn"], "start_processes", refuse)
    ray = sys.modules.get("ray")
    connected = ray is not None and ray.is_initialized()
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized() and not connected:
        pytest.fail("this test started or joined a Ray: mark it @pytest.mark.slow")


@pytest.fixture(scope="session")
def shared_ray_address() -> str:
    """The GCS address of the session's shared Ray head (`ray_head.shared_head`: one for every test process), for
    driver processes a test starts; this process does not connect."""
    from ray_head import shared_head

    return shared_head(shared_dir())["gcs_address"]


@pytest.fixture(scope="session")
def ray_session(shared_ray_address):
    """This test process connected, as a driver, to the session's shared Ray head (`shared_ray_address`);
    disconnected at the end."""
    import ray

    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    ray.init(address=shared_ray_address, log_to_driver=False, logging_level="WARNING")
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
    left = {}
    for process in psutil.process_iter(["cmdline"]):
        try:
            if str(directory) in " ".join(process.info["cmdline"] or []):
                # and what it started: Ray's workers and the dashboard's modules name themselves anew
                for found in [process, *process.children(recursive=True)]:
                    left[found.pid] = found
        except psutil.Error:
            pass
    left = list(left.values())
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
def _mlflow_template() -> Path:
    """An empty SQLite MLflow store with every table made, once for the session's test processes: MLflow's
    migrations take seconds on a small machine, so each test's store starts as a copy of this one."""
    from filelock import FileLock

    path = shared_dir() / "mlflow-template.db"
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            from mlflow import MlflowClient

            building = path.with_name("mlflow-template.building.db")
            MlflowClient(tracking_uri=f"sqlite:///{building}").search_experiments()
            building.rename(path)
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
