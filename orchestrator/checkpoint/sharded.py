"""Sharded checkpoints under FSDP: the model and optimizer through torch.distributed.checkpoint (DCP), with the
guarantees of the DDP checkpoints (`orchestrator.checkpoint.files`).

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
reshards, exactly too). An optimizer that has not stepped yet (every step so far skipped by the loss scaler)
has no state to save: the checkpoint then holds the model alone and a resume starts the optimizer afresh, as
it is (asking torch for its state would first create it, stepping it once at learning rate 0).

`read_full_model` reads the whole model back in one process without a process group (the driver: the logged
MLflow model and the export come from the shards).
"""

import io
import json
import os
import pickle
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from orchestrator.config.strategies import DDP, FSDP, manifest_strategy
from orchestrator.checkpoint.files import (FACTS_FILE, STAGING_PREFIX, STATE_FILE, Candidate, CorruptCheckpoint,
                                           manifest_file, rank_file, save_atomically, sha256,
                                           write_failure)

SHARDED_DIR = "sharded"
METADATA = f"{SHARDED_DIR}/.metadata"
STRATEGY = FSDP.name


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
                             save: Callable[[Any, Path], None] = torch.save,
                             facts: Optional[dict[str, Any]] = None) -> None:
    """Every rank (a collective): its shards of the model and optimizer, rank 0 the metadata, `shared` and `facts`
    (`ampflow_checkpoint.json`, what the driver reads before a resume), each its `own` part; then each its
    manifest, last. The caller gives every rank rank 0's buffers first (`FsdpStrategy.checkpoint_format`)."""
    directory = Path(directory)
    try:
        dcp.save(_live_state(model, optimizer, stepped=bool(optimizer.state)),
                 storage_writer=FileSystemWriter(directory / SHARDED_DIR, sync_files=True))
    except CheckpointException as exc:  # a BaseException: turned into what the caller handles
        rank_failed, failure = _first_failure(exc)
        if isinstance(failure, OSError):
            raise failure from None
        raise RuntimeError(f"could not write the sharded checkpoint (rank {rank_failed}: {failure})") from None
    files = sorted(f"{SHARDED_DIR}/{path.name}" for path in (directory / SHARDED_DIR).glob(f"__{rank}_*.distcp"))
    if rank == 0:
        files.append(METADATA)
        save_atomically(shared if shared is not None else {}, directory / STATE_FILE, save)
        files.append(STATE_FILE)
        if facts is not None:
            save_atomically(facts, directory / FACTS_FILE, lambda value, path: path.write_text(json.dumps(value)))
            files.append(FACTS_FILE)
    save_atomically(own, directory / rank_file(rank), save)
    files.append(rank_file(rank))
    manifest = {"strategy": STRATEGY, "world_size": world_size,
                "files": {name: sha256(directory / name) for name in files}}
    (directory / manifest_file(rank)).write_text(json.dumps(manifest))


def _live_state(model: nn.Module, optimizer: torch.optim.Optimizer, stepped: bool) -> dict[str, Any]:
    """The live model's (and, once the optimizer has state, the optimizer's) sharded state dicts, by FQN."""
    if not stepped:
        return {"model": get_model_state_dict(model)}
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def _first_failure(exc: CheckpointException) -> tuple[int, BaseException]:
    """The first failing rank and its exception (DCP gathers every rank's)."""
    rank, (failure, _trace) = next(iter(sorted(exc.failures.items())))
    return rank, failure


@contextmanager
def staged_sharded_checkpoint(rank: int, world_size: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                              shared: Optional[dict[str, Any]], own: dict[str, Any], step: int,
                              facts: Optional[dict[str, Any]] = None) -> Iterator[Path]:
    """This rank's part of a sharded checkpoint in a temporary directory, yielded to be reported (Ray Train, or
    the Ray-free session, merges every rank's directory into one). A failed write raises CheckpointWriteError on
    the rank that failed (DCP's own write failures on every rank), and nothing of it is kept."""
    with tempfile.TemporaryDirectory(prefix=f"{STAGING_PREFIX}{os.getpid()}-") as tmp:
        try:
            write_sharded_checkpoint(Path(tmp), rank, world_size, model, optimizer, shared, own, facts=facts)
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
    if manifest_strategy(manifest) is not FSDP:
        strategy = manifest.get("strategy", DDP.name) if isinstance(manifest, dict) else "?"
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
            if not path.is_file() or sha256(path) != expected:
                raise CorruptCheckpoint(f"{name} is missing or does not match {manifest_file(writer)} "
                                        "(truncated or corrupt)")
    try:
        read_metadata(directory / METADATA)
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
        raise CorruptCheckpoint(f"{METADATA} is not DCP metadata ({exc})") from None


def load_shards(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank (a collective), after `verify_sharded_checkpoint` passed on all: load the shards into the live
    model and optimizer (an optimizer the checkpoint holds no state of is left as it is: it had not stepped)."""
    directory = Path(directory)
    try:
        saved = read_metadata(directory / METADATA).state_dict_metadata
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
        raise CorruptCheckpoint(f"{directory.name}: the shards could not be loaded ({type(exc).__name__}: "
                                f"{exc})") from None
    stepped = any(key.startswith("optimizer.") for key in saved)
    state = _live_state(model, optimizer, stepped)
    try:
        dcp.load(state, storage_reader=_SafeReader(directory / SHARDED_DIR), planner=_SafePlanner())
    except CheckpointException as exc:  # a BaseException, the same on every rank
        rank_failed, failure = _first_failure(exc)
        raise CorruptCheckpoint(f"{directory.name}: the shards could not be loaded (rank {rank_failed}: "
                                f"{type(failure).__name__}: {failure})") from None
    if stepped:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        set_model_state_dict(model, state["model"])


def read_rank_files(directory: Path, rank: int) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """(train_state.pt's dict, this rank's own dict or None if it wrote none), as `verify_sharded_checkpoint` vouched
    for them."""
    shared = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
    own_file = directory / rank_file(rank)
    own = torch.load(own_file, map_location="cpu", weights_only=True) if own_file.is_file() else None
    return shared, own


def read_sharded_checkpoint(directory: Path, rank: int, model: nn.Module, optimizer: torch.optim.Optimizer
                            ) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """Every rank (a collective), after `verify_sharded_checkpoint` passed on all: load the shards into the live
    model and optimizer; returns (train_state.pt's dict, this rank's own dict or None if it wrote none)."""
    load_shards(Path(directory), model, optimizer)
    return read_rank_files(Path(directory), rank)


def read_full_model(directory: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model of a sharded checkpoint, in this process alone (no process group: the driver), as a state
    dict for `model` (its plain, unsharded form): floating tensors in fp32 (the shards' values, exact under master
    weights), the others in their own dtype. Verify the checkpoint first (`verify_sharded_checkpoint(directory, 0,
    1)` hashes every file)."""
    directory = Path(directory)
    state = {key: torch.empty(value.shape, dtype=torch.float32 if value.is_floating_point() else value.dtype)
             for key, value in model.state_dict().items()}
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process, as asked
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": state}, storage_reader=_SafeReader(directory / SHARDED_DIR), planner=_SafePlanner(),
                     no_dist=True)
    except CheckpointException as exc:
        _, failure = _first_failure(exc)
        raise CorruptCheckpoint(f"{directory.name}: the model could not be read from the shards "
                                f"({type(failure).__name__}: {failure})") from None
    return state


def load_newest_valid_sharded(candidates: Sequence[Candidate], rank: int, world_size: int, model: nn.Module,
                              optimizer: torch.optim.Optimizer, agree: Callable[[bool], bool] = lambda ok: ok
                              ) -> tuple[Optional[tuple[dict[str, Any], Optional[dict[str, Any]]]], list[str]]:
    """The newest checkpoint that is valid on every rank, loaded into `model` and `optimizer`, and a warning for
    each one skipped. `agree(ok)`: whether every rank found its share valid (an all-reduce in training)."""
    def use(directory: Path, files):
        load_shards(directory, model, optimizer)
        return files

    return newest_valid_sharded(candidates, rank, world_size, lambda directory: read_rank_files(directory, rank),
                                use, agree)


def newest_valid_sharded(candidates: Sequence[Candidate], rank: int, world_size: int, read: Callable[[Path], Any],
                         use: Callable[[Path, Any], Any], agree: Callable[[bool], bool] = lambda ok: ok
                         ) -> tuple[Any, list[str]]:
    """The newest checkpoint every rank verified (`verify_sharded_checkpoint`, then `read(directory)` on each rank,
    whose CorruptCheckpoint or ValueError counts against it too), used while it is open: `use(directory, read's
    result)` on every rank (a collective). Returns what `use` returned (None without candidates) and a warning for
    each checkpoint skipped."""
    warnings = []
    for where, open_directory in candidates:
        with open_directory() as directory:
            try:
                verify_sharded_checkpoint(Path(directory), rank, world_size)
                found, problem = read(Path(directory)), None
            except (CorruptCheckpoint, OSError, EOFError, pickle.UnpicklingError, ValueError, RuntimeError) as exc:
                found, problem = None, str(exc)
            if agree(problem is None):
                return use(Path(directory), found), warnings
        warnings.append(f"checkpoint {where} is not usable"
                        + (f" on rank {rank}: {problem}" if problem else " on another rank")
                        + "; falling back to the one before it.")
    if not candidates:
        return None, []
    raise CorruptCheckpoint(f"no usable checkpoint in {candidates[0][0].rsplit('/', 1)[0]}: "
                            + " ".join(warnings) + " Start the job afresh (without --resume) or restore the files.")
