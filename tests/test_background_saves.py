"""Background saves: a snapshot training cannot change, at most one save in flight, no failure lost."""

import errno
import threading
import time

import pytest
import torch

from orchestrator.checkpoint.background import BackgroundSaves, to_host
from orchestrator.checkpoint.files import CheckpointWriteError, write_failure


def test_the_host_copy_is_a_snapshot_the_live_state_no_longer_changes():
    live = {"model": {"w": torch.ones(3)}, "optimizer": {"state": {0: {"exp_avg": torch.zeros(2), "step": 1}},
                                                          "param_groups": [{"lr": 0.1, "params": [0]}]},
            "shape": (1, 28, 28), "history": [1.0, 2.0]}
    host = to_host(live)
    live["model"]["w"].add_(5.0)
    live["optimizer"]["state"][0]["exp_avg"].add_(1.0)
    live["optimizer"]["param_groups"][0]["lr"] = 0.5
    live["history"].append(3.0)
    assert torch.equal(host["model"]["w"], torch.ones(3))
    assert torch.equal(host["optimizer"]["state"][0]["exp_avg"], torch.zeros(2))
    assert host["optimizer"]["param_groups"][0]["lr"] == 0.1 and host["history"] == [1.0, 2.0]
    assert host["shape"] == (1, 28, 28) and isinstance(host["shape"], tuple)


def test_at_most_one_save_is_in_flight_and_the_next_one_says_how_long_it_waited():
    saves, running, overlapped = BackgroundSaves(), [], []
    release = threading.Event()

    def save(name):
        def run():
            overlapped.append(len(running) > 0)
            running.append(name)
            if name == "first":
                release.wait(5)
            running.remove(name)
        return run

    assert saves.submit(save("first")) == 0.0
    threading.Timer(0.3, release.set).start()
    waited = saves.submit(save("second"))  # waits for the first
    saves.close()
    assert waited >= 0.2 and overlapped == [False, False]


def test_a_failed_background_save_is_raised_with_its_cause_at_the_next_check():
    saves = BackgroundSaves()

    def full_disk():
        raise write_failure(OSError(errno.ENOSPC, "No space left on device"), "the checkpoint of step 8 on rank 0")

    saves.submit(full_disk)
    deadline = time.monotonic() + 5
    with pytest.raises(CheckpointWriteError, match="step 8 on rank 0.*disk is full"):
        while time.monotonic() < deadline:
            saves.check()  # each step: nothing while it runs, its failure once it ended
            time.sleep(0.01)
    saves.check()  # raised once
    saves.close()


def test_closing_waits_for_every_save_and_raises_a_failure_it_finds():
    saves, done = BackgroundSaves(), []
    saves.submit(lambda: (time.sleep(0.2), done.append("written")))
    saves.close()
    assert done == ["written"]

    failing = BackgroundSaves()
    failing.submit(lambda: (time.sleep(0.1), (_ for _ in ()).throw(OSError(errno.EIO, "I/O error"))))
    with pytest.raises(OSError, match="I/O error"):
        failing.close()
