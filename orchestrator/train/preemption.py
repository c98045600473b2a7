"""A preemption notice turned into a checkpoint: Kubernetes sends SIGTERM when it evicts a pod (a spot node
reclaimed, a drain) and SIGKILL `terminationGracePeriodSeconds` later.

`install_notice_handler(grace_s)` runs on a worker process's main thread (where Python lets a signal handler be
set; `orchestrator.runner.launch` has Ray Train run it there): SIGTERM then only marks the notice and starts
the grace period. The training loop's `PreemptionCheck` hook asks every rank after each step whether any got the
notice (one all-reduce of one number, on a CPU (gloo) group: the GPU is not waited for); when one did, every rank
checkpoints at that step boundary and the attempt ends with `Preempted`, which Ray Train restarts from that
checkpoint under `failure.max_failures`. The step in flight when the signal came is finished and kept: nothing
trained is redone. A process still alive `grace_s` after the notice ends itself (exit 143), as SIGTERM ended it
before.
"""

import os
import signal
import sys
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from orchestrator.errors import EXIT_TERMINATED
from orchestrator.train.collectives import spans_ranks

class Notice:
    """Whether this process got a preemption notice, and when (wall clock)."""

    received_at: Optional[float] = None
    grace_s: Optional[float] = None


class Preempted(RuntimeError):
    """The attempt ended at a step boundary, checkpointed, because a rank got a preemption notice (SIGTERM)."""


def install_notice_handler(grace_s: float) -> bool:
    """SIGTERM marks the notice (`Notice`) and gives the process `grace_s` seconds to checkpoint and end; returns
    whether the handler is installed (only the main thread may install one)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    Notice.grace_s = grace_s

    def on_notice(signum, frame) -> None:
        if Notice.received_at is not None:  # a second notice changes nothing: the grace period runs already
            return
        Notice.received_at = time.time()
        print(f"ampflow: SIGTERM (a preemption notice, or Ray Train ending the worker group): checkpointing at the "
              f"next step boundary; ending within {grace_s:g} s (failure.preemption_grace_s)", file=sys.stderr,
              flush=True)
        timer = threading.Timer(grace_s, os._exit, args=(EXIT_TERMINATED,))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_notice)
    return True


class PreemptionCheck:
    """A hook: after each step, whether any rank got a preemption notice (`loop.preempted`)."""

    def __init__(self):
        self.group = None
        self.shared = False
        """Whether other ranks are asked (a process group of more than one rank); one rank reads its own notice."""

    def setup(self, loop) -> None:
        self.shared = spans_ranks()
        if self.shared and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")  # the notice never waits for the GPU

    def after_step(self, loop, step) -> None:
        if not self.shared:
            if Notice.received_at is not None:
                loop.preempted = True
            return
        flag = torch.tensor([0.0 if Notice.received_at is None else 1.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() > 0:
            loop.preempted = True
