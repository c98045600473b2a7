"""Sharded checkpoints under FSDP: the model and optimizer through torch.distributed.checkpoint (DCP), with the
guarantees of the DDP checkpoints (`orchestrator.train.checkpoint`).

A checkpoint directory holds, from each rank r of the N that wrote it:
- `sharded/__<r>_0.distcp`: rank r's shards of the parameters and of the optimizer state; rank 0's
  `sharded/.metadata` says where every shard lies (DCP stores each item all ranks hold alike, such as
  buffers, step counts and param groups, once, in one rank's file);
- `train_state.pt` (rank 0) and `rank<r>.pt`: the rest of the train state, as under DDP;
- `manifest_rank<r>.json`, written last: `{"strategy": "fsdp", "world_size": N, "files": {path: sha256}}`.

A checkpoint is valid only when all N manifests exist and every file matches its hash: DCP may read any
rank's file for what it needs, so the loading ranks split the hashing between them and agree (one
all-reduce) before any of them loads. Loading unpickles nothing: DCP's metadata is read by an unpickler
that builds only DCP's own metadata classes, its non-tensor items (param groups) load with
`torch.load(weights_only=True)`, as DCP itself loads its tensors. The values are copied byte for byte into
the live shards, so a resumed run goes on bit-identically (with the same world size: another world size
reshards, exactly too).
"""

import hashlib
import io
import json
import os
import pickle
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from orchestrator.train.checkpoint import (STAGING_PREFIX, STATE_FILE, Candidate, CorruptCheckpoint, manifest_file,
                                           rank_file, write_failure)
from orchestrator.train.fsdp import broadcast_buffers

SHARDED_DIR = "sharded"
METADATA = f"{SHARDED_DIR}/.metadata"
STRATEGY = "fsdp"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# -- reading without unpickling ------------------------------------------------------------------------------

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
     ("collections", "OrderedDict")}
"""What DCP's `.metadata` pickle is made of (torch 2.14), besides dtypes: plain data classes and values."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata: refused")


def read_metadata(path: Path) -> Any:
    """DCP's `.metadata`, built from DCP's own classes only (anything else is refused, never called)."""
    with open(path, "rb") as handle:
        return _MetadataUnpickler(handle).load()


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner, but its non-tensor items (param groups: numbers, strings, tuples) load with
    weights_only=True, where DefaultLoadPlanner unpickles them with weights_only=False."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


# -- writing -------------------------------------------------------------------------------------------------

def write_sharded_checkpoint(directory: Path, rank: int, world_size: int, model: nn.Module,
                             optimizer: torch.optim.Optimizer, shared: Optional[dict[str, Any]], own: dict[str, Any],
                             save: Callable[[Any, Path], None] = torch.save) -> None:
    """Every rank (a collective): its shards of the model and optimizer, rank 0 the metadata and `shared`, each its
    `own` part; then each its manifest, last. Buffers are rank 0's on every rank first (as the next forward would
    make them), so whichever rank's copy DCP keeps, it is rank 0's."""
    directory = Path(directory)
    broadcast_buffers(model)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_state, "optimizer": optimizer_state},
                 storage_writer=FileSystemWriter(directory / SHARDED_DIR, sync_files=True))
    except CheckpointException as exc:  # a BaseException: turned into what the caller handles
        rank_failed, failure = _first_failure(exc)
        if isinstance(failure, OSError):
            raise failure from None
        raise RuntimeError(f"could not write the sharded checkpoint (rank {rank_failed}: {failure})") from None
    files = sorted(f"{SHARDED_DIR}/{path.name}" for path in (directory / SHARDED_DIR).glob(f"__{rank}_*.distcp"))
    if rank == 0:
        files.append(METADATA)
        _save_atomically(shared if shared is not None else {}, directory / STATE_FILE, save)
        files.append(STATE_FILE)
    _save_atomically(own, directory / rank_file(rank), save)
    files.append(rank_file(rank))
    manifest = {"strategy": STRATEGY, "world_size": world_size,
                "files": {name: _sha256(directory / name) for name in files}}
    (directory / manifest_file(rank)).write_text(json.dumps(manifest))


def _first_failure(exc: CheckpointException) -> tuple[int, BaseException]:
    """The first failing rank and its exception (DCP gathers every rank's)."""
    rank, (failure, _trace) = next(iter(sorted(exc.failures.items())))
    return rank, failure


def _save_atomically(obj: Any, path: Path, save: Callable[[Any, Path], None]) -> None:
    partial = path.with_name(path.name + ".partial")
    save(obj, partial)
    os.replace(partial, path)


@contextmanager
def staged_sharded_checkpoint(rank: int, world_size: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                              shared: Optional[dict[str, Any]], own: dict[str, Any], step: int) -> Iterator[Path]:
    """This rank's part of a sharded checkpoint in a temporary directory, yielded to be reported (Ray Train, or
    the Ray-free session, merges every rank's directory into one). A failed write raises CheckpointWriteError on
    the rank that failed (DCP's own write failures on every rank), and nothing of it is kept."""
    with tempfile.TemporaryDirectory(prefix=f"{STAGING_PREFIX}{os.getpid()}-") as tmp:
        try:
            write_sharded_checkpoint(Path(tmp), rank, world_size, model, optimizer, shared, own)
        except OSError as exc:
            raise write_failure(exc, f"the sharded checkpoint of step {step} on rank {rank}") from exc
        yield Path(tmp)


# -- verifying and reading -----------------------------------------------------------------------------------

def _manifest(directory: Path, rank: int) -> dict[str, Any]:
    path = directory / manifest_file(rank)
    if not path.is_file():
        raise CorruptCheckpoint(f"{path.name} is missing (the checkpoint was not completely written)")
    try:
        manifest = json.loads(path.read_text())
    except ValueError:
        raise CorruptCheckpoint(f"{path.name} is not JSON (truncated or corrupt)") from None
    if not isinstance(manifest, dict) or manifest.get("strategy") != STRATEGY:
        strategy = manifest.get("strategy", "ddp") if isinstance(manifest, dict) else "?"
        raise CorruptCheckpoint(f"{path.name}: written under scaling.strategy {strategy!r}, not 'fsdp': resume it "
                                "with the strategy that wrote it")
    if not isinstance(manifest.get("world_size"), int) or not isinstance(manifest.get("files"), dict):
        raise CorruptCheckpoint(f"{path.name} lacks the world size or the files (corrupt)")
    return manifest


def verify_sharded_checkpoint(directory: Path, rank: int, world_size: int) -> None:
    """This rank's share of the check that `directory` is a complete, intact sharded checkpoint (raises
    CorruptCheckpoint): every writer's manifest is there, and this rank hashes the files of writers
    r, r + world_size, ... (with every rank's share, all of them), plus the files it reads itself."""
    directory = Path(directory)
    writers = _manifest(directory, 0)["world_size"]
    manifests = {writer: _manifest(directory, writer) for writer in range(writers)}
    mine = {writer for writer in range(writers) if writer % world_size == rank}
    for writer, manifest in manifests.items():
        for name, expected in manifest["files"].items():
            reads_it = name == STATE_FILE or name == rank_file(rank) or name == METADATA
            if writer not in mine and not reads_it:
                continue
            path = directory / name
            if not path.is_file() or _sha256(path) != expected:
                raise CorruptCheckpoint(f"{name} is missing or does not match {manifest_file(writer)} "
                                        "(truncated or corrupt)")
    try:
        read_metadata(directory / METADATA)
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
        raise CorruptCheckpoint(f"{METADATA} is not DCP metadata ({exc})") from None


def read_sharded_checkpoint(directory: Path, rank: int, model: nn.Module, optimizer: torch.optim.Optimizer
                            ) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """Every rank (a collective), after `verify_sharded_checkpoint` passed on all: load the shards into the live
    model and optimizer; returns (train_state.pt's dict, this rank's own dict or None if it wrote none)."""
    directory = Path(directory)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        dcp.load(state, storage_reader=_SafeReader(directory / SHARDED_DIR), planner=_SafePlanner())
    except CheckpointException as exc:  # a BaseException, the same on every rank
        rank_failed, failure = _first_failure(exc)
        raise CorruptCheckpoint(f"{directory.name}: the shards could not be loaded (rank {rank_failed}: "
                                f"{type(failure).__name__}: {failure})") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    shared = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
    own_file = directory / rank_file(rank)
    own = torch.load(own_file, map_location="cpu", weights_only=True) if own_file.is_file() else None
    return shared, own


def load_newest_valid_sharded(candidates: Sequence[Candidate], rank: int, world_size: int, model: nn.Module,
                              optimizer: torch.optim.Optimizer, agree: Callable[[bool], bool] = lambda ok: ok
                              ) -> tuple[Optional[tuple[dict[str, Any], Optional[dict[str, Any]]]], list[str]]:
    """The newest checkpoint that is valid on every rank, loaded into `model` and `optimizer`, and a warning for
    each one skipped. `agree(ok)`: whether every rank found its share valid (an all-reduce in training)."""
    warnings = []
    for where, open_directory in candidates:
        with open_directory() as directory:
            try:
                verify_sharded_checkpoint(Path(directory), rank, world_size)
                problem = None
            except (CorruptCheckpoint, OSError) as exc:
                problem = str(exc)
            if agree(problem is None):
                return read_sharded_checkpoint(Path(directory), rank, model, optimizer), warnings
        warnings.append(f"checkpoint {where} is not usable"
                        + (f" on rank {rank}: {problem}" if problem else " on another rank")
                        + "; falling back to the one before it.")
    if not candidates:
        return None, []
    raise CorruptCheckpoint(f"no usable checkpoint in {candidates[0][0].rsplit('/', 1)[0]}: "
                            + " ".join(warnings) + " Start the job afresh (without --resume) or restore the files.")


def all_ranks_agree(ok: bool, device: torch.device) -> bool:
    """True when `ok` on every rank (one all-reduce)."""
    flag = torch.tensor([0.0 if ok else 1.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(flag)
    return float(flag) == 0.0
