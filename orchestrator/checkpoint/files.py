"""Train state <-> a checkpoint directory, never trusted half-written. No Ray here: the worker
adapter hands the directory to Ray Train (`orchestrator.runner.worker`), a Ray-free run keeps it itself.

A checkpoint directory holds, from every rank r that reported it:
- `train_state.pt` (rank 0): the shared part of the `TrainState` (fp32 weights, optimizer, scaler,
  schedule, counters, position, layout, the effective precision policy, the MLflow run id);
- `ampflow_checkpoint.json` (rank 0): what the driver needs to check a resume before Ray starts
  (`orchestrator.checkpoint.resume.CheckpointFacts`: position, layout, the model's shapes, precision);
- `rank<r>.pt`: that rank's RNG states and its unreported loss window;
- `manifest_rank<r>.json`: the SHA-256 of each of those files, written last.
A checkpoint is valid for a rank only when rank 0's and its own manifest exist and every file
matches its hash, so a truncated or half-uploaded directory is never loaded. Everything is
plain tensors, numbers and strings: it loads with `torch.load(weights_only=True)`.
"""

import errno
import hashlib
import json
import os
import pickle
import shutil
import tempfile
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from pyarrow import fs

from orchestrator.checkpoint.state import IncompatibleCheckpoint, TrainState

STATE_FILE = "train_state.pt"
FACTS_FILE = "ampflow_checkpoint.json"


class NonFiniteState(RuntimeError):
    """A checkpoint was due, but the train state is not finite on some rank: nothing was written."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (e.g. the disk is full); nothing of it was kept."""


class CorruptCheckpoint(Exception):
    """A checkpoint directory that is incomplete or does not match its manifest."""


def dir_name(step: int, attempt: int) -> str:
    """`checkpoint_<step>_<attempt>`: sorts by step, then attempt. A resumed attempt that reaches a step
    again writes a new directory instead of reusing one Ray Train may still hold (or delete)."""
    return f"checkpoint_{step:09d}_{attempt}"


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def manifest_file(rank: int) -> str:
    return f"manifest_rank{rank}.json"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_of(data: bytes) -> str:
    """The SHA-256 of file contents already read (the driver reads small files from storage whole)."""
    return hashlib.sha256(data).hexdigest()


def save_atomically(obj: Any, path: Path, save: Callable[[Any, Path], None]) -> None:
    """Write `path` in full or not at all: to `<path>.partial`, then renamed."""
    partial = path.with_name(path.name + ".partial")
    save(obj, partial)
    os.replace(partial, path)


def write_checkpoint_files(directory: Path, rank: int, shared: Optional[dict[str, Any]], own: dict[str, Any],
                           save: Callable[[Any, Path], None] = torch.save,
                           facts: Optional[dict[str, Any]] = None) -> None:
    """This rank's files (and on rank 0 `shared` = train_state.pt and `facts` = ampflow_checkpoint.json), then
    the manifest that vouches for them."""
    written = {}
    if shared is not None:
        save_atomically(shared, directory / STATE_FILE, save)
        written[STATE_FILE] = sha256(directory / STATE_FILE)
    if facts is not None:
        save_atomically(facts, directory / FACTS_FILE, lambda value, path: path.write_text(json.dumps(value)))
        written[FACTS_FILE] = sha256(directory / FACTS_FILE)
    save_atomically(own, directory / rank_file(rank), save)
    written[rank_file(rank)] = sha256(directory / rank_file(rank))
    (directory / manifest_file(rank)).write_text(json.dumps(written))


STAGING_PREFIX = "ampflow-ckpt-"
"""Staging directories are `<tmp>/ampflow-ckpt-<pid>-<random>`: the pid tells a crashed writer's from a live one's."""


def write_failure(exc: OSError, what: str, needed_bytes: Optional[int] = None) -> CheckpointWriteError:
    """The one message for a checkpoint that could not be written: what, why, the space it needs when the disk
    is full, and that the previous checkpoint is intact."""
    hint = ""
    if exc.errno == errno.ENOSPC or "No space left on device" in str(exc):
        needs = f" (this part of the checkpoint needs {needed_bytes / 2**20:.1f} MiB)" if needed_bytes else ""
        hint = f" The disk is full{needs}: free space or point checkpoint.storage_path elsewhere."
    return CheckpointWriteError(f"could not write {what} ({exc}).{hint} The previous checkpoint is intact; resume "
                                "from it with `python -m orchestrator.submit JOB --resume`.")


def directory_size(directory: Path) -> int:
    return sum(path.stat().st_size for path in Path(directory).rglob("*") if path.is_file())


def remove_stale_staging(directory: Optional[Path] = None) -> list[Path]:
    """Remove staging directories left by processes that are gone (killed while staging); returns them.
    A live process's staging directory is never touched."""
    removed = []
    for path in Path(directory or tempfile.gettempdir()).glob(f"{STAGING_PREFIX}*-*"):
        pid = path.name[len(STAGING_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


@contextmanager
def staged_checkpoint(rank: int, shared: Optional[dict[str, Any]], own: dict[str, Any], step: int,
                      save: Callable[[Any, Path], None] = torch.save,
                      facts: Optional[dict[str, Any]] = None) -> Iterator[Path]:
    """Write this rank's part of a checkpoint to a temporary directory and yield it (to be reported).

    A failed write (ENOSPC, I/O error) removes the temporary directory and raises
    CheckpointWriteError: the previous checkpoint stays the newest, untouched.
    """
    with tempfile.TemporaryDirectory(prefix=f"{STAGING_PREFIX}{os.getpid()}-") as tmp:
        try:
            write_checkpoint_files(Path(tmp), rank, shared, own, save, facts)
        except OSError as exc:
            raise write_failure(exc, f"the checkpoint of step {step} on rank {rank}") from exc
        yield Path(tmp)


def _verified(directory: Path, rank: int, name: str) -> Path:
    owner = 0 if name == STATE_FILE else rank
    manifest = directory / manifest_file(owner)
    if not manifest.is_file():
        raise CorruptCheckpoint(f"{manifest.name} is missing (the checkpoint was not completely written)")
    try:
        expected = json.loads(manifest.read_text())[name]
    except (ValueError, KeyError):
        raise CorruptCheckpoint(f"{manifest.name} does not list {name}") from None
    path = directory / name
    if not path.is_file() or sha256(path) != expected:
        raise CorruptCheckpoint(f"{name} is missing or does not match {manifest.name} (truncated or corrupt)")
    return path


def read_checkpoint(directory: Path, rank: int) -> TrainState:
    """The train state with this rank's own part (None if this rank wrote none)."""
    shared = torch.load(_verified(directory, rank, STATE_FILE), map_location="cpu", weights_only=True)
    own_file = directory / rank_file(rank)
    own = (torch.load(_verified(directory, rank, rank_file(rank)), map_location="cpu", weights_only=True)
           if own_file.exists() or (directory / manifest_file(rank)).exists() else None)
    try:
        return TrainState.from_files(shared, own)
    except IncompatibleCheckpoint as exc:
        raise CorruptCheckpoint(f"{directory.name}: {exc}") from None


Candidate = tuple[str, Callable[[], "AbstractContextManager[str]"]]
"""(where it is, for messages; a context manager opening it as a local directory), newest first."""


def checkpoint_names(filesystem: Any, run_dir: str) -> list[str]:
    """The names of the `checkpoint_*` directories in a run's storage directory (`filesystem`: pyarrow's, local or a
    storage URI's), newest first; complete or not (their manifests say)."""
    infos = filesystem.get_file_info(fs.FileSelector(run_dir, allow_not_found=True))
    return sorted((info.base_name for info in infos if info.type == fs.FileType.Directory
                   and info.base_name.startswith("checkpoint_")), reverse=True)


def local_candidates(directory: Path) -> list[Candidate]:
    """The checkpoints in a local run directory, newest first (a Ray-free run's own storage)."""
    names = checkpoint_names(fs.LocalFileSystem(), str(directory))
    return [(str(directory / name), lambda name=name: _as_is(directory / name)) for name in names]


@contextmanager
def _as_is(path: Path) -> Iterator[str]:
    yield str(path)


def load_newest_valid(candidates: Sequence[Candidate], rank: int,
                      agree: Callable[[bool], bool] = lambda ok: ok) -> tuple[Optional[TrainState], list[str]]:
    """The newest checkpoint every rank can load, and a warning for each one skipped.

    `agree(ok)` returns whether every rank found its candidate valid (an all-reduce in training),
    so all ranks settle on the same checkpoint even when only one rank's file is damaged.
    """
    if not candidates:
        return None, []
    warnings = []
    for where, open_directory in candidates:
        try:
            with open_directory() as directory:
                state, problem = read_checkpoint(Path(directory), rank), None
        except (CorruptCheckpoint, RuntimeError, OSError, EOFError, pickle.UnpicklingError) as exc:
            state, problem = None, str(exc)
        if agree(problem is None):
            return state, warnings
        warnings.append(f"checkpoint {where} is not usable"
                        + (f" on rank {rank}: {problem}" if problem else " on another rank")
                        + "; falling back to the one before it.")
    raise CorruptCheckpoint(f"no usable checkpoint in {candidates[0][0].rsplit('/', 1)[0]}: "
                            + " ".join(warnings) + " Start the job afresh (without --resume) or restore the files.")
