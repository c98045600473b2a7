"""How a run ends, once training returned or failed: the `RunResult` a caller gets, what the console says, what a
failed run can be continued from, and the MLflow run closed (`RunEnd`) FINISHED, or FAILED with its cause.

`failed()` for a run whose training failed (the worker's exception first, or the stalled rank a watchdog named);
`finished()` for one that trained to the end (its model and outputs logged; exit 1 all the same when MLflow did
not take all of it).
"""

import re
import sys
from pathlib import Path
from typing import Optional, Sequence

from orchestrator.errors import EXIT_FAILED, EXIT_OK
from orchestrator.precision import PolicyNotHonoured
from orchestrator.runner import outputs, stalls
from orchestrator.checkpoint.stored import newest_finite, remove_unfinished
from orchestrator.runner.records import storage_uri
from orchestrator.runner.plan import RunPlan, RunResult
from orchestrator.runner.run_end import RunEnd
from orchestrator.tracking.secrets import redact
from orchestrator.tracking.tables import audit_summary, audit_summary_html
from orchestrator.tracking.time_breakdown import log_goodput
from orchestrator.tracking.tracker import view_hint
from orchestrator.checkpoint.files import CheckpointWriteError
from orchestrator.common.report import Report


def _last_frame(traceback_text: str) -> Optional[str]:
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', traceback_text)
    return f"  at {frames[-1][0]}:{frames[-1][1]} in {frames[-1][2]}" if frames else None


def summarize_failure(exc: BaseException) -> str:
    """The worker's exception first: type, message, and where it was raised."""
    from ray.train import ControllerError, WorkerGroupError  # Ray is imported by then; not at this module's import

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


def failed(plan: RunPlan, end: RunEnd, failure, stalled: Sequence["stalls.StalledAttempt"] = ()) -> int:
    tracker = end.tracker
    stall = stalls.stalled_cause(list(stalled), failure)  # a watchdog ended the last attempt: name the stalled rank
    cause = redact(stall or summarize_failure(failure))
    plan.result = RunResult(tracker.run_id if tracker is not None else None, "FAILED", {}, None, None, error=cause)
    if checkpoint_write_failed(failure):  # the workers are gone: no copy to storage is in flight any more
        remove_unfinished(plan.cfg.checkpoint.storage_path, plan.run_name)
    stalls.log_and_print(list(stalled), tracker, failed_by_last=stall is not None)
    goodput = None
    if tracker is not None:
        log_failed_audit(failure, tracker)
        tracker.log_plots(plan.cfg.precision.preset)
        goodput = log_goodput(tracker, end.clock, end.clock.last_step() if end.clock is not None else 0)
    end.close("FAILED")
    print(f"\ntraining failed: {cause}", file=sys.stderr)
    if goodput is not None:
        print(goodput.line(), file=sys.stderr)
    where = f"MLflow run {tracker.run_id} marked FAILED. " if tracker is not None and end.closed else ""
    print(f"{where}Full worker logs: session_latest/logs in Ray's temp dir on the head node (/tmp/ray by default). "
          f"{resume_hint(plan)}", file=sys.stderr)
    return EXIT_FAILED


def log_failed_audit(failure, tracker) -> None:
    """A run failed by its precision audit (`PolicyNotHonoured`) logs that audit, `precision/audit.json` and its
    summary, as a run that passed it does: what each layer stored and computed in shows which rule to add."""
    causes = (getattr(failure, "worker_failures", None) or {}).values()
    entries = next((cause.entries for cause in causes if isinstance(cause, PolicyNotHonoured) and cause.entries),
                   None)
    if entries:
        try:
            tracker.log_dict(entries, "precision/audit.json")
            tracker.log_dict(audit_summary(entries), "precision/audit_summary.json")
            tracker.log_text(audit_summary_html(entries), "precision/audit_summary.html")
        except Exception as exc:  # the run is ending FAILED either way; say what was not logged
            print(f"warning: the failed audit could not be logged ({type(exc).__name__}: {exc})", file=sys.stderr)


def checkpoint_write_failed(failure) -> bool:
    """Whether a worker failed writing a checkpoint to storage (`CheckpointWriteError`: a full disk, a lost mount)."""
    causes = (getattr(failure, "worker_failures", None) or {}).values()
    return any(isinstance(cause, CheckpointWriteError) for cause in causes)


def resume_hint(plan: RunPlan) -> str:
    """What a failed run can be continued from: its newest finite checkpoint, named, or nothing."""
    try:
        stored = newest_finite(plan.cfg.checkpoint.storage_path, plan.run_name)
    except OSError as exc:  # storage itself is what failed
        return f"Its checkpoints could not be listed ({exc})."
    if stored is None:
        return ("No finite checkpoint was written: there is nothing to resume. Fix the cause, then run the job "
                "again without --resume.")
    where = storage_uri(plan.cfg.checkpoint.storage_path, stored.path)
    return (f"The newest finite checkpoint is {where} (step {stored.facts.global_step}); once the cause is "
            f"fixed, continue from it with: python -m orchestrator.submit {plan.job_path} --resume")


def finished(plan: RunPlan, end: RunEnd, result, module_sources: Sequence[Path]) -> int:
    cfg, tracker = plan.cfg, end.tracker
    checkpoints = storage_uri(cfg.checkpoint.storage_path, result.path)
    if tracker is None:
        end.close("FINISHED")
        print(f"\nTraining finished, but MLflow at {redact(plan.uri)} never answered: nothing was logged. "
              f"Checkpoints: {redact(checkpoints)}", file=sys.stderr)
        plan.result = RunResult(None, "FINISHED", Report.from_wire(result.metrics or {}).metrics, checkpoints, None)
        return EXIT_OK
    model_uri, exit_code = outputs.log_outputs(cfg, result, tracker, module_sources)
    goodput = log_goodput(tracker, end.clock, Report.from_wire(result.metrics or {}).step)  # its end: now
    end.close("FINISHED")
    if end.incomplete or not end.closed:
        return _incomplete(plan, end, result)

    final = {**Report.from_wire(result.metrics or {}).metrics, **tracker.latest_metrics()}
    print(f"\nRun finished: {tracker.run_id}")
    evaluated = sorted(key for key in final if key.startswith("eval/"))  # eval/loss and every task.metrics
    for key in (*evaluated, "train/loss", "amp/loss_scale", "amp/skipped_steps", "perf/samples_per_s"):
        if key in final:
            print(f"  {key:<20} {final[key]:.6g}")
    if goodput is not None:
        print(f"  {goodput.line()}")
    print(f"Checkpoints: {redact(checkpoints)}")
    if model_uri is not None:
        print(f"Model:    {model_uri}  (mlflow.pytorch.load_model / mlflow.pyfunc.load_model)")
    print(f"View it:  {redact(view_hint(plan.uri, tracker.experiment_id, tracker.run_id))}")
    plan.result = RunResult(tracker.run_id, "FINISHED", final, checkpoints, model_uri)
    return exit_code


def _incomplete(plan: RunPlan, end: RunEnd, result) -> int:
    """Training finished but MLflow did not take all of the run, or could not close it: exit 1 (never a success),
    with one line saying what is missing, where the run's data still is and how to get it into MLflow."""
    tracker, checkpoints = end.tracker, storage_uri(plan.cfg.checkpoint.storage_path, result.path)
    if end.incomplete:
        what = f"{end.why_incomplete()}"
    else:
        what = f"MLflow could not close the run ({next(iter(end.refusals.summary()), 'its store refused')})"
    state = "marked FAILED (tag tracking_incomplete)" if end.closed else "left RUNNING (its store refuses writes)"
    error = f"run {plan.run_name} trained to the end, but {what}"
    plan.result = RunResult(tracker.run_id, "FAILED", {**Report.from_wire(result.metrics or {}).metrics,
                                                        **tracker.latest_metrics()}, checkpoints, None,
                            error=redact(error))
    print(f"\nerror: {redact(error)}. MLflow run {tracker.run_id} {state}. Nothing trained is lost: the "
          f"checkpoints are in {redact(checkpoints)}, and the reports MLflow lacks are kept in them (the replay "
          "outbox). "
          f"{_recovery(plan)}", file=sys.stderr)
    return EXIT_FAILED


def _recovery(plan: RunPlan) -> str:
    try:
        stored = newest_finite(plan.cfg.checkpoint.storage_path, plan.run_name)
    except OSError:
        stored = None
    newest = (f" from {storage_uri(plan.cfg.checkpoint.storage_path, stored.path)} (step {stored.facts.global_step})"
              if stored is not None else "")
    return (f"Once the store takes writes again, `python -m orchestrator.submit {plan.job_path} --resume` "
            f"continues the same run{newest}: it logs what MLflow lacks and closes the run.")
