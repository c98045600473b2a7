"""Sharded checkpoints (`orchestrator.checkpoint.sharded`) keep the DDP checkpoints' guarantees: every file
hashed in a manifest, valid only when complete, and loading unpickles nothing. Written and read here in one process
(DCP without a process group); the two-rank round trip and exact resume are in test_fsdp.py."""

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from orchestrator.checkpoint.files import CorruptCheckpoint, local_candidates, write_checkpoint_files
from orchestrator.checkpoint.sharded import (SHARDED_DIR, load_newest_valid_sharded, read_sharded_checkpoint,
                                                   verify_sharded_checkpoint, write_sharded_checkpoint)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as meant here


class RunsCode:
    """Unpickling this creates the file `path`: what a hostile checkpoint would do instead."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(8, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def write(directory: Path, model, optimizer) -> Path:
    write_sharded_checkpoint(directory, 0, 1, model, optimizer, shared={"global_step": 2, "run_id": "r1"},
                             own={"window": {"loss_sum": 1.5}})
    return directory


def rehash(directory: Path, name: str) -> None:
    """Make the manifest vouch for `name` as it is now (an attacker who can write the files can do this too)."""
    import hashlib

    manifest_path = directory / "manifest_rank0.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][name] = hashlib.sha256((directory / name).read_bytes()).hexdigest()
    manifest_path.write_text(json.dumps(manifest))


def test_a_checkpoint_loads_back_into_fresh_model_and_optimizer_exactly(tmp_path):
    model, optimizer = trained(seed=0)
    directory = write(tmp_path / "ckpt", model, optimizer)
    manifest = json.loads((directory / "manifest_rank0.json").read_text())
    assert manifest["strategy"] == "fsdp" and manifest["world_size"] == 1
    assert set(manifest["files"]) == {f"{SHARDED_DIR}/__0_0.distcp", f"{SHARDED_DIR}/.metadata", "train_state.pt",
                                      "rank0.pt"}

    fresh, fresh_optimizer = trained(seed=1)
    verify_sharded_checkpoint(directory, 0, 1)
    shared, own = read_sharded_checkpoint(directory, 0, fresh, fresh_optimizer)
    assert shared == {"global_step": 2, "run_id": "r1"} and own == {"window": {"loss_sum": 1.5}}
    for (name, saved), loaded in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(saved, loaded), name
    saved_state, loaded_state = get_state_dict(model, optimizer)[1], get_state_dict(fresh, fresh_optimizer)[1]
    for key, moments in saved_state["state"].items():
        for name, value in moments.items():
            assert torch.equal(value, loaded_state["state"][key][name]), (key, name)


@pytest.mark.parametrize("damage, problem", [
    (lambda d: (d / "manifest_rank0.json").unlink(), "manifest_rank0.json is missing"),
    (lambda d: (d / SHARDED_DIR / "__0_0.distcp").write_bytes(b"cut"), "__0_0.distcp is missing or does not match"),
    (lambda d: (d / SHARDED_DIR / ".metadata").unlink(), ".metadata is missing or does not match"),
    (lambda d: (d / "rank0.pt").unlink(), "rank0.pt is missing or does not match"),
])
def test_an_incomplete_or_damaged_checkpoint_is_refused(tmp_path, damage, problem):
    directory = write(tmp_path / "ckpt", *trained(seed=0))
    damage(directory)
    with pytest.raises(CorruptCheckpoint, match=problem):
        verify_sharded_checkpoint(directory, 0, 1)


def test_a_checkpoint_is_complete_only_with_every_writers_manifest(tmp_path):
    directory = write(tmp_path / "ckpt", *trained(seed=0))
    manifest = json.loads((directory / "manifest_rank0.json").read_text())
    (directory / "manifest_rank0.json").write_text(json.dumps({**manifest, "world_size": 2}))  # rank 1's never came
    with pytest.raises(CorruptCheckpoint, match="manifest_rank1.json is missing"):
        verify_sharded_checkpoint(directory, 0, 1)


def test_a_ddp_checkpoint_is_refused_naming_the_strategy_that_wrote_it(tmp_path):
    write_checkpoint_files(tmp_path, 0, {"model": {}}, {"rng": {}, "window": {}})
    with pytest.raises(CorruptCheckpoint, match="written under scaling.strategy 'ddp', not 'fsdp'"):
        verify_sharded_checkpoint(tmp_path, 0, 1)


def test_the_newest_valid_checkpoint_is_loaded_and_a_damaged_newer_one_skipped(tmp_path):
    old_model, old_optimizer = trained(seed=0)
    write(tmp_path / "checkpoint_000000002_0", old_model, old_optimizer)
    newer = write(tmp_path / "checkpoint_000000004_0", *trained(seed=2))
    (newer / SHARDED_DIR / "__0_0.distcp").write_bytes(b"")
    fresh, fresh_optimizer = trained(seed=1)
    (shared, _), warnings = load_newest_valid_sharded(local_candidates(tmp_path), 0, 1, fresh, fresh_optimizer)
    assert shared["global_step"] == 2
    assert len(warnings) == 1 and "checkpoint_000000004_0 is not usable on rank 0" in warnings[0]
    assert all(torch.equal(a, b) for a, b in zip(old_model.state_dict().values(), fresh.state_dict().values()))


def test_metadata_that_would_run_code_is_refused_without_running_it(tmp_path):
    directory = write(tmp_path / "ckpt", *trained(seed=0))
    marker = tmp_path / "ran"
    (directory / SHARDED_DIR / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    rehash(directory, f"{SHARDED_DIR}/.metadata")
    with pytest.raises(CorruptCheckpoint, match=r"\.metadata is not DCP metadata .*pathlib.Path.touch is not part"):
        verify_sharded_checkpoint(directory, 0, 1)
    with pytest.raises(CorruptCheckpoint, match="the shards could not be loaded .*pathlib.Path.touch is not part"):
        read_sharded_checkpoint(directory, 0, *trained(seed=1))  # had it not been verified first
    assert not marker.exists()


def test_a_non_tensor_item_that_would_run_code_is_refused_where_dcp_would_run_it(tmp_path):
    model, optimizer = trained(seed=0)
    marker = tmp_path / "ran"
    optimizer.param_groups[0]["note"] = RunsCode(marker)  # saved by DCP as a pickled item of its own
    directory = write(tmp_path / "ckpt", model, optimizer)
    verify_sharded_checkpoint(directory, 0, 1)  # every file is what its writer wrote
    fresh, fresh_optimizer = trained(seed=1)
    fresh_optimizer.param_groups[0]["note"] = None  # DCP reads the items the live state has
    with pytest.raises(CorruptCheckpoint, match="the shards could not be loaded .*UnpicklingError: Weights only"):
        read_sharded_checkpoint(directory, 0, fresh, fresh_optimizer)
    assert not marker.exists()

    # What the refusal prevents: DCP's own loader unpickles the item, and it runs.
    copy = shutil.copytree(directory / SHARDED_DIR, tmp_path / "plain")
    model_state, optimizer_state = get_state_dict(fresh, fresh_optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=copy)
    assert marker.exists()
