"""The MLflow server as k8s/base/mlflow.yaml runs it answers the Ray pods and refuses other Hosts.

MLflow 3 rejects requests whose Host header it does not allow (a DNS-rebinding guard); the Ray
pods call it as http://mlflow:5000, so a wrong MLFLOW_SERVER_ALLOWED_HOSTS would silently lose
every metric of every cluster run. This starts the real `mlflow server` with the Deployment's
command and environment (SQLite instead of PostgreSQL, a temp dir instead of the volume).
"""

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests

from conftest import REPO
from k8s_render import render
from ray_head import free_ports

pytestmark = pytest.mark.slow


def mlflow_container():
    objects = render(REPO / "k8s" / "overlays" / "gpu")
    (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "mlflow"]
    return deployment["spec"]["template"]["spec"]["containers"][0]


def with_option(command: list[str], flag: str, value: str) -> list[str]:
    command = list(command)
    command[command.index(flag) + 1] = value
    return command


@pytest.fixture
def server(tmp_path):
    container = mlflow_container()
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env["MLFLOW_BACKEND_STORE_URI"].startswith("postgresql://mlflow:$(POSTGRES_PASSWORD)@postgres:5432/")
    (port,) = free_ports(1)
    command = with_option(with_option(container["command"], "--host", "127.0.0.1"), "--port", str(port))
    command = with_option(command, "--workers", "1")  # one is enough to answer; starts faster on 2 cores
    assert command[0] == "mlflow"
    command[0] = str(Path(sys.executable).with_name("mlflow"))
    env.update(MLFLOW_BACKEND_STORE_URI=f"sqlite:///{tmp_path / 'mlflow.db'}",
               MLFLOW_ARTIFACTS_DESTINATION=str(tmp_path / "mlartifacts"))
    process = subprocess.Popen(command, env={"PATH": str(Path(sys.executable).parent), **env}, cwd=tmp_path,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{url}/health", timeout=2).ok:
                    break
            except requests.RequestException:
                time.sleep(0.5)
        else:
            pytest.fail("mlflow server did not come up")
        yield url
    finally:
        server_tree = psutil.Process(process.pid)  # the server and its uvicorn workers: ours only
        server_tree = [server_tree, *server_tree.children(recursive=True)]
        process.terminate()
        _, alive = psutil.wait_procs(server_tree, timeout=3)
        for proc in alive:
            proc.kill()
        process.wait(timeout=10)


def test_the_mlflow_server_answers_the_service_name_and_localhost_only(server):
    search = f"{server}/api/2.0/mlflow/experiments/search?max_results=1"
    for host in ("mlflow:5000", "mlflow.ampflow.svc.cluster.local:5000", "127.0.0.1:5000", "localhost:5000"):
        reply = requests.get(search, headers={"Host": host}, timeout=10)
        assert reply.status_code == 200, (host, reply.status_code, reply.text[:200])
    refused = requests.get(search, headers={"Host": "attacker.example:5000"}, timeout=10)
    assert refused.status_code == 403
