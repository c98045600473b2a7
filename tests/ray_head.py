"""A real Ray head on 127.0.0.1 with token auth, started and stopped by the test that uses it.

`ray start --head --block` runs as our child with its own --temp-dir and free ports, so it
shares nothing with any other Ray on this machine. Teardown stops exactly the processes it
started: SIGTERM to `ray start` (which stops its node), then SIGKILL to any of its recorded
descendants still alive. Never `ray stop`, which would stop every Ray of this user.
"""

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
    """`with RayHead(env={...}) as head:` -> head.address (http://...), head.token, head.token_file."""

    def __init__(self, env: Optional[dict] = None, num_cpus: int = 2, start_timeout_s: float = 120):
        self.extra_env, self.num_cpus, self.start_timeout_s = env or {}, num_cpus, start_timeout_s
        self.process: Optional[subprocess.Popen] = None

    def __enter__(self) -> "RayHead":
        # Short path: Ray puts unix sockets under --temp-dir, and those paths are limited to ~107 bytes.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ampflow-ray-", dir="/tmp"))
        self.token = secrets.token_hex(32)
        self.token_file = self.temp_dir / "auth_token"
        self.token_file.write_text(self.token)
        ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
        self.address = f"http://127.0.0.1:{ports['--dashboard-port']}"
        self.gcs_address = f"127.0.0.1:{ports['--port']}"  # what a driver connects to (`--address`)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token, RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
                   RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.5", **self.extra_env)
        # A job's entrypoint says `python`: make it this environment's, as the image's is on a cluster.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        command = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
                   "--node-ip-address", "127.0.0.1", "--dashboard-host", "127.0.0.1", "--include-dashboard", "true",
                   "--num-cpus", str(self.num_cpus), "--temp-dir", str(self.temp_dir), "--disable-usage-stats"]
        for flag, port in ports.items():
            command += [flag, str(port)]
        self.log = open(self.temp_dir / "ray-start.log", "w")
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_until_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        headers = {"Authorization": f"Bearer {self.token}"}
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ray start exited {self.process.returncode}:\n{self.output()}")
            try:
                if requests.get(f"{self.address}/api/version", headers=headers, timeout=2).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"Ray head not up at {self.address} after {self.start_timeout_s}s:\n{self.output()}")

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
        try:
            started = [self.process, *psutil.Process(self.process.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            started = []
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for proc in started:  # whatever of ours outlived `ray start` (e.g. a job's entrypoint)
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs([p for p in started if isinstance(p, psutil.Process)], timeout=10)
        self.log.close()
        self.process = None
        shutil.rmtree(self.temp_dir, ignore_errors=True)
