"""A run's checkpoints as the driver sees them in storage: read without Ray and without unpickling.

For each `checkpoint_*` directory of `<storage_path>/<run name>`, newest first, the driver reads only the small
files: `ampflow_checkpoint.json` (the checkpoint's facts, `orchestrator.checkpoint.resume.CheckpointFacts`), which
rank 0's manifest vouches for, and the manifests of every rank the checkpoint was written by (a checkpoint
missing one is incomplete and skipped, as the workers skip it; a sharded, FSDP, checkpoint's manifests list their
files under `files`). That works the same on a local path and on a storage URI (pyarrow's filesystems, as the run
record is read). A checkpoint written before the facts were
recorded is read whole from a local path (`torch.load(weights_only=True)`, every hash checked) and not at all
from a URI, where its train state may be large.
"""

import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from pyarrow import fs

from orchestrator.config.strategies import manifest_strategy
from orchestrator.precision.finite import first_nonfinite_tensor, named_tensors
from orchestrator.checkpoint.files import (FACTS_FILE, STATE_FILE, CorruptCheckpoint, checkpoint_names, manifest_file,
                                          read_checkpoint, sha256_of)
from orchestrator.checkpoint.resume import CheckpointFacts


def _filesystem(storage_path: str):
    """(pyarrow filesystem, path on it) for a local path or a storage URI."""
    return fs.FileSystem.from_uri(storage_path) if "://" in storage_path else (fs.LocalFileSystem(), storage_path)


@dataclass
class StoredCheckpoint:
    path: str
    """Where it is (for messages)."""
    facts: Optional[CheckpointFacts]
    """What it says about the run; None for an older checkpoint on a URI (not read)."""

    @property
    def finite(self) -> Optional[bool]:
        """Whether its weights and optimizer state are finite; None when not known."""
        return self.facts.finite if self.facts is not None else None

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rpartition("/")[2]


def _read(filesystem, path: str) -> Optional[bytes]:
    try:
        with filesystem.open_input_stream(path) as handle:
            return handle.read()
    except OSError:  # missing (an incomplete checkpoint), or unreadable
        return None


def _stored(filesystem, directory: str, local: bool) -> Optional[StoredCheckpoint]:
    """The checkpoint in `directory` when it is complete, else None."""
    manifest_text = _read(filesystem, f"{directory}/{manifest_file(0)}")
    try:
        manifest = json.loads(manifest_text) if manifest_text is not None else None
    except ValueError:
        manifest = None
    written = manifest_strategy(manifest)
    sharded = written is not None and written.shards
    files = manifest.get("files") if sharded else manifest  # an FSDP manifest lists its files under "files"
    if not isinstance(files, dict) or STATE_FILE not in files:
        return None
    if FACTS_FILE not in files:  # written before checkpoints carried their facts
        return _older(directory) if local and not sharded else StoredCheckpoint(directory, None)
    text = _read(filesystem, f"{directory}/{FACTS_FILE}")
    if text is None or sha256_of(text) != files[FACTS_FILE]:
        return None
    try:
        facts = CheckpointFacts.from_json(json.loads(text))
    except (ValueError, KeyError, TypeError):
        return None
    ranks = facts.layout.world_size if facts.layout is not None else 1
    if any(_read(filesystem, f"{directory}/{manifest_file(rank)}") is None for rank in range(1, ranks)):
        return None
    return StoredCheckpoint(directory, facts)


def _older(directory: str) -> Optional[StoredCheckpoint]:
    """A local checkpoint without its facts file, read whole; None when it does not verify."""
    try:
        state = read_checkpoint(Path(directory), 0)
    except (CorruptCheckpoint, RuntimeError, OSError, EOFError, pickle.UnpicklingError):
        return None
    facts = CheckpointFacts.of_state(state)
    facts.finite = first_nonfinite_tensor(named_tensors({"model": state.model, "optimizer": state.optimizer})) is None
    return StoredCheckpoint(directory, facts)


def _checkpoint_dirs(storage_path: str, run_name: str) -> Iterator[tuple[str, Optional[StoredCheckpoint]]]:
    """Each `checkpoint_*` directory of the run, newest first, with its checkpoint when complete (else None)."""
    filesystem, base = _filesystem(storage_path)
    run_dir = f"{base}/{run_name}"
    for name in checkpoint_names(filesystem, run_dir):
        yield f"{run_dir}/{name}", _stored(filesystem, f"{run_dir}/{name}", local="://" not in storage_path)


def stored_checkpoints(storage_path: str, run_name: str) -> Iterator[StoredCheckpoint]:
    """The run's complete checkpoints, newest first."""
    return (stored for _, stored in _checkpoint_dirs(storage_path, run_name) if stored is not None)


def newest(storage_path: str, run_name: str) -> Optional[StoredCheckpoint]:
    """The checkpoint a resume would continue from (the newest complete one), or None."""
    return next(stored_checkpoints(storage_path, run_name), None)


def newest_finite(storage_path: str, run_name: str) -> Optional[StoredCheckpoint]:
    """The newest checkpoint known to be finite, or None."""
    return next((stored for stored in stored_checkpoints(storage_path, run_name) if stored.finite), None)


def remove_unfinished(storage_path: str, run_name: str) -> list[str]:
    """Remove the checkpoint directories newer than the run's newest complete one that are incomplete; returns
    their paths. Only once the run's workers are gone: a rank whose copy to storage failed removes what it wrote,
    but a peer whose copy succeeded (into the same directory, maybe after that removal) leaves its part behind."""
    filesystem, _ = _filesystem(storage_path)
    removed = []
    for directory, stored in _checkpoint_dirs(storage_path, run_name):
        if stored is not None:
            break
        filesystem.delete_dir(directory)
        removed.append(directory)
    return removed
