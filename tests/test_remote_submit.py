"""Remote submission through the Ray Job Submission API, against a real local Ray head with token auth.

The head plays the KubeRay head pod: token auth on, MLFLOW_TRACKING_URI in its environment.
The client plays the laptop: the token only where Ray's own CLI reads it (RAY_AUTH_MODE=token,
RAY_AUTH_TOKEN_PATH), and an MLFLOW_TRACKING_URI of its own that the job must not use.
"""

import json
import re
import shlex
import subprocess
import sys
import textwrap

import pytest
from mlflow import MlflowClient

from conftest import REPO
from ray_head import RayHead

pytestmark = pytest.mark.slow

# A few fp32 steps on one worker: the path to the cluster is under test, not training. (onecycle
# is off because OneCycleLR divides by zero when a run has only 4 steps in all.)
TINY = ["scaling.num_workers=1", "run.epochs=1", "run.max_steps_per_epoch=4", "precision.preset=O0",
        "optim.schedule=none", "tracking.log_model=false"]
LAPTOP_MLFLOW = "sqlite:////nonexistent/laptop-store-must-not-be-used.db"


def submit(head: RayHead, *args: str, env: dict = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.submit", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout,
                          env=env if env is not None else head.client_env(MLFLOW_TRACKING_URI=LAPTOP_MLFLOW))


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    store = tmp_path_factory.mktemp("cluster-mlflow") / "mlflow.db"
    results = tmp_path_factory.mktemp("cluster-storage")
    with RayHead(env={"MLFLOW_TRACKING_URI": f"sqlite:///{store}"}) as ray_head:
        ray_head.mlflow_uri, ray_head.storage = f"sqlite:///{store}", results
        yield ray_head


def test_without_the_clusters_token_nothing_is_submitted_and_the_error_says_how_to_give_it(head):
    no_token = {k: v for k, v in head.client_env().items() if not k.startswith("RAY_AUTH")}
    wrong_token = head.client_env(RAY_AUTH_TOKEN="0" * 64)
    wrong_token.pop("RAY_AUTH_TOKEN_PATH")
    for env in (no_token, wrong_token):
        out = submit(head, "jobs/quickstart.yaml", "--address", head.address, *TINY, env=env)
        assert out.returncode == 2, out.stderr
        assert out.stderr.startswith("error: --address http://127.0.0.1:")
        assert "RAY_AUTH_MODE=token" in out.stderr and "RAY_AUTH_TOKEN_PATH" in out.stderr


def test_the_entrypoint_survives_the_job_servers_shell_and_addresses_pick_the_path(monkeypatch, capsys):
    from orchestrator.runner.remote import entrypoint, is_job_server_address
    from orchestrator.cli.submit import main

    overrides = ["run.name=my run; rm -rf /", "tracking.experiment=it's"]
    command = entrypoint("jobs/quickstart.yaml", overrides)
    assert shlex.split(command) == ["python", "-m", "orchestrator.submit", "jobs/quickstart.yaml", *overrides]
    assert is_job_server_address("http://10.0.0.1:8265") and is_job_server_address("https://ray.example")
    assert not is_job_server_address("ray://head:10001") and not is_job_server_address("10.0.0.1:6379")
    assert not is_job_server_address(None)

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["jobs/quickstart.yaml", "--no-wait"]) == 2
    assert "--no-wait needs a job server" in capsys.readouterr().err


BAD_INPUT_DRIVER = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from ray.job_submission import JobSubmissionClient
    from orchestrator.cli.submit import main
    address, cases = sys.argv[1], json.loads(sys.argv[2])
    jobs_before = len(JobSubmissionClient(address).list_jobs())
    results = {}
    for name, argv in cases.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            results[name] = {"rc": main([*argv, "--address", address]), "stderr": err.getvalue()}
    results["jobs_submitted"] = len(JobSubmissionClient(address).list_jobs()) - jobs_before
    print(json.dumps(results))
    """
)


def test_bad_input_exits_2_before_anything_reaches_the_cluster(head, tmp_path):
    outside = tmp_path / "outside.yaml"
    outside.write_text((REPO / "jobs" / "quickstart.yaml").read_text())
    cases = {  # name: (argv, what the message must name)
        "unknown_key": (["jobs/quickstart.yaml", "run.epoch=1"], "run.epochs"),
        "unknown_model": (["jobs/quickstart.yaml", "model.name=vgg99"], "vgg99"),
        "outside_project": ([str(outside)], "must be inside"),
    }
    out = subprocess.run([sys.executable, "-c", BAD_INPUT_DRIVER, head.address,
                          json.dumps({name: argv for name, (argv, _) in cases.items()})],
                         cwd=REPO, capture_output=True, text=True, timeout=300, env=head.client_env())
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for name, (_, needle) in cases.items():
        assert results[name]["rc"] == 2, (name, results[name])
        assert results[name]["stderr"].startswith("error: ") and needle in results[name]["stderr"], name
    assert results["jobs_submitted"] == 0


def test_quickstart_runs_on_the_cluster_and_its_logs_and_exit_status_come_back(head):
    """The quickstart as a Ray job on a cluster: its output and exit status come back, and it is tracked where the
    cluster's MLFLOW_TRACKING_URI points.

    Long: a Ray job's entrypoint is a driver process of its own on the head (torch, Ray and MLflow imported there),
    which starts Ray Train's controller and workers; four steps are all it trains."""
    out = submit(head, "jobs/quickstart.yaml", "--address", head.address, *TINY,
                 f"checkpoint.storage_path={head.storage}")
    assert out.returncode == 0, out.stdout + out.stderr
    # The job's own output, streamed back: the worker loop's progress and submit's summary.
    assert "Running entrypoint for job raysubmit_" in out.stdout
    assert "epoch 1/1 | step 4/4" in out.stdout
    run_id = re.search(r"Run finished: ([0-9a-f]{32})", out.stdout).group(1)
    assert re.search(r"Job raysubmit_\w+ SUCCEEDED", out.stderr)
    # Tracked where the cluster's MLFLOW_TRACKING_URI points, not where the laptop's does.
    run = MlflowClient(tracking_uri=head.mlflow_uri).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["run.max_steps_per_epoch"] == "4"
    assert run.data.tags["job_file"] == "jobs/quickstart.yaml"


def test_a_job_failing_on_the_cluster_exits_1_with_its_error_in_the_logs(head):
    # Valid here (data is checked where it is read), unavailable on the cluster: submit fails there.
    out = submit(head, "jobs/quickstart.yaml", "--address", head.address, *TINY, "data.name=cifar10",
                 "data.download=false", "data.root=/nonexistent/cifar")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "error: data: CIFAR-10 is not in /nonexistent/cifar" in out.stdout
    assert re.search(r"Job raysubmit_\w+ FAILED: Job entrypoint command failed with exit code 2", out.stderr)


JOBS_DRIVER = textwrap.dedent(
    """
    import contextlib, io, json, sys, time
    from orchestrator.cli.jobs import main
    address, job_id = sys.argv[1], sys.argv[2]

    def run(*argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main([*argv, "--address", address])
        return {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}

    deadline = time.monotonic() + 120
    while "MLflow run" not in run("logs", job_id)["stdout"] and time.monotonic() < deadline:
        time.sleep(1)  # stop it once training has started and its MLflow run exists
    results = {"running": run("status", job_id), "stop": run("stop", job_id),
               "status": run("status", job_id), "logs": run("logs", job_id),
               "unknown": run("status", "raysubmit_doesnotexist")}
    print(json.dumps(results))
    """
)


def test_no_wait_prints_the_job_id_and_jobs_status_logs_stop_manage_it(head):
    """`--no-wait` prints the job id; `jobs status`, `logs` and `stop` manage that job from another process.

    Long: the stop must land while the job trains, so the job runs a Ray job's whole start (a driver process of its
    own, Ray Train's controller and workers) before `jobs` manages it."""
    # Long enough that the stop lands while it trains (the quickstart in fp32 ends seconds after its first step:
    # a stop after that finds a run already closed FINISHED, correctly, and the test would prove nothing).
    out = submit(head, "jobs/quickstart.yaml", "--address", head.address, "--no-wait", "precision.preset=O0",
                 "run.epochs=200", f"checkpoint.storage_path={head.storage}")
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip()
    assert re.fullmatch(r"raysubmit_\w+", job_id), out.stdout

    out = subprocess.run([sys.executable, "-c", JOBS_DRIVER, head.address, job_id], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env=head.client_env())
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results["running"]["rc"] == 0 and results["running"]["stdout"].startswith(f"{job_id} RUNNING\n")
    assert results["stop"]["rc"] == 0 and results["stop"]["stdout"] == f"{job_id} STOPPED\n"
    assert results["status"]["rc"] == 0 and results["status"]["stdout"].startswith(f"{job_id} STOPPED\n")
    assert "Running entrypoint for job " + job_id in results["logs"]["stdout"]
    assert results["unknown"]["rc"] == 2 and "raysubmit_doesnotexist: not found" in results["unknown"]["stderr"]

    # The stopped job's MLflow run was closed, not left RUNNING.
    run_id = re.search(r"MLflow run ([0-9a-f]{32})", results["logs"]["stdout"]).group(1)
    status = MlflowClient(tracking_uri=head.mlflow_uri).get_run(run_id).info.status
    assert status == "KILLED", results["logs"]["stdout"][-4000:]
