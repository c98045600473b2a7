"""Remote submission: `python -m orchestrator.submit JOB --address http://HEAD:8265`.

The job runs on the cluster as the entrypoint `python -m orchestrator.submit JOB key=value ...`,
with the directory submit was run in uploaded as its working directory. There, submit connects
to the cluster it runs on (the job supervisor sets RAY_ADDRESS) and takes the MLflow server
from the pod's MLFLOW_TRACKING_URI. Here we only submit, follow the logs and turn the job's
final status into an exit code.

Token auth is left to Ray, exactly as for `ray job submit`: `JobSubmissionClient` adds the
`Authorization: Bearer` header when RAY_AUTH_MODE=token, with the token that Ray's own loader
finds in RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token.
"""

import asyncio
import shlex
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from orchestrator.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, BadInput

# Never uploaded with the working directory (gitignore patterns, relative to it): environments,
# data, local MLflow stores, checkpoints and caches. Ray also honours .gitignore/.rayignore, but
# these hold even where those files are missing or RAY_RUNTIME_ENV_IGNORE_GITIGNORE is set.
WORKING_DIR_EXCLUDES = [
    ".venv/", "venv/", ".git/", "/data/", "/mlflow.db", "/mlflow.db-journal", "/mlruns/",
    "/mlartifacts/", "/ray_results/", "__pycache__/", ".pytest_cache/", "*.egg-info/",
    "*.pt", "*.pth", "*.ckpt", "*.safetensors",
]

AUTH_HELP = (
    "The cluster has token auth on: set RAY_AUTH_MODE=token and give the cluster's token in "
    "RAY_AUTH_TOKEN, in a file named by RAY_AUTH_TOKEN_PATH, or in ~/.ray/auth_token, as for "
    "`ray job submit` (on Kubernetes: kubectl get secret ray-auth-token -o jsonpath='{.data.auth_token}' "
    "| base64 -d)."
)


def is_job_server_address(address: Optional[str]) -> bool:
    """An http(s):// address is a Ray dashboard (job server); anything else goes to ray.init()."""
    return bool(address) and address.startswith(("http://", "https://"))


def entrypoint(job_in_project: str, overrides: Sequence[str], resume: bool = False) -> str:
    return shlex.join(["python", "-m", "orchestrator.submit", job_in_project, *overrides,
                       *(["--resume"] if resume else [])])


def job_path_in_project(job_path: Path, project_dir: Path) -> str:
    """The job file as the cluster sees it: relative to the uploaded working directory."""
    resolved, project = job_path.resolve(), project_dir.resolve()
    if not resolved.is_relative_to(project):
        raise BadInput(
            f"{job_path}: the job file must be inside {project}, the directory that is uploaded as "
            "the job's working directory. Run submit from the project that holds the job file."
        )
    return resolved.relative_to(project).as_posix()


# `jobs stop` (Ray's stop_job) sends the job's driver SIGTERM, then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S (3 s by
# default), which a loaded driver can need more than to flush its MLflow writer and close the run KILLED. Ray's job
# supervisor reads the variable from the job's own runtime_env (Ray 2.60 `JobSupervisor.stop`).
STOP_GRACE_ENV = {"RAY_JOB_STOP_WAIT_TIME_S": "30"}


def connect(address: str):
    """A JobSubmissionClient for `address`; BadInput (nothing submitted) when it cannot be used."""
    # ray.job_submission: a second to import; submit imports this module, and its --help and bad input must not wait
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except AuthenticationError as exc:
        raise BadInput(f"--address {address}: {first_line(exc)}\n{AUTH_HELP}") from None
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise BadInput(
            f"--address {address}: cannot reach a Ray job server there ({first_line(exc)}). Give the "
            "dashboard's address, e.g. http://127.0.0.1:8265 after "
            "`kubectl port-forward svc/ampflow-head-svc 8265:8265`."
        ) from None


def first_line(what: object) -> str:
    """The first line of an error or message: Ray's errors can carry whole log tails."""
    return (str(what).strip().splitlines() or [type(what).__name__])[0]


def submit(job_path: Path, overrides: Sequence[str], address: str, *, wait: bool = True,
           project_dir: Optional[Path] = None, resume: bool = False) -> int:
    """Submit the job with the project as its working directory; follow it unless `wait` is False.

    BadInput (exit 2) when nothing was submitted; otherwise the job's exit code.
    """
    from ray.exceptions import AuthenticationError  # Ray: costly to import, see `connect`

    project_dir = (project_dir or Path.cwd()).resolve()
    job_in_project = job_path_in_project(job_path, project_dir)
    command = entrypoint(job_in_project, overrides, resume)
    client = connect(address)
    try:
        job_id = client.submit_job(
            entrypoint=command,
            runtime_env={"working_dir": str(project_dir), "excludes": WORKING_DIR_EXCLUDES,
                         "env_vars": STOP_GRACE_ENV},
            metadata={"ampflow_job_file": job_in_project},
        )
    except AuthenticationError as exc:
        raise BadInput(f"--address {address}: {first_line(exc)}\n{AUTH_HELP}") from None
    except (RuntimeError, ValueError, OSError) as exc:
        raise BadInput(f"--address {address}: the cluster did not accept the job: {first_line(exc)}") from None
    if not wait:
        print(job_id)
        return EXIT_OK
    print(f"Submitted {job_id} to {address}: {command}\n"
          "Following its logs; Ctrl-C stops following, not the job.", file=sys.stderr)
    return follow(client, job_id, address)


def follow(client, job_id: str, address: str) -> int:
    """Print the job's logs as they come, then exit 0 if it SUCCEEDED, 1 if it FAILED or was STOPPED."""
    from ray.job_submission import JobStatus  # Ray: costly to import, see `connect`

    try:
        try:
            asyncio.run(_print_logs(client, job_id))
        except RuntimeError as exc:  # the stream can break (proxy, port-forward); the job goes on
            print(f"\nwarning: log stream of {job_id} ended early ({first_line(exc)}); waiting for its "
                  f"status. Logs: python -m orchestrator.jobs logs {job_id} --address {address}", file=sys.stderr)
        status = wait_until_done(client, job_id)
    except KeyboardInterrupt:
        print(f"\nStopped following {job_id}; it is still running. Stop it with: "
              f"python -m orchestrator.jobs stop {job_id} --address {address}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if status == JobStatus.SUCCEEDED:
        print(f"Job {job_id} SUCCEEDED.", file=sys.stderr)
        return EXIT_OK
    # The message repeats the log's tail, which was just printed: its first line says why.
    message = client.get_job_info(job_id).message or "no message"
    print(f"Job {job_id} {status.value}: {first_line(message)}", file=sys.stderr)
    return EXIT_FAILED


async def _print_logs(client, job_id: str) -> None:
    async for chunk in client.tail_job_logs(job_id):
        print(chunk, end="", flush=True)


def wait_until_done(client, job_id: str, poll_s: float = 1.0):
    """The log stream closes when the job ends, but its status can lag a moment behind."""
    while not (status := client.get_job_status(job_id)).is_terminal():
        time.sleep(poll_s)
    return status
