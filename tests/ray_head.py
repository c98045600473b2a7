"""A real Ray head on 127.0.0.1 with token auth, started and stopped by the test that uses it.

`ray start --head --block` runs as our child with its own --temp-dir and free ports, so it
shares nothing with any other Ray on this machine. Teardown stops exactly the processes it
started: SIGTERM to `ray start` (which stops its node), then SIGKILL to any of its recorded
descendants still alive. Never `ray stop`, which would stop every Ray of this user.
"""

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import psutil
import requests

PORT_FLAGS = (
    "--port", "--dashboard-port", "--ray-client-server-port", "--node-manager-port",
    "--object-manager-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port", "--metrics-export-port",
)


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class RayHead:
    """`with RayHead(env={...}) as head:` -> head.address (http://...), head.token, head.token_file.

    `auth=False`: no token (drivers connect with plain `ray.init(address=head.gcs_address)`); `dashboard=False`:
    no dashboard and its job server (head.address is then None)."""

    def __init__(self, env: Optional[dict] = None, num_cpus: int = 2, start_timeout_s: float = 120,
                 auth: bool = True, dashboard: bool = True):
        self.extra_env, self.num_cpus, self.start_timeout_s = env or {}, num_cpus, start_timeout_s
        self.auth, self.dashboard = auth, dashboard
        self.process: Optional[subprocess.Popen] = None

    def __enter__(self) -> "RayHead":
        return self.start()

    def start(self, new_session: bool = False) -> "RayHead":
        """Start `ray start --head --block`; `new_session`: in a process session of its own, so that it outlives
        the process that started it (`stop_head` stops it later)."""
        # Short path: Ray puts unix sockets under --temp-dir, and those paths are limited to ~107 bytes.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ampflow-ray-", dir="/tmp"))
        self.token = secrets.token_hex(32) if self.auth else None
        self.token_file = self.temp_dir / "auth_token"
        if self.auth:
            self.token_file.write_text(self.token)
        ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
        self.address = f"http://127.0.0.1:{ports['--dashboard-port']}" if self.dashboard else None
        self.gcs_address = f"127.0.0.1:{ports['--port']}"  # what a driver connects to (`--address`)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0", RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.5", **self.extra_env)
        if self.auth:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token)
        else:  # Ray 2.60 turns token auth on by default
            env["RAY_AUTH_MODE"] = "disabled"
        # A job's entrypoint says `python`: make it this environment's, as the image's is on a cluster.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        command = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
                   "--node-ip-address", "127.0.0.1", "--dashboard-host", "127.0.0.1",
                   "--include-dashboard", str(self.dashboard).lower(),
                   "--num-cpus", str(self.num_cpus), "--temp-dir", str(self.temp_dir), "--disable-usage-stats"]
        for flag, port in ports.items():
            command += [flag, str(port)]
        self.log = open(self.temp_dir / "ray-start.log", "w")
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=new_session)
        try:
            self._wait_until_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        headers = {"Authorization": f"Bearer {self.token}"} if self.auth else {}
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ray start exited {self.process.returncode}:\n{self.output()}")
            if self.dashboard:
                try:
                    if requests.get(f"{self.address}/api/version", headers=headers, timeout=2).ok:
                        return
                except requests.RequestException:
                    pass
            elif "Ray runtime started" in self.output():  # printed once the head's processes all run
                return
            time.sleep(0.5)
        raise TimeoutError(f"Ray head not up at {self.gcs_address} after {self.start_timeout_s}s:\n{self.output()}")

    def client_env(self, **extra: str) -> dict:
        """Environment for a client process: token auth as Ray's CLI reads it, no other Ray settings."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_file), **extra)
        return env

    def output(self) -> str:
        self.log.flush()
        return (self.temp_dir / "ray-start.log").read_text()[-4000:]

    def __exit__(self, *exc_info) -> None:
        if self.process is None:
            return
        stop_head(self.process.pid, self.temp_dir, self.process)
        self.log.close()
        self.process = None


def stop_head(pid: int, temp_dir: Path, process: Optional[subprocess.Popen] = None) -> None:
    """Stop the `ray start --block` process `pid` and everything it started (SIGTERM stops its node; then SIGKILL
    to any of its descendants still alive, e.g. a job's entrypoint), and remove its temp dir. Only that tree:
    never `ray stop`, which would stop every Ray of this user."""
    try:
        head = psutil.Process(pid)
        started = [head, *head.children(recursive=True)]
    except psutil.NoSuchProcess:
        started = []
    if started:
        head.send_signal(signal.SIGTERM)
        if process is not None:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        else:
            psutil.wait_procs([head], timeout=30)
    for proc in started:  # whatever of ours outlived `ray start`
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(started, timeout=10)
    if process is not None and process.poll() is None:
        process.wait(timeout=10)
    shutil.rmtree(temp_dir, ignore_errors=True)


SHARED_HEAD_CPUS = 8
"""Logical CPUs of the suite's shared head: every test process's fit (two workers of one CPU each, as `small_job`
asks) is placed at once, whatever the others run."""

SHARED_HEAD_ENV = {
    # A single node is never drained: Ray Train's preemption watcher (a process per fit) has nothing to watch.
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
}


def shared_head(directory: Path) -> dict:
    """The suite's shared Ray head (no token, no dashboard), for the tests that only train on a Ray: started by the
    first test process that asks, under a file lock in `directory` (one per test session, every test process's),
    and recorded there as {"gcs_address", "pid", "temp_dir"}. It outlives the test process that started it;
    `stop_shared_head(directory)` stops it once every test process is done."""
    from filelock import FileLock

    record = directory / "ray-head.json"
    with FileLock(str(directory / "ray-head.lock")):
        if not record.exists():
            head = RayHead(num_cpus=SHARED_HEAD_CPUS, auth=False, dashboard=False, env=SHARED_HEAD_ENV)
            head.start(new_session=True)
            record.write_text(json.dumps({"gcs_address": head.gcs_address, "pid": head.process.pid,
                                          "temp_dir": str(head.temp_dir)}))
        return json.loads(record.read_text())


def stop_shared_head(directory: Path) -> None:
    """Stop the shared head `shared_head` started in `directory`, if any."""
    record = directory / "ray-head.json"
    if record.exists():
        head = json.loads(record.read_text())
        stop_head(head["pid"], Path(head["temp_dir"]))
        record.unlink()
