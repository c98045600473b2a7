"""The step watchdog (`failure.step_timeout_s`) on the Ray-free loop (two gloo ranks): a rank whose forward blocks,
or a rank stopped with SIGSTOP, ends the run within the timeout plus 60 s, never a hang; every rank that could
write leaves every thread's stack, naming where it was, and the error names the stalled rank."""

import json
import time

import torch

import pytest
from omegaconf import OmegaConf

from conftest import drill, small_job
from orchestrator.config import load_job
from orchestrator.train.hooks.watchdog import HEADER, STALLED_EXIT, StepStalled, Watchdog, collective_timeout_s
from orchestrator.train.local import LocalSession, spawn
from orchestrator.train.loop import TrainingLoop

TIMEOUT_S = 10.0  # a step on a busy 2-core machine can take seconds: the hang must be told apart


def job(write_job, **sections):
    cfg = load_job(write_job(small_job(model={"name": "tiny_nets:MLP"}, precision={"preset": "O0"},
                                       run={"max_steps_per_epoch": 8},
                                       failure={"step_timeout_s": TIMEOUT_S}, **sections)))
    return OmegaConf.to_container(cfg, resolve=True)


def stacks(directory):
    (attempt,) = (directory / "checkpoints" / "diagnostics" / "stacks").iterdir()
    return {path.name: path.read_text() for path in attempt.glob("rank*.txt")}


def header(text):
    first = text.splitlines()[0]
    assert first.startswith(HEADER)
    return json.loads(first[len(HEADER):])


@pytest.mark.slow  # trains in processes of its own
def test_a_rank_whose_forward_blocks_ends_the_run_within_the_bound_with_every_ranks_stack(write_job, tmp_path):
    marker = tmp_path / "stalled"  # written as the forward blocks
    with pytest.raises(StepStalled) as info:
        spawn(job(write_job, callbacks=[drill("StallForward", rank=1, from_step=3, marker=str(marker))]), 2,
              tmp_path)
    assert time.time() - marker.stat().st_mtime < TIMEOUT_S + 60
    files = stacks(tmp_path)
    assert sorted(files) == ["rank0.txt", "rank1.txt"]
    stalled, waiting = header(files["rank1.txt"]), header(files["rank0.txt"])
    # Rank 1's training thread is in the blocked forward: the innermost frame outside the standard library.
    assert stalled["step"] == 3 and not stalled["in_collective"] and stalled["waited_s"] >= TIMEOUT_S
    assert stalled["at"].endswith("in blocked_forward") and "drills.py" in stalled["at"]
    # Rank 0 waits for it in the gradients' all-reduce.
    assert waiting["step"] == 3 and waiting["in_collective"]
    for text in files.values():  # every thread's stack, the training thread's first, each with its frames
        threads = [line for line in text.splitlines() if line.startswith("Thread ")]
        assert threads[0].endswith("(training):") and len(threads) >= 2
        assert "orchestrator/train/loop.py" in text and "in train_step" in text
    assert 'drills.py", line' in files["rank1.txt"] and "time.sleep(0.5)" in files["rank1.txt"]
    message = str(info.value)
    assert message.startswith("rank 1 made no progress for ") and " s at drills.py:" in message
    assert "in blocked_forward (stacks: " in message and "rank 0" not in message


@pytest.mark.slow  # trains in processes of its own
def test_a_sigstopped_rank_ends_the_run_within_the_bound_named_as_the_one_without_a_stack(write_job, tmp_path):
    marker = tmp_path / "stopped"  # written as the rank stops itself
    with pytest.raises(StepStalled) as info:
        spawn(job(write_job, callbacks=[drill("SigStop", rank=1, at_step=3, marker=str(marker))]), 2, tmp_path)
    assert time.time() - marker.stat().st_mtime < TIMEOUT_S + 60
    files = stacks(tmp_path)
    assert sorted(files) == ["rank0.txt"]  # a stopped process writes nothing
    assert header(files["rank0.txt"])["in_collective"]
    assert str(info.value).startswith("rank 1 made no progress and wrote no stack (stopped, killed, or holding "
                                      "the GIL) while its peers waited for it for ")


def test_the_collective_timeout_follows_the_step_timeout():
    assert collective_timeout_s(600) == 661 and collective_timeout_s(2.5) == 63
    assert collective_timeout_s(None) is None  # torch's default stays


class Slow:
    """Each step, evaluation and checkpoint takes `seconds`; one step (`stall_at`) takes `stall_s`."""

    def __init__(self, seconds: float, stall_at: int = 0, stall_s: float = 0.0):
        self.seconds, self.stall_at, self.stall_s = seconds, stall_at, stall_s

    def before_step(self, loop, step):
        time.sleep(self.stall_s if step.number == self.stall_at else self.seconds)

    def collect(self, loop, report):  # after the report's evaluation: as long again
        time.sleep(self.seconds)

    def on_checkpoint(self, loop, directory, name):
        time.sleep(self.seconds)


def test_a_run_longer_than_the_timeout_is_never_ended_while_each_step_evaluation_and_checkpoint_keeps_within_it(
        write_job, tmp_path):
    """One rank, 4 s timeout, every step, evaluation and checkpoint 1 s longer than it would be: the run takes
    several timeouts and is not ended; a step of 10 s is, with the training thread's stack at the slow step."""
    cfg = load_job(write_job(small_job(model={"name": "tiny_nets:MLP"}, scaling={"num_workers": 1},
                                       precision={"preset": "O0"},
                                       run={"max_steps_per_epoch": 6, "eval_every_n_steps": 2},
                                       checkpoint={"every_n_steps": 2}, failure={"step_timeout_s": None})))
    exits = []
    began = time.monotonic()
    session = LocalSession(0, 1, torch.device("cpu"), tmp_path / "calm")
    TrainingLoop(cfg, session, hooks=[Watchdog(4.0, exit=exits.append), Slow(1.0)]).run()
    assert time.monotonic() - began > 2 * 4.0 and exits == []
    assert not (tmp_path / "calm" / "diagnostics").exists()

    session = LocalSession(0, 1, torch.device("cpu"), tmp_path / "stalled")
    TrainingLoop(cfg, session, hooks=[Watchdog(4.0, exit=exits.append), Slow(0.0, stall_at=4, stall_s=10.0)]).run()
    assert exits == [STALLED_EXIT]
    (text,) = [path.read_text() for path in (tmp_path / "stalled" / "diagnostics" / "stacks").glob("*/rank0.txt")]
    assert header(text)["step"] == 4 and header(text)["at"].endswith("in before_step")
    assert "time.sleep(self.stall_s if step.number == self.stall_at else self.seconds)" in text
