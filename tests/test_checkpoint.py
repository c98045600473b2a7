"""Checkpoints are verified before they are trusted, fall back past damage, and survive a full disk."""

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch

from orchestrator.runner.worker import ray_candidates, remove_own_part
from orchestrator.train import rng
from orchestrator.checkpoint.files import (STATE_FILE, CheckpointWriteError, CorruptCheckpoint, load_newest_valid,
                                           local_candidates, manifest_file, rank_file, read_checkpoint,
                                           staged_checkpoint, write_checkpoint_files)
from orchestrator.checkpoint.state import TrainState


def train_state(step: int) -> TrainState:
    return TrainState(model={"w": torch.full((3,), float(step))}, optimizer={"state": {}, "param_groups": []},
                      scheduler={}, scaler={"scale": 1024.0}, counters={"skipped_steps": 0}, global_step=step,
                      report={"step": step})


def shared_state(step: int) -> dict:
    return train_state(step).to_files()[0]


def save(run_dir: Path, step: int, ranks=(0, 1)) -> Path:
    directory = run_dir / f"checkpoint_{step:09d}"
    directory.mkdir(parents=True)
    for rank in ranks:
        own = {"rng": rng.capture(), "window": {"loss_sum": 1.5 * rank, "samples": 32}}
        write_checkpoint_files(directory, rank, shared_state(step) if rank == 0 else None, own)
    return directory


def newest(run_dir: Path):
    """The candidates as the Ray Train worker sees them: every checkpoint in the run's storage, newest first."""
    from pyarrow import fs

    return ray_candidates(fs.LocalFileSystem(), str(run_dir))


def test_each_rank_reads_the_shared_state_and_its_own_part(tmp_path):
    directory = save(tmp_path, 8)
    state = read_checkpoint(directory, rank=1)
    assert state.global_step == 8 and torch.equal(state.model["w"], torch.full((3,), 8.0))
    assert state.rank.window == {"loss_sum": 1.5, "samples": 32}
    assert read_checkpoint(directory, rank=2).rank is None  # a rank that was not there (world grew)


@pytest.mark.parametrize("damage", ["truncate_state", "truncate_rank_file", "drop_manifest", "drop_state"])
def test_damaged_checkpoints_are_refused(tmp_path, damage):
    directory = save(tmp_path, 8)
    if damage == "truncate_state":
        with open(directory / STATE_FILE, "r+b") as handle:
            handle.truncate(100)
    elif damage == "truncate_rank_file":
        with open(directory / rank_file(1), "r+b") as handle:
            handle.truncate(10)
    elif damage == "drop_manifest":
        os.remove(directory / manifest_file(0))
    else:
        os.remove(directory / STATE_FILE)
    with pytest.raises(CorruptCheckpoint):
        read_checkpoint(directory, rank=1)


def test_fallback_to_the_previous_valid_checkpoint_names_the_bad_one(tmp_path):
    save(tmp_path, 4)
    save(tmp_path, 8)
    bad = save(tmp_path, 12)
    with open(bad / STATE_FILE, "r+b") as handle:
        handle.truncate(64)
    state, warnings = load_newest_valid(newest(tmp_path), rank=0)
    assert state.global_step == 8
    (warning,) = warnings
    assert "checkpoint_000000012" in warning and "falling back" in warning


def test_ranks_agree_on_one_checkpoint_when_only_another_ranks_file_is_damaged(tmp_path):
    save(tmp_path, 4)
    save(tmp_path, 8)
    # Rank 0's files are fine in both; the "other rank" refuses the newest: rank 0 must fall back too.
    votes = iter([False, True])
    state, warnings = load_newest_valid(newest(tmp_path), rank=0, agree=lambda ok: ok and next(votes))
    assert state.global_step == 4 and "on another rank" in warnings[0]


def test_no_usable_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    bad = save(tmp_path, 4)
    shutil.rmtree(bad)
    bad.mkdir()
    with pytest.raises(CorruptCheckpoint, match="no usable checkpoint"):
        load_newest_valid(newest(tmp_path), rank=0)


def test_a_checkpoint_holding_a_pickled_object_is_never_unpickled(tmp_path):
    directory = save(tmp_path, 4)
    evil = {**shared_state(4), "payload": Path("/etc/passwd")}  # any class, not plain tensors/numbers
    write_checkpoint_files(directory, 0, evil, {"rng": rng.capture(), "window": {"loss_sum": 0.0, "samples": 0}})
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported global"):
        read_checkpoint(directory, rank=0)
    with pytest.raises(CorruptCheckpoint, match="checkpoint_000000004 is not usable on rank 0.*Weights only"):
        load_newest_valid(newest(tmp_path), rank=0)  # refused like any damaged one, never loaded


def test_a_full_disk_leaves_nothing_behind_and_the_previous_checkpoint_loads(tmp_path, monkeypatch):
    previous = save(tmp_path, 4)
    staged = []

    def full_disk(obj, path):
        staged.append(Path(path).parent)
        Path(path).write_bytes(b"half")  # some bytes landed before the disk filled up
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointWriteError, match="step 8 on rank 0.*disk is full.*previous checkpoint is intact"):
        with staged_checkpoint(0, shared_state(8), {"rng": rng.capture()}, step=8, save=full_disk):
            pytest.fail("a failed write must not be reported")
    assert staged and not staged[0].exists()  # the staging directory is gone
    assert read_checkpoint(previous, rank=0).global_step == 4
    state, warnings = load_newest_valid(newest(tmp_path), rank=0)
    assert state.global_step == 4 and warnings == []


def test_a_rank_whose_copy_failed_removes_its_own_part_and_leaves_its_peers_copy_going(tmp_path):
    """Two ranks copy into one checkpoint directory: the one whose copy failed takes back only its own files. Removing
    the directory made the peer, still copying, fail on a directory gone, and the run told that collateral error
    instead of the full disk."""
    from pyarrow import fs

    target = tmp_path / "storage" / "checkpoint_000000004_1"
    (target / "nested").mkdir(parents=True)
    for name in ("rank0.pt", "manifest_rank0.json", "rank1.pt", "nested/rank1.bin"):
        (target / name).write_text("part")
    staged = tmp_path / "staged-rank1"
    (staged / "nested").mkdir(parents=True)
    for name in ("rank1.pt", "manifest_rank1.json", "nested/rank1.bin"):  # its manifest was never copied
        (staged / name).write_text("part")
    remove_own_part(fs.LocalFileSystem(), str(target), staged)
    left = sorted(path.relative_to(target).as_posix() for path in target.rglob("*") if path.is_file())
    assert left == ["manifest_rank0.json", "rank0.pt"]


def test_a_checkpoint_written_before_the_typed_state_loads(tmp_path):
    # Before the train state was typed, train_state.pt held the same fields without a `format` key.
    directory = tmp_path / "checkpoint_000000004"
    directory.mkdir()
    old = {key: value for key, value in shared_state(4).items() if key != "format"}
    write_checkpoint_files(directory, 0, old, {"rng": rng.capture(), "window": {"loss_sum": 2.0, "samples": 8}})
    state = read_checkpoint(directory, rank=0)
    assert state.global_step == 4 and state.rank.window == {"loss_sum": 2.0, "samples": 8}


@pytest.mark.parametrize("change, message", [
    (lambda shared: shared.pop("optimizer"), "lacks optimizer.*afresh"),
    (lambda shared: shared.update(format=99), "format 99 is newer"),
])
def test_a_checkpoint_this_version_cannot_read_is_refused_clearly(tmp_path, change, message):
    directory = tmp_path / "checkpoint_000000004"
    directory.mkdir()
    shared = shared_state(4)
    change(shared)
    write_checkpoint_files(directory, 0, shared, {"rng": rng.capture(), "window": {"loss_sum": 0.0, "samples": 0}})
    with pytest.raises(CorruptCheckpoint, match=message):  # never a KeyError
        read_checkpoint(directory, rank=0)
    with pytest.raises(CorruptCheckpoint, match="no usable checkpoint"):
        load_newest_valid(local_candidates(tmp_path), rank=0)


def test_the_newest_checkpoint_in_storage_is_resumed_from_whatever_ray_registered(tmp_path):
    # The driver died after the workers wrote checkpoint 8 but before Ray registered it (Ray names 4, or
    # none at all): the run's storage is what counts.
    save(tmp_path, 4)
    save(tmp_path, 8)
    (tmp_path / "checkpoint_manager_snapshot.json").write_text("{}")  # Ray's own files are not checkpoints
    state, warnings = load_newest_valid(newest(tmp_path), rank=0)
    assert state.global_step == 8 and warnings == []
    assert newest(tmp_path / "no-such-run") == []  # a new run: nothing to resume


def test_staging_left_by_a_dead_process_is_removed_and_a_live_ones_kept(tmp_path):
    import subprocess

    from orchestrator.checkpoint.files import STAGING_PREFIX, remove_stale_staging

    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid now names no process
    dead = tmp_path / f"{STAGING_PREFIX}{gone.pid}-x1y2"
    live = tmp_path / f"{STAGING_PREFIX}{os.getpid()}-a3b4"
    unrelated = tmp_path / f"{STAGING_PREFIX}notapid"
    for directory in (dead, live, unrelated):
        directory.mkdir()
        (directory / "train_state.pt").write_bytes(b"half a checkpoint")
    assert remove_stale_staging(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and unrelated.exists()


def test_staging_directories_are_named_after_their_process(tmp_path):
    with staged_checkpoint(0, shared_state(2), {"rng": rng.capture(), "window": {"loss_sum": 0.0, "samples": 0}},
                           step=2) as directory:
        assert directory.name.startswith(f"ampflow-ckpt-{os.getpid()}-")


def test_reports_kept_for_replay_load_with_the_checkpoint(tmp_path):
    """A rank's unlogged reports travel in its own file and load back with weights_only (plain values only)."""
    import numpy as np

    from orchestrator.train.hooks.outbox import kept_for_replay
    from orchestrator.common.report import Report

    overflow = [{"step": 5, "rank": 0, "event": "overflow"}]
    kept = kept_for_replay(Report(seq=3, step=6, metrics={"train/loss": np.float32(0.5)}, warnings=["x"],
                                  overflow_records=overflow), rank=0)
    assert kept == Report(seq=3, step=6, metrics={"train/loss": 0.5}, overflow_records=overflow).to_wire()
    assert type(kept["metrics"]["train/loss"]) is float and kept["warnings"] == []
    assert kept_for_replay(Report(seq=3, step=6, metrics={"train/loss": 0.5}), rank=1) is None
    directory = tmp_path / "checkpoint_000000006"
    directory.mkdir()
    write_checkpoint_files(directory, 0, shared_state(6), {"rng": rng.capture(), "window": {"loss_sum": 0.0, "samples": 0},
                                                           "hooks": {"replay": {"unlogged": [kept]}}})
    assert read_checkpoint(directory, rank=0).rank.hooks == {"replay": {"unlogged": [kept]}}


def test_a_checkpoint_written_before_reports_were_typed_loads_its_reports_converted(tmp_path):
    """Format 2 kept reports as flat dicts (metrics beside control keys): they load as wire-form Reports, so a
    run interrupted before an upgrade resumes and sends them again."""
    from orchestrator.common.report import Report

    flat = {"seq": 3, "epoch": 1, "epochs": 2, "step": 6, "total_steps": 12, "train/loss": 0.5, "optim/lr": 0.1,
            "tags": {"resumed_from_step": "4"}, "precision/audit": [{"name": "fc"}],
            "amp/overflow_log": [{"step": 5, "rank": 0}], "system_samples": [{"t": 1, "step": 5, "m": {}}]}
    directory = tmp_path / "checkpoint_000000006"
    directory.mkdir()
    shared = {**shared_state(6), "format": 2, "report": {"seq": 3, "step": 6, "train/loss": 0.5}}
    write_checkpoint_files(directory, 0, shared, {"rng": rng.capture(), "window": {"loss_sum": 0.0, "samples": 0},
                                                  "unlogged": [flat]})
    state = read_checkpoint(directory, rank=0)
    assert Report.from_wire(state.report) == Report(seq=3, step=6, metrics={"train/loss": 0.5})
    (kept,) = state.rank.hooks["replay"]["unlogged"]
    assert Report.from_wire(kept) == Report(
        seq=3, step=6, epoch=1, epochs=2, total_steps=12, metrics={"train/loss": 0.5, "optim/lr": 0.1},
        tags={"resumed_from_step": "4"}, tables={"precision/audit": [{"name": "fc"}]},
        overflow_records=[{"step": 5, "rank": 0}], system_samples=[{"t": 1, "step": 5, "m": {}}])


STAGE_AND_DIE = """
import os, signal
from orchestrator.train import rng
from orchestrator.checkpoint.files import staged_checkpoint
with staged_checkpoint(0, None, {"rng": rng.capture(), "window": {"loss_sum": 0.0, "samples": 0}}, step=2) as d:
    print(d, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow  # trains in processes of its own
def test_a_checkpoint_staged_by_a_killed_process_is_removed_when_training_next_starts(write_job, tmp_path,
                                                                                     monkeypatch):
    import subprocess
    import sys

    from omegaconf import OmegaConf

    from conftest import REPO, small_job
    from orchestrator.config import load_job
    from orchestrator.train.local import spawn

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the staging area of both processes below
    killed = subprocess.run([sys.executable, "-c", STAGE_AND_DIE], env={**os.environ, "PYTHONPATH": str(REPO)},
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    staged = Path(killed.stdout.strip())
    assert staged.parent == tmp_path and any(staged.iterdir()), "the killed process left a staged checkpoint"

    cfg = load_job(write_job(small_job(scaling={"num_workers": 1}, run={"epochs": 1, "max_steps_per_epoch": 1})))
    spawn(OmegaConf.to_container(cfg, resolve=True), world_size=1, directory=tmp_path / "run")
    assert not staged.exists()


def test_a_rank_keeps_at_most_max_unlogged_reports_the_newest_and_drops_the_logged(write_job, tmp_path, monkeypatch):
    """A driver that never logs (cut off from MLflow): each checkpoint holds the newest MAX_UNLOGGED reports,
    not more. Once it says what it logged, those are dropped at the next checkpoint."""
    import torch

    from conftest import small_job
    from orchestrator.config import load_job
    from orchestrator.train import loop
    from orchestrator.train.hooks import outbox
    from orchestrator.train.local import LocalSession

    class CutOffDriver(LocalSession):
        logged = 0

        def logged_through(self):
            return self.logged

    monkeypatch.setattr(outbox, "MAX_UNLOGGED", 3)
    cfg = load_job(write_job(small_job(scaling={"num_workers": 1}, run={"max_steps_per_epoch": 8},
                                       tracking={"log_every_n_steps": 1}, checkpoint={"every_n_steps": 6})))
    session = CutOffDriver(0, 1, torch.device("cpu"), tmp_path / "checkpoints")
    training_loop = loop.TrainingLoop(cfg, session)
    real_send = training_loop.send

    def send(report, checkpoint_at=None):
        if training_loop.global_step == 8:  # the driver has logged reports 1-7 by now
            session.logged = 7
        real_send(report, checkpoint_at)

    training_loop.send = send
    training_loop.run()
    mid, end = (read_checkpoint(directory, rank=0) for directory in sorted((tmp_path / "checkpoints").iterdir()))
    unlogged = lambda state: [kept["seq"] for kept in state.rank.hooks["replay"]["unlogged"]]  # noqa: E731
    assert unlogged(mid) == [4, 5, 6]  # 6 reports, none logged: the newest 3
    assert unlogged(end) == [8, 9]  # 7, 8 and the epoch's end (9), 7 logged


def test_the_checkpointer_names_publishes_and_keeps_the_newest_only_once_written_whole(tmp_path):
    from orchestrator.checkpoint.checkpointer import Checkpointer, Saved
    from orchestrator.checkpoint.formats import FullState
    from orchestrator.checkpoint.state import RankState

    published = []

    def publish(directory: Path, name: str) -> None:
        shutil.copytree(directory, tmp_path / name)
        published.append(name)

    checkpointer = Checkpointer(lambda: local_candidates(tmp_path), attempt=7)
    own = RankState(rng.capture(), {"loss_sum": 0.0, "samples": 0})
    assert checkpointer.newest() is None
    assert checkpointer.save(4, Saved.of(own, train_state(4)), FullState(0), publish) == "checkpoint_000000004_7"
    assert checkpointer.newest() == "checkpoint_000000004_7" == published[-1]

    class FullDisk(FullState):
        def staged(self, saved, step):
            return staged_checkpoint(self.rank, saved.shared, saved.own, step, facts=saved.facts,
                                     save=lambda obj, path: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))

    with pytest.raises(CheckpointWriteError, match="step 8 on rank 0.*disk is full"):
        checkpointer.save(8, Saved.of(own, train_state(8)), FullDisk(0), publish)
    assert checkpointer.newest() == "checkpoint_000000004_7" and published == ["checkpoint_000000004_7"]
    state, warnings, built = checkpointer.load(lambda candidates: (*load_newest_valid(candidates, rank=0), "built"))
    assert state.global_step == 4 and warnings == [] and built == "built"


def test_a_checkpoints_facts_keep_the_whole_models_shapes_when_its_state_holds_no_weights():
    from orchestrator.checkpoint.checkpointer import Saved
    from orchestrator.checkpoint.state import RankState

    own = RankState(rng.capture(), {"loss_sum": 0.0, "samples": 0})
    sharded = train_state(2)
    sharded.model = {}  # FSDP: the weights are in the shards
    assert Saved.of(own, sharded, {"w": [6]}).facts["model_shapes"] == {"w": [6]}
    assert Saved.of(own, train_state(2), {"w": [6]}).facts["model_shapes"] == {"w": [3]}
    assert Saved.of(own).shared is None and Saved.of(own).facts is None
