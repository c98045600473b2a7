"""What the ranks' watchdogs left in storage, brought to the run and the console.

Each attempt a watchdog ended left `<run dir>/diagnostics/stacks/<attempt>/rank<r>.txt` (one per rank that could
write; `orchestrator.train.hooks.watchdog`). After `fit()` the driver logs the newest such attempt of this submit
as the MLflow artifacts `diagnostics/stacks/rank<r>.txt`, any earlier one as
`diagnostics/stacks/attempt_<attempt>/rank<r>.txt`, and prints one line per attempt naming the stalled rank(s)
and where they were.
"""

import sys
from dataclasses import dataclass
from typing import Optional

from pyarrow import fs

from orchestrator.runner.records import _filesystem
from orchestrator.tracking.secrets import redact
from orchestrator.train.hooks.watchdog import STACKS, Stall


@dataclass
class StalledAttempt:
    name: str
    """The attempt's directory under `diagnostics/stacks/` in storage."""
    texts: dict[int, str]
    """Each rank's stack file that was written."""
    stall: Stall
    artifact_dir: str = STACKS
    """Where its files are in the MLflow run."""

    def cause(self) -> str:
        return self.stall.cause(f"{self.artifact_dir}/")


def attempts(storage_path: str, run_name: str) -> list[str]:
    """The attempts the watchdog ended, oldest first ([] when none, or storage cannot be listed)."""
    filesystem, base = _filesystem(storage_path)
    try:
        infos = filesystem.get_file_info(fs.FileSelector(f"{base}/{run_name}/{STACKS}", allow_not_found=True))
    except OSError:
        return []
    return sorted(info.base_name for info in infos if info.type == fs.FileType.Directory)


def read_attempt(storage_path: str, run_name: str, name: str, world_size: int) -> StalledAttempt:
    filesystem, base = _filesystem(storage_path)
    texts = {}
    for info in filesystem.get_file_info(fs.FileSelector(f"{base}/{run_name}/{STACKS}/{name}")):
        stem = info.base_name.removesuffix(".txt")
        if info.type == fs.FileType.File and stem.startswith("rank") and stem[4:].isdigit():
            with filesystem.open_input_stream(info.path) as handle:
                texts[int(stem[4:])] = handle.read().decode(errors="replace")
    return StalledAttempt(name, texts, Stall.of(texts, world_size))


def new_stalls(storage_path: str, run_name: str, world_size: int, before: set[str]) -> list[StalledAttempt]:
    """The attempts stalled since `before` (the attempts listed before `fit()`), oldest first, each with the
    artifact directory it is logged in."""
    found = []
    for name in attempts(storage_path, run_name):
        if name not in before:
            try:
                found.append(read_attempt(storage_path, run_name, name, world_size))
            except OSError as exc:  # storage trouble must not stop the run from being closed
                print(f"warning: the stacks in {STACKS}/{name} could not be read ({exc}).", file=sys.stderr)
    for earlier in found[:-1]:
        earlier.artifact_dir = f"{STACKS}/attempt_{earlier.name}"
    return found


def stalled_cause(stalls: list[StalledAttempt], failure: BaseException) -> Optional[str]:
    """The newest stalled attempt's cause when it is what ended the run: every failed worker died without an
    exception of its own (Ray Train's health check found its process gone, as a watchdog leaves it)."""
    failures = getattr(failure, "worker_failures", None) or {}
    died = failures and all(type(cause).__name__ == "WorkerHealthCheckFailedError" for cause in failures.values())
    return stalls[-1].cause() if stalls and died else None


def log_and_print(stalls: list[StalledAttempt], tracker, failed_by_last: bool) -> None:
    """Log each stalled attempt's stacks on the run, and print those Ray Train restarted (`failed_by_last`: the
    newest one ended the run, and the failure message says so)."""
    for number, attempt in enumerate(stalls, start=1):
        if tracker is not None:
            try:
                for rank, text in sorted(attempt.texts.items()):
                    tracker.log_text(text, f"{attempt.artifact_dir}/rank{rank}.txt")
            except Exception as exc:  # the console still names the stalled rank
                print(f"warning: the stacks of a stalled attempt could not be logged to MLflow "
                      f"({type(exc).__name__}: {redact(str(exc))[:300]}).", file=sys.stderr)
        if not (failed_by_last and number == len(stalls)):
            print(f"warning: an attempt stalled: {attempt.cause()}; Ray Train restarted it from the newest "
                  "checkpoint", file=sys.stderr)
