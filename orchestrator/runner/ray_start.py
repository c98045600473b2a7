"""Ray for one run: started here (a local Ray, with submit's report poll) or joined, what its start left
behind (`RayStart`), and whether a tracking server listens before anything starts.

Without an address (no `--address`, no `RAY_ADDRESS`) the run starts a local Ray of its own: `ray.init` is
given "local", never None, with which Ray would join whatever cluster `<Ray's temp dir>/ray_current_cluster`
names (a file `ray start` leaves behind after its cluster is gone). A cluster at an explicit address is waited
for at most `CLUSTER_WAIT_S`, in Python, so that Ctrl-C and SIGTERM end the wait at once.
"""

import logging
import os
import signal
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence
from urllib.parse import urlsplit

import psutil

from orchestrator import console
from orchestrator.errors import interrupt_on_sigterm, interrupted_by, interrupts_on_sigterm

HEALTH_CHECK_INTERVAL_S = 0.5
"""How often Ray Train's controller polls workers (and takes their reports) in a Ray that submit starts."""

CLUSTER_WAIT_S = 60.0
"""How long submit, sweep and `run()` wait for the Ray cluster at an explicit address (`--address`,
`RAY_ADDRESS`) to accept a connection before giving up (the run ends FAILED, exit 1)."""

CONNECT_ATTEMPT_S = 2.0
"""One connection attempt's limit while waiting for a cluster (then a second's pause and another try)."""


PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
"""Ray Train's switch for its preemption watcher: an actor per worker group that polls Ray for nodes being drained."""


class RayUnreachable(ConnectionError):
    """No Ray cluster accepted a connection at the address within `CLUSTER_WAIT_S`."""


def ray_address(address: Optional[str]) -> str:
    """What `ray.init` is given: `address`, else `$RAY_ADDRESS`, else "local" (a Ray of this run's own)."""
    return address or os.environ.get("RAY_ADDRESS") or "local"


def wait_for_cluster(address: str, timeout_s: Optional[float] = None) -> None:
    """Return once the GCS (or Ray Client server, `ray://`) at `address` accepts a TCP connection; RayUnreachable
    after `timeout_s` (default `CLUSTER_WAIT_S`). "local" needs no wait; "auto" is the cluster Ray finds on this
    machine, if any."""
    target = _host_port(address)
    if target is None:
        return
    timeout_s = CLUSTER_WAIT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(target, timeout=min(CONNECT_ATTEMPT_S, max(0.1, deadline - time.monotonic()))):
                return
        except OSError as exc:
            error = exc
        if time.monotonic() >= deadline:
            raise RayUnreachable(
                f"no Ray cluster answered at {address} within {timeout_s:.0f} s (the wait's limit, CLUSTER_WAIT_S; "
                f"last try: {type(error).__name__}: {error})")
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def _host_port(address: str) -> Optional[tuple[str, int]]:
    if address == "local":
        return None
    if address == "auto":  # as ray.init resolves it: $RAY_ADDRESS, else the newest `ray start` on this machine
        try:
            from ray._private.services import canonicalize_bootstrap_address  # Ray: costly, see `init_ray`

            address = canonicalize_bootstrap_address("auto")
        except Exception:  # nothing found: ray.init says so at once
            return None
        if address is None:
            return None
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        return None  # not HOST:PORT: ray.init reports it
    return host.strip("[]"), int(port)


def init_ray(address: Optional[str], module_sources: Sequence[Path] = ()) -> tuple[bool, Optional[dict]]:
    """Start a local Ray (`address` None and no `$RAY_ADDRESS`), or connect to the cluster at the address once it
    answers (`wait_for_cluster`: RayUnreachable after `CLUSTER_WAIT_S`), with worker logs kept off the console.

    Returns (whether we started it, the runtime env the workers need). The user's modules from the
    submit directory (models, datasets, losses, metrics) are shipped to every node as job-level
    `py_modules`; Ray only uploads local code at the job level, so when the caller already
    initialised Ray (a notebook, the tests) we can only point same-machine workers at their
    directories through PYTHONPATH.
    """
    import ray  # about a second to import; the driver imports this module, and its bad input exits before Ray

    keep_raylet_dumps_off_console()
    if ray.is_initialized():
        if not module_sources:
            return False, None
        directories = dict.fromkeys(str(source.parent) for source in module_sources)
        return False, {"env_vars": {"PYTHONPATH": os.pathsep.join(directories)}}
    address = ray_address(address)
    wait_for_cluster(address)
    runtime_env = {"py_modules": [str(source) for source in module_sources]} if module_sources else None
    # Ray Train's controller takes a worker's report only once per health check (2 s by default) and a
    # worker holds one untaken report at most: with reports more frequent than that, training waits
    # (measured in bench.orchestration). A local Ray we start inherits this environment; on an existing
    # cluster, set it on the cluster.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", str(HEALTH_CHECK_INTERVAL_S))
    # A Ray of this run's own is one node, which nothing drains: Ray Train's preemption watcher would be one more
    # process per worker group (~2 s of CPU) with nothing to watch. Ray's processes take the variable from this
    # environment as they start; it leaves this process's environment again with ray.init, so that a later run
    # from the same process on a cluster keeps the watcher. A value the user set is left as it is.
    watcher_off = address == "local" and PREEMPTION_WATCHER_ENV not in os.environ
    if watcher_off:
        os.environ[PREEMPTION_WATCHER_ENV] = "0"
    try:
        # Worker and controller logs stay in Ray's session directory; the console gets one progress line (and what
        # the user's code prints on the workers, `run.worker_output`, through the relay). Ray's own INFO lines and
        # start-up warnings reach it with -v only.
        with _sigterm_handler_kept():
            ray.init(address=address, runtime_env=runtime_env, log_to_driver=False,
                     logging_level=console.ray_logging_level())
    finally:
        if watcher_off:
            os.environ.pop(PREEMPTION_WATCHER_ENV, None)
    return True, None


NODE_DEATH_REPORTS = ("Raylet is terminated", "The node with node id: ")
"""How the reports Ray publishes to every driver when a node dies begin (Ray 2.60): its dashboard agent's, with
the dead raylet's last log lines (`ray._private.process_watcher.report_raylet_error_logs`), and the GCS's, once
the node missed its health checks."""


def keep_raylet_dumps_off_console() -> None:
    """A driver prints every error report Ray publishes (`ray._private.worker.listen_error_messages`, whatever
    `log_to_driver` says). When a node is lost, its dashboard agent publishes the dead raylet's last log lines:
    pages of `[state-dump]` lines on the user's console, and the GCS a paragraph on missed heartbeats. Those
    reports (`NODE_DEATH_REPORTS`) go to the `ray` logger at DEBUG instead (the raylet's own log on that node keeps
    its lines whole, the agent's and the GCS's logs the reports); the console says which node was lost and what it
    cost, in one line (`orchestrator.tracking.nodes`). Every other report is printed as before."""
    import ray._private.worker as ray_worker  # where the listener finds its printer, at each report (Ray 2.60)

    printing = ray_worker.print_to_stdstream
    if getattr(printing, "keeps_raylet_dumps_off", False):
        return

    def print_but_raylet_dumps(data, ignore_prefix):
        lines = data.get("lines") or []
        if data.get("pid") == "raylet" and lines and str(lines[0]).startswith(NODE_DEATH_REPORTS):
            logging.getLogger("ray").debug("a node died; Ray reported: %s", "\n".join(map(str, lines)))
            return
        printing(data, ignore_prefix)

    print_but_raylet_dumps.keeps_raylet_dumps_off = True
    ray_worker.print_to_stdstream = print_but_raylet_dumps


@contextmanager
def _sigterm_handler_kept():
    """While `ray.init` runs, SIGTERM keeps raising `Interrupted` when it did (submit and sweep): Ray installs
    handlers of its own for that time (`sys.exit(15)`, then its node's, which stops the node's processes and calls
    `sys.exit(1)`). ray.init starts processes from this thread, and Python runs logging's at-fork callbacks
    around each start: Ray's handler raising in the one that releases logging's lock left the lock held, and every
    later logging call, MLflow's creating the run on the other thread included, waited forever (seen under load:
    the command then ended only at its deadline, its run left RUNNING). Ours sends such a signal again a moment
    later (`errors._interrupt`). Ray's processes, started to share this process's fate, end with it."""
    import ray._private.utils as ray_utils  # where ray.init and its node install their handlers (Ray 2.60)

    if not interrupts_on_sigterm():
        yield
        return
    install = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = install


@dataclass
class RayStart:
    """Ray for one run, as `start_ray` left it."""

    launched_at: float
    """When the run's launch began (wall clock, just before Ray starts): `perf/time_to_first_step_s` counts from it."""
    started: bool = False
    """Whether this run started Ray (and shuts it down at its end), rather than joining one."""
    worker_runtime_env: Optional[dict] = None
    """What the workers need on a Ray someone else started (`init_ray`)."""
    error: Optional[BaseException] = None
    """Why Ray could not be had (an Exception), or the Ctrl-C / SIGTERM that came while it started."""
    previous_sigterm: object = None
    """The SIGTERM handler before submit's own was installed again over Ray's (restored at the end)."""
    trainer: object = None
    """The run's trainer once built (`launch.build_trainer`): its Ray Train controller, once `fit()` made it."""

    def stop_training(self) -> None:
        """Kill the run's Ray Train controller, now: its workers go with it (Ray ends the actors an actor created
        when it dies), stuck or not. For an interrupt; the driver then closes the run and `release`s Ray."""
        import ray  # costly to import, see `init_ray`

        controller = getattr(self.trainer, "controller", None)
        if controller is not None and ray.is_initialized():
            try:
                ray.kill(controller, no_restart=True)
            except Exception:  # noqa: BLE001 - gone already; the driver's exit ends the job's actors anyway
                pass

    def release(self) -> None:
        """The SIGTERM handler as it was, and Ray shut down if this run started it. Only once the run is closed:
        until then its writer reads the relay through Ray, and a Ray call after `ray.shutdown()` would start a new
        local Ray (Ray initialises itself on use)."""
        import ray  # costly to import, see `init_ray`

        if self.previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self.previous_sigterm)
            self.previous_sigterm = None
        if self.started:
            self.started = False
            processes = _own_ray_processes()
            ray.shutdown()
            _end_leftovers(processes)


LEFTOVER_GRACE_S = 3.0
"""How long a process of the Ray that a run started may outlive `ray.shutdown()` before it is killed."""


def _own_ray_processes() -> list:
    """The processes of the Ray this process started (its raylet, GCS, dashboard and the rest) and their
    descendants (the workers and actors), as they are now: Ray's workers are the raylet's children, and
    `_end_leftovers` must still know them once the raylet is gone."""
    import ray._private.worker as ray_worker  # where the node this process started is kept (Ray 2.60)

    node = getattr(ray_worker, "_global_node", None)
    processes = []
    for infos in (getattr(node, "all_processes", None) or {}).values():
        for info in infos:
            try:
                process = psutil.Process(info.process.pid)
                processes += [process, *process.children(recursive=True)]
            except psutil.Error:  # ended already
                pass
    return processes


def _end_leftovers(processes: list) -> None:
    """Kill what of `processes` outlives `LEFTOVER_GRACE_S`. `ray.shutdown()` stops the node's processes and lets
    the raylet end its workers, but under load it gives up on a slow raylet and kills it, and an actor worker
    left without its raylet was seen running on (Ray Train's detached PlacementGroupCleaner, 15 s after an
    interrupted submit had ended)."""
    _, alive = psutil.wait_procs(processes, timeout=LEFTOVER_GRACE_S)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:  # ended meanwhile
            pass
    psutil.wait_procs(alive, timeout=LEFTOVER_GRACE_S)


def start_ray(address: Optional[str], module_sources: Sequence[Path]) -> RayStart:
    """`init_ray`, with what fails kept for `execute` to end the run with (FAILED, or KILLED for an interrupt),
    and submit's SIGTERM handler installed again: Ray's core worker sets one of its own."""
    import ray  # costly to import, see `init_ray`

    start = RayStart(launched_at=time.time())
    found_running = ray.is_initialized()
    try:
        start.started, start.worker_runtime_env = init_ray(address, module_sources)
    except BaseException as exc:
        # SIGTERM during ray.init where Ray's own handler is kept (`run()` from Python) exits with its number
        start.error = interrupted_by(signal.SIGTERM) if isinstance(exc, SystemExit) and exc.code == signal.SIGTERM \
            else exc
        start.started = not found_running and ray.is_initialized()
    start.previous_sigterm = interrupt_on_sigterm()
    return start


def server_listens(uri: str, timeout_s: float = 2.0) -> bool:
    """Whether an http(s) tracking server accepts connections (other stores: True). A quick TCP connect, without
    importing MLflow, so that a server that is down is reported before Ray starts."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return True
    try:
        with socket.create_connection((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)),
                                      timeout=timeout_s):
            return True
    except OSError:
        return False
