"""`python -m orchestrator.submit JOB [key=value ...]`: train a job on Ray, tracked in MLflow.

Exit codes: 0 success; 2 bad input (nothing started or submitted, no MLflow run); 1 training
failed (the worker's exception first, the MLflow run marked FAILED).

With `--address http(s)://HEAD:8265` the job is validated here and run on that cluster
(`orchestrator.remote`): 0 it SUCCEEDED, 1 it FAILED or was STOPPED, 2 nothing was submitted.
"""

import argparse
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
from omegaconf import DictConfig

from orchestrator import data, models, remote
from orchestrator.config import flatten, load_job, to_yaml
from orchestrator.errors import BadInput

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.submit",
        description="Train a job file on Ray Train workers and track it in one MLflow run.",
    )
    parser.add_argument("job", help="job YAML file, e.g. jobs/cifar.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. run.epochs=2")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                        help="an existing Ray cluster (default: $RAY_ADDRESS, else a local Ray on this machine); "
                             "an http(s):// dashboard address submits the job there through the Job Submission API")
    parser.add_argument("--no-wait", action="store_true",
                        help="with an http(s):// --address: print the submitted job's id and exit")
    # Intermixed: overrides may come after options (`JOB --address URL run.epochs=2`), as users type them.
    return parser.parse_intermixed_args(argv)


def default_run_name(job_path: Path) -> str:
    return f"{job_path.stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def _last_frame(traceback_text: str) -> Optional[str]:
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', traceback_text)
    return f"  at {frames[-1][0]}:{frames[-1][1]} in {frames[-1][2]}" if frames else None


def summarize_failure(exc: BaseException) -> str:
    """The worker's exception first: type, message, and where it was raised."""
    from ray.train import ControllerError, WorkerGroupError

    if isinstance(exc, WorkerGroupError) and exc.worker_failures:
        rank, cause = sorted(exc.worker_failures.items())[0]
        # The traceback object does not survive serialisation; Ray Train puts each rank's traceback
        # text in the error message under "[Rank N Error Snippet]:".
        parts = re.split(r"\[Rank ([\d,]+) Error Snippet\]:", str(exc))[1:]  # ranks, text, ranks, text...
        snippets = {r: text for ranks, text in zip(parts[::2], parts[1::2]) for r in ranks.split(",")}
        lines = [f"worker rank {rank} raised {type(cause).__name__}: {cause}".rstrip()]
        where = _last_frame(snippets.get(str(rank), ""))
        if where:
            lines.append(where)
        if len(exc.worker_failures) > 1:
            lines.append(f"  ({len(exc.worker_failures)} workers failed: ranks {sorted(exc.worker_failures)})")
        return "\n".join(lines)
    if isinstance(exc, ControllerError):
        return f"the Ray Train controller failed: {exc.controller_failure}"
    return f"{type(exc).__name__}: {exc}"


def _init_ray(address: Optional[str], module_source: Optional[Path]) -> tuple[bool, Optional[dict]]:
    """Start (or connect to) Ray with worker logs kept off the console.

    Returns (whether we started it, the runtime env the workers need). A model module from the
    submit directory is shipped to every node as a job-level `py_modules` entry; Ray only uploads
    local code at the job level, so when the caller already initialised Ray (a notebook, the
    tests) we can only point same-machine workers at the directory through PYTHONPATH.
    """
    import ray

    if ray.is_initialized():
        if module_source is None:
            return False, None
        return False, {"env_vars": {"PYTHONPATH": str(module_source.parent)}}
    runtime_env = {"py_modules": [str(module_source)]} if module_source else None
    # Worker and controller logs stay in Ray's session directory; the console gets one progress line.
    ray.init(address=address, runtime_env=runtime_env, log_to_driver=False, logging_level="WARNING")
    return True, None


def _export_after_training(cfg: DictConfig, checkpoint, tracker) -> int:
    from orchestrator.checkpoint import load_state
    from orchestrator.export import ExportRefused, export

    model = models.build_model(cfg.model)
    model.load_state_dict(load_state(checkpoint)["model"])
    try:
        result = export(model, cfg, cfg.export.dtype, tracker, cfg.export.max_accuracy_drop)
    except ExportRefused as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(f"Exported as {result.dtype}: accuracy {result.accuracy:.4f} (fp32 {result.fp32_accuracy:.4f}, "
          f"delta {result.accuracy_delta:+.4f}), MLflow model 'model_{result.dtype}'")
    return EXIT_OK


def run_job(cfg: DictConfig, job_path: Path, address: Optional[str] = None) -> int:
    import ray
    from ray.train import TrainingFailedError

    from orchestrator.checkpoint import load_state
    from orchestrator.launch import build_trainer
    from orchestrator.progress import ConsoleProgress, ProgressBoard
    from orchestrator.tracking import MlflowMetricsCallback, RunTracker, git_commit, resolve_uri, view_hint

    base_dir = Path.cwd()
    uri = resolve_uri(cfg.tracking.uri, base_dir)
    run_name = cfg.run.name or default_run_name(job_path)
    module_source = models.module_source(cfg.model.name)
    started_ray, worker_runtime_env = _init_ray(address, module_source)
    previous_sigterm = _interrupt_on_sigterm()  # after ray.init: Ray's core worker sets a handler of its own
    try:
        tags = {
            "preset": str(cfg.precision.preset or "custom"),
            "compute_dtype": cfg.precision.compute_dtype,
            "world_size": str(cfg.scaling.num_workers),
            "device": "cuda" if cfg.scaling.use_gpu else "cpu",
            "job_file": str(job_path),
        }
        commit = git_commit(base_dir)
        if commit:
            tags["git_commit"] = commit
            tags["mlflow.source.git.commit"] = commit
        tracker = RunTracker.start(uri, cfg, run_name=run_name, tags=tags, params=flatten(cfg),
                                   config_yaml=to_yaml(cfg))
        print(f"MLflow run {tracker.run_id} ({run_name}) in experiment '{cfg.tracking.experiment}' at {uri}",
              file=sys.stderr)
        try:
            board = ProgressBoard.remote()
            trainer = build_trainer(
                cfg, run_name=run_name, storage_path=cfg.checkpoint.storage_path,
                callbacks=[MlflowMetricsCallback(uri, tracker.run_id, board)],
                worker_runtime_env=worker_runtime_env,
            )
            with ConsoleProgress(board):
                result = trainer.fit()
        except TrainingFailedError as exc:
            tracker.finish("FAILED")
            print(f"\ntraining failed: {summarize_failure(exc)}", file=sys.stderr)
            print(f"MLflow run {tracker.run_id} marked FAILED. Full worker logs: Ray's session directory "
                  "(/tmp/ray/session_latest/logs on the head node).", file=sys.stderr)
            return EXIT_FAILED
        except KeyboardInterrupt:
            tracker.finish("KILLED")
            raise
        except BaseException:
            tracker.finish("FAILED")
            raise

        if cfg.tracking.log_model and result.checkpoint is not None:
            try:
                model = models.build_model(cfg.model)
                model.load_state_dict(load_state(result.checkpoint)["model"])
                example = np.zeros((2, 3, 32, 32), dtype=np.float32)  # 3x32x32 everywhere; batch 2 keeps export batch-dynamic
                model_format = tracker.log_model(model, example, code_paths=[str(module_source)] if module_source else None)
                tracker.set_tag("model_format", model_format)
            except Exception as exc:  # the trained run stands even if the model cannot be logged
                print(f"warning: could not log the model to MLflow: {exc}", file=sys.stderr)
        exit_code = EXIT_OK
        if cfg.export.dtype is not None and result.checkpoint is not None:
            exit_code = _export_after_training(cfg, result.checkpoint, tracker)
        tracker.finish("FINISHED")

        final = {k: v for k, v in (result.metrics or {}).items() if "/" in k}
        print(f"\nRun finished: {tracker.run_id}")
        for key in ("eval/accuracy", "eval/loss", "train/loss", "amp/loss_scale", "amp/skipped_steps",
                    "perf/samples_per_s"):
            if key in final:
                print(f"  {key:<20} {final[key]:.6g}")
        print(f"Checkpoints: {result.path}")
        print(f"View it:  {view_hint(uri, tracker.experiment_id, tracker.run_id)}")
        return exit_code
    finally:
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
        if started_ray:
            ray.shutdown()


def _interrupt_on_sigterm():
    """`jobs stop` and Kubernetes end a job with SIGTERM: raise KeyboardInterrupt instead, so the MLflow
    run is closed KILLED rather than left RUNNING. Returns the previous handler (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"stopped by signal {signum}")

    return signal.signal(signal.SIGTERM, interrupt)


def check_precision(cfg: DictConfig, model) -> None:
    """Run the precision lint; findings stop the job (`error`), are printed (`warn`) or skipped (`off`)."""
    from orchestrator.precision.lint import lint

    if cfg.precision.lint == "off":
        return
    findings = lint(cfg, model)
    if not findings:
        return
    listed = "\n".join(f"  - {finding}" for finding in findings)
    if cfg.precision.lint == "error":
        raise BadInput(f"precision lint found {len(findings)} problem(s) with this job's policy:\n{listed}\n"
                       "Fix them, or set precision.lint: warn to train anyway.")
    print(f"warning: precision lint (precision.lint: warn):\n{listed}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    job_path = Path(args.job)
    to_cluster = remote.is_job_server_address(args.address)
    try:
        if args.no_wait and not to_cluster:
            raise BadInput("--no-wait needs a job server to submit to: --address http://HEAD:8265.")
        cfg = load_job(job_path, args.overrides)
        if args.dry_run:
            print(to_yaml(cfg), end="")
            return EXIT_OK
        if not to_cluster:  # a remote job reads its data on the cluster, which checks it there
            data.ensure_available(cfg.data)
        # Built on the CPU here, so a broken model or a dangerous precision policy fails before Ray starts.
        check_precision(cfg, models.build_model(cfg.model))
        if to_cluster:
            return remote.submit(job_path, args.overrides, args.address, wait=not args.no_wait)
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return run_job(cfg, job_path, args.address)


if __name__ == "__main__":
    sys.exit(main())
