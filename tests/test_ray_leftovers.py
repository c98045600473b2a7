"""What `ray.shutdown()` leaves of a Ray that a run started is ended: the processes the node started, and theirs
(Ray's workers are the raylet's children, and outlive it when it is killed)."""

import subprocess
import sys
import time
from types import SimpleNamespace

import psutil

import ray._private.worker as ray_worker
from orchestrator.runner import ray_start


def test_the_nodes_processes_and_their_orphaned_children_are_killed_after_the_grace(monkeypatch):
    # a "raylet" that starts a "worker" ignoring SIGTERM, then ends: the worker is orphaned, as after a killed raylet
    raylet = subprocess.Popen([sys.executable, "-c", (
        "import signal, subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        " print(flush=True); time.sleep(120)'])\n"
        "time.sleep(120)")])
    deadline = time.monotonic() + 60
    while not psutil.Process(raylet.pid).children():
        assert time.monotonic() < deadline, "the worker never started"
        time.sleep(0.05)
    monkeypatch.setattr(ray_worker, "_global_node", SimpleNamespace(
        all_processes={"raylet": [SimpleNamespace(process=raylet)]}), raising=False)
    monkeypatch.setattr(ray_start, "LEFTOVER_GRACE_S", 0.5)

    processes = ray_start._own_ray_processes()
    worker = psutil.Process(raylet.pid).children()[0]
    assert {p.pid for p in processes} == {raylet.pid, worker.pid}
    raylet.kill()
    raylet.wait()
    worker.terminate()  # ignored, as a worker busy elsewhere ignores it
    started = time.monotonic()
    ray_start._end_leftovers(processes)
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
    assert time.monotonic() - started < 10


def test_processes_that_are_gone_cost_no_wait(monkeypatch):
    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    processes = [psutil.Process(quick.pid)]
    quick.wait()
    monkeypatch.setattr(ray_start, "LEFTOVER_GRACE_S", 30)
    started = time.monotonic()
    ray_start._end_leftovers(processes)
    assert time.monotonic() - started < 5
    monkeypatch.setattr(ray_worker, "_global_node", None, raising=False)
    assert ray_start._own_ray_processes() == []
