"""Train from Python: `from orchestrator import run`.

    result = run("jobs/quickstart.yaml", ["run.epochs=2"])
    result = run({"model": {"name": "simple_cnn"}, "data": {"name": "digits"}})
    result.run_id, result.status, result.metrics["eval/accuracy"], result.model_uri

The same pre-flight, MLflow run and Ray Train run as `python -m orchestrator.submit`, with
exceptions where the CLI has exit codes: bad input raises `BadInput` (nothing started, no MLflow run),
Ctrl-C raises `Interrupted` (the run closed KILLED), and a training that fails, or a Ray that cannot be
started or reached, returns a `RunResult` with status FAILED and the error (the MLflow run marked FAILED),
as Ray Train's `fit()` hands back its result. Works from a notebook: nothing exits the interpreter, and when Ray is already
initialised (`ray.init()` in the notebook) the run uses that Ray and leaves it running.
"""

import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import yaml
from omegaconf import DictConfig, OmegaConf

from orchestrator.config import load_job
from orchestrator.errors import BadInput
from orchestrator.runner import driver
from orchestrator.runner.plan import RunResult
from orchestrator.runner.preflight import preflight
from orchestrator.runner.remote import is_job_server_address

Job = Union[str, Path, Mapping[str, Any], DictConfig]


def run(job: Job, overrides: Sequence[str] = (), address: Optional[str] = None, *,
        resume: bool = False) -> RunResult:
    """Train `job` (a YAML path, a dict or a DictConfig) with `overrides` (`section.key=value`) on a local Ray of its
    own (`address` None and no `$RAY_ADDRESS`) or an existing cluster (`address`: its GCS address, `HOST:6379`, or
    "auto"), waited for at most `ray_start.CLUSTER_WAIT_S`.
    `resume`: continue the job file's newest interrupted run instead (as `submit --resume`)."""
    return train(job, overrides, address, resume=resume)[0]


def train(job: Job, overrides: Sequence[str] = (), address: Optional[str] = None, *,
          resume: bool = False) -> tuple[RunResult, int]:
    """`run()`, and the exit code `submit` exits with for it (0, or 1 for a failed training or a refused
    export)."""
    if is_job_server_address(address):
        raise BadInput(f"run(): {address} is a job server address; from Python, give the cluster's GCS address "
                       "(HOST:6379), or submit there with `python -m orchestrator.submit JOB --address URL`.")
    if isinstance(overrides, str):
        raise BadInput("run(): overrides is a list of 'section.key=value' strings, not one string.")
    written = None
    try:
        if isinstance(job, (str, Path)):
            job_path = Path(job)
        else:  # a mapping has no file: it is written to one, so the run's name and record have a job file
            if resume:
                raise BadInput("run(resume=True) continues a job file's run: give the job as a YAML path.")
            written = Path(tempfile.mkdtemp(prefix="ampflow-job-"))
            job_path = written / "job.yaml"
            content = OmegaConf.to_container(job) if isinstance(job, DictConfig) else dict(job)
            job_path.write_text(yaml.safe_dump(content, sort_keys=False))
        cfg = load_job(job_path, list(overrides))
        checked = preflight([cfg], job_path, address, resume=resume)
        plan = driver.plan_run_as_ray_starts(cfg, job_path, address, checked.runs[0])
        exit_code = driver.execute(plan)
        return plan.result, exit_code
    finally:
        if written is not None:
            shutil.rmtree(written, ignore_errors=True)
