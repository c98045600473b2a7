"""A real `mlflow server` on 127.0.0.1 that a test can stop and start again on the same port and store."""

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import psutil
import requests

from ray_head import free_ports


class MlflowServer:
    def __init__(self, directory: Path, port: Optional[int] = None):
        self.directory, self.port = directory, port or free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: Optional[subprocess.Popen] = None

    def start(self, timeout_s: float = 120) -> "MlflowServer":
        command = [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1",
                   "--port", str(self.port), "--workers", "1",
                   "--backend-store-uri", f"sqlite:///{self.directory / 'mlflow.db'}",
                   "--artifacts-destination", str(self.directory / "mlartifacts")]
        # Without MLflow's job workers, as k8s/base/mlflow.yaml runs it (eight more processes, seconds of CPU each).
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.process = subprocess.Popen(command, cwd=self.directory, env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{self.url}/health", timeout=2).ok:
                    return self
            except requests.RequestException:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("mlflow server did not come up")

    def stop(self) -> None:
        """Stop the server and its workers: this server's process tree only."""
        if self.process is None:
            return
        tree = psutil.Process(self.process.pid)
        tree = [tree, *tree.children(recursive=True)]
        self.process.terminate()
        _, alive = psutil.wait_procs(tree, timeout=3)
        for proc in alive:
            proc.kill()
        self.process.wait(timeout=10)
        self.process = None
