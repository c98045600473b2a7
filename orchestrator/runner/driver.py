"""What `submit` does with a job the pre-flight passed: one MLflow run, Ray, the trainer, and a clean end.

`plan_run()` settles what can still be refused with exit 2 (MLflow reachable) and only then creates
or reopens the MLflow run of the run the pre-flight chose (`orchestrator.runner.preflight`); `execute()`
starts (or joins) Ray, trains, and always closes the run FINISHED, FAILED or KILLED
(`records.close_run`; how a run ends: `orchestrator.runner.outcome`). `plan_run_as_ray_starts()` does the first
while Ray starts, for `execute()` (Ray's start itself: `orchestrator.runner.ray_start`).
"""

import json
import logging
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from orchestrator import console
from orchestrator.train import models
from orchestrator.config import flatten, to_yaml
from orchestrator.config.job import Job
from orchestrator.errors import EXIT_FAILED, Interrupted, resume_hint_on_exit
from orchestrator.runner.preflight import RunChoice, check_cluster_capacity
from orchestrator.runner import records, stalls
from orchestrator.runner.outcome import failed, finished
from orchestrator.runner.plan import RunPlan, RunResult
from orchestrator.runner.records import close_run
from orchestrator.runner.run_end import RunEnd
from orchestrator.runner.ray_start import server_listens, start_ray
from orchestrator.tracking.progress import ConsoleProgress
from orchestrator.tracking.secrets import install_console_redaction, redact
from orchestrator.tracking.tracker import (
    RunTracker, TrackingUnavailable, policy_tags, quick_http_failures, resolve_uri, standard_tags,
)

logger = logging.getLogger("ampflow.runner")

CLOSE_ON_INTERRUPT_S = 5.0
"""After Ctrl-C or SIGTERM, how long the run's last reports, and then its KILLED status, each get to reach MLflow:
the command must end within `errors.INTERRUPT_DEADLINE_S`."""


def _start_run(cfg: DictConfig, job_path: Path, uri: str, run_name: str, parent_run_id: Optional[str] = None,
               datasets: Sequence = ()):
    tags = {**{str(k): str(v) for k, v in cfg.tracking.tags.items()}, **standard_tags(job_path, Path.cwd()),
            "preset": str(cfg.precision.preset or "custom"), "compute_dtype": cfg.precision.compute_dtype,
            **policy_tags(cfg.precision),
            "world_size": str(Job.of(cfg).workers), "device": "cuda" if cfg.scaling.use_gpu else "cpu",
            "job_file": str(job_path), "ray_run_name": run_name}
    if "mlflow.source.git.commit" in tags:
        tags["git_commit"] = tags["mlflow.source.git.commit"]  # ampflow's own name for it, kept
    if parent_run_id:  # MLflow's UI nests the run under its parent (a sweep)
        tags["mlflow.parentRunId"] = parent_run_id
    tracker = RunTracker.start(uri, cfg, run_name=run_name, tags=tags, params=flatten(cfg), config_yaml=to_yaml(cfg))
    try:
        if datasets:
            tracker.log_datasets(datasets)
    except BaseException as exc:  # the run exists from here on: it never stays RUNNING
        interrupted = isinstance(exc, (KeyboardInterrupt, SystemExit))
        close_run(tracker, "KILLED" if interrupted else "FAILED", timeout_s=10)
        raise
    return tracker


def record_precision_change(tracker, cfg: DictConfig, resumed_from) -> None:
    """A run resumed under another precision section says what trained when: the tags `preset` and
    `compute_dtype` name what trains from now on, `precision_history` lists each from its first step (JSON), and
    the params that changed are logged again as `from_step_<N>/precision.<key>` (MLflow keeps a param's first
    value)."""
    now = OmegaConf.to_container(cfg.precision, resolve=True)
    if resumed_from is None or not resumed_from.precision or resumed_from.precision == now:
        return
    before = flatten(OmegaConf.create({"precision": resumed_from.precision}))
    after = flatten(OmegaConf.create({"precision": now}))
    first = resumed_from.global_step + 1
    changed = {key: after.get(key, "(unset)") for key in {**before, **after} if before.get(key) != after.get(key)}
    history = json.loads(tracker.tags().get("precision_history") or "[]") or [
        {"from_step": 1, "preset": str(resumed_from.precision.get("preset") or "custom"),
         "compute_dtype": resumed_from.precision.get("compute_dtype")}]
    history.append({"from_step": first, "preset": str(cfg.precision.preset or "custom"),
                    "compute_dtype": cfg.precision.compute_dtype})
    tracker.log_params({f"from_step_{first}/{key}": value for key, value in changed.items()})
    tracker.set_tags({"preset": history[-1]["preset"], "compute_dtype": cfg.precision.compute_dtype,
                      "precision_history": json.dumps(history), **policy_tags(cfg.precision)})
    print(f"warning: --resume: the precision section differs from the one run {tracker.run_id} trained with "
          f"({', '.join(f'{key}: {before.get(key)} -> {value}' for key, value in sorted(changed.items()))}); "
          f"recorded on the run from step {first}.", file=sys.stderr)


def plan_run(cfg: DictConfig, job_path: Path, address: Optional[str], run: RunChoice,
             parent_run_id: Optional[str] = None) -> RunPlan:
    """The MLflow run of `run` (as `preflight` chose it), created or reopened; BadInput (exit 2) before
    anything is created when MLflow cannot be reached and `tracking.required`.

    `parent_run_id`: create the MLflow run as a child of that run (`orchestrator.cli.sweep`).
    """
    quick_http_failures()
    uri = resolve_uri(cfg.tracking.uri, Path.cwd())
    run_name, resume = run.name, run.resume
    created_storage = False
    if not resume:  # the run's directory is this submit's from here on, whoever else submits the same job
        created_storage = records.claim(cfg.checkpoint.storage_path, run_name)
    try:
        if resume and run.mlflow_run_id:
            tracker = RunTracker.open(uri, run.mlflow_run_id)
            tracker.reopen()
            record_precision_change(tracker, cfg, run.resumed_from)
        else:
            tracker = _start_run(cfg, job_path, uri, run_name, parent_run_id, run.datasets)
    except BaseException as exc:
        if isinstance(exc, TrackingUnavailable) and not cfg.tracking.required:
            tracker = None
        else:
            if not resume:  # nothing started: the name is free again
                records.release(cfg.checkpoint.storage_path, run_name, created_storage)
            raise
    if tracker is None:
        print(f"warning: MLflow at {redact(uri)} cannot be reached; training anyway (tracking.required: false). "
              "The run is created and filled in once it answers.", file=sys.stderr)
    return RunPlan(cfg, job_path, address, uri, run_name, resume, tracker, parent_run_id, datasets=run.datasets)


def plan_run_as_ray_starts(cfg: DictConfig, job_path: Path, address: Optional[str], run: RunChoice) -> RunPlan:
    """`plan_run` on a thread of its own while Ray starts on this one (Ray installs signal handlers, which only
    the main thread may): importing MLflow and creating the run take 1-2 s of the several a local Ray takes.

    A tracking server that refuses connections is found first, and the run planned before Ray starts (exit 2
    with nothing started, or the warning of `tracking.required: false`). What `plan_run` refuses otherwise is
    raised here, after the Ray started for it is shut down; a Ray that failed, or a Ctrl-C / SIGTERM while it
    started, is `execute`'s to end the created run with."""
    quick_http_failures()  # here, not on the thread: Ray's processes start with this environment
    if not server_listens(resolve_uri(cfg.tracking.uri, Path.cwd())):  # refused (exit 2) or warned before Ray
        plan = plan_run(cfg, job_path, address, run)
        plan.ray = start_ray(address, models.module_sources(cfg))
        return plan
    outcome: dict = {}

    def plan() -> None:
        try:
            outcome["plan"] = plan_run(cfg, job_path, address, run)
        except BaseException as exc:  # raised again on the main thread
            outcome["error"] = exc

    planning = threading.Thread(target=plan, name="ampflow-plan-run", daemon=True)
    planning.start()
    ray_start = start_ray(address, models.module_sources(cfg))
    # A run being created is waited for, so that an interrupt can close it (a command still ends within
    # errors.INTERRUPT_DEADLINE_S of the signal, whatever takes long).
    while planning.is_alive():
        try:
            planning.join()
        except KeyboardInterrupt as exc:
            ray_start.error = ray_start.error or exc
    if "error" in outcome:
        ray_start.release()
        interrupt = ray_start.error if isinstance(ray_start.error, (KeyboardInterrupt, SystemExit)) else None
        raise interrupt or outcome["error"]
    plan = outcome["plan"]
    plan.ray = ray_start
    return plan


def execute(plan: RunPlan) -> int:
    """Train the planned run; the MLflow run always ends FINISHED, FAILED or KILLED, whatever happens on the
    driver after it was created (Ray, storage, the writer, fit, logging the model, the export).

    Ctrl-C and SIGTERM close it KILLED and raise `Interrupted`, which says how to `--resume`; any other error
    on the driver closes it FAILED and is raised again.
    """
    install_console_redaction()  # idempotent: callers from Python get it too
    console.ensure_console()
    end = RunEnd(plan)
    with end.refusals.quiet_mlflow_errors():
        return _execute_and_end(plan, end)


def _execute_and_end(plan: RunPlan, end: "RunEnd") -> int:
    hint = (f"Run {plan.run_name} closed KILLED; continue it from its last checkpoint with: "
            f"python -m orchestrator.submit {plan.job_path} --resume")
    resume_hint_on_exit(hint)  # printed too if the command's deadline ends it while the run is closing
    try:
        code = _execute(plan, end)
        resume_hint_on_exit("")  # the run ended on its own: nothing to resume after a late signal
        return code
    except BaseException as exc:
        # SystemExit: SIGTERM while ray.init's own handler was installed (it exits with the signal's number).
        interrupted = isinstance(exc, (KeyboardInterrupt, SystemExit))
        if interrupted and plan.ray is not None:
            plan.ray.stop_training()  # the workers go now, stuck or not
        end.close("KILLED" if interrupted else "FAILED", timeout_s=CLOSE_ON_INTERRUPT_S if interrupted else 10)
        if interrupted:
            raise Interrupted(Interrupted.of(exc).signum, resume_hint=hint) from None
        resume_hint_on_exit("")
        raise
    finally:
        if plan.ray is not None:  # after the run is closed: its writer no longer calls Ray
            plan.ray.release()


def _execute(plan: RunPlan, end: RunEnd) -> int:
    # Ray's modules (a second or more to import) only once training starts: bad input exits before them.
    from ray.train import TrainingFailedError

    from orchestrator.runner.launch import build_trainer
    from orchestrator.tracking.attempts import AttemptWatch
    from orchestrator.tracking.nodes import NodeLossWatch
    from orchestrator.tracking.relay import RelayCallback, start_relay
    from orchestrator.tracking.writer import MlflowWriter

    cfg, storage = plan.cfg, plan.cfg.checkpoint.storage_path
    if plan.tracker is not None:
        verb = "Resuming" if plan.resume else "MLflow run"
        logger.info(f"{verb} {plan.tracker.run_id} ({plan.run_name}) in experiment '{cfg.tracking.experiment}' "
                    f"at {redact(plan.uri)}")
    module_sources = models.module_sources(cfg)
    ray_start = plan.ray = plan.ray or start_ray(plan.address, module_sources)
    if isinstance(ray_start.error, (KeyboardInterrupt, SystemExit)):
        raise ray_start.error  # execute() closes the run KILLED
    if ray_start.error is not None:  # e.g. no cluster at --address: the run was created, so close it
        end.close("FAILED", timeout_s=10)  # no record yet: nothing in storage to close
        error = f"Ray could not be started or reached ({type(ray_start.error).__name__}: " \
                f"{redact(str(ray_start.error))[:500]})"
        plan.result = RunResult(end.tracker.run_id if end.tracker is not None else None, "FAILED", {}, None, None,
                                error=error)
        print(f"\nerror: {error}. Check --address / RAY_ADDRESS, or leave both out to train on a local Ray.",
              file=sys.stderr)
        return EXIT_FAILED
    if plan.address:
        shortfall = check_cluster_capacity(cfg)
        if shortfall:
            print(f"warning: {shortfall}", file=sys.stderr)
    run_id = plan.tracker.run_id if plan.tracker is not None else None
    records.write_record(storage, plan.run_name, job_file=str(plan.job_path.resolve()), run_id=run_id,
                         tracking_uri=redact(plan.uri), status="RUNNING", launched_at=ray_start.launched_at)
    relay = start_relay()
    writer = end.writer = MlflowWriter(
        relay, plan.tracker,
        start_run=lambda: _start_run(cfg, plan.job_path, plan.uri, plan.run_name, plan.parent_run_id,
                                     plan.datasets),
        on_logged=lambda seq: records.write_logged_through(storage, plan.run_name, seq), refusals=end.refusals)
    writer.clock.submitted_at, end.clock = ray_start.launched_at, writer.clock  # the run's goodput, from submit
    if plan.resume and plan.tracker is not None:
        writer.resume_from_run()
    writer.start()
    trainer = build_trainer(cfg, run_name=plan.run_name, storage_path=storage,
                            callbacks=[RelayCallback(relay), NodeLossWatch(relay), AttemptWatch(relay)],
                            worker_runtime_env=ray_start.worker_runtime_env, run_id=run_id,
                            launched_at=ray_start.launched_at,
                            relay=relay)
    ray_start.trainer = trainer
    stalled_before = set(stalls.attempts(storage, plan.run_name))
    failure = None
    with ConsoleProgress(lambda: writer.newest, lines=writer.take_printed, show_progress=console.progress_shown()):
        try:
            with _sigint_kept():
                result = trainer.fit()
        except TrainingFailedError as exc:
            failure = exc
        # Inside the progress line: the writer takes the relay's last reports, so the final line is the last step.
        tracker = end.flush(cfg.tracking.flush_timeout_s)
    if tracker is not None and tracker.run_id != run_id:
        records.write_record(storage, plan.run_name, run_id=tracker.run_id)
    stalled = stalls.new_stalls(storage, plan.run_name, Job.of(cfg).workers.max, stalled_before)
    if failure is not None:
        return failed(plan, end, failure, stalled)
    stalls.log_and_print(stalled, end.tracker, failed_by_last=False)
    return finished(plan, end, result, module_sources)


@contextmanager
def _sigint_kept():
    """The SIGINT handler as it was before, afterwards: Ctrl-C stays the driver's (`launch.build_trainer`'s trainer
    leaves it alone; should Ray Train install its own, which swallows a Ctrl-C once the run ended, it goes)."""
    on_main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGINT) if on_main else None
    try:
        yield
    finally:
        if on_main and before is not None and signal.getsignal(signal.SIGINT) is not before:
            signal.signal(signal.SIGINT, before)
