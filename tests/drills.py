"""Deliberate failures, as hooks of the training loop: the reliability tests' drills.

A test names them in a job's `callbacks` (`{name: "drills:KillRank", kwargs: {...}}`); the workers import
this module like any user code (it is shipped with the job). Steps are global optimizer steps, from 1.

- `Overflow`: after backward, an inf in one layer's gradient (on every rank, or on `rank` only): what an fp16
  overflow looks like to the GradScaler.
- `NanLoss`: the loss of a step (or of every step from one on) is NaN on every rank (a forward pass that is
  not finite).
- `NanWeight`: after a step, a NaN in one parameter (on every rank, or on `rank` only): weights gone bad
  between checkpoints.
- `KillRank`: a rank's process dies with `os._exit` at the start of a step, as a preempted node or an OOM
  kill would: no exception, no cleanup. With a `marker` file, only once (a restarted worker group lives).
- `AwaitNodeLoss`: at a step, a rank writes its Ray node's ID to a marker file and waits for the test to remove
  that node from a multi-node cluster (`ray.cluster_utils.Cluster`): a node lost mid-epoch.
- `AwaitResize`: at a step of an attempt on a given number of ranks, rank 0 writes a marker file and waits for
  the test to add a node, and Ray Train to grow the worker group (an elastic run).
- `AwaitPreemption`: at a step, a rank writes its process ID to a marker file and waits inside the step for the
  test's SIGTERM (a preemption notice).
- `StallForward`: a rank's forward blocks for good from a step on (a deadlocked model, a hung read), while its peers
  wait for it in the gradients' all-reduce. With a `marker` file, only once.
- `SigStop`: a rank's process stops itself with SIGSTOP at the start of a step: it can neither run nor write
  anything, and its peers wait for it in a collective. With a `marker` file, only once.
- `ReadOnlyPath`, `RemovePath`: a tracking store made read-only, or its artifact directory removed, mid-run.
- `KillLoaderWorker`: a rank's DataLoader worker processes SIGKILLed mid-epoch.
- `Interrupt`: every rank raises at the start of a step (an attempt that failed; its checkpoints stay).
- `DiskFull`: the copy of a checkpoint to storage fails part-way with ENOSPC on every rank, as a disk
  filling up does (each rank's file in the checkpoint's storage directory is a link to /dev/full).
"""

import os
import signal
import time
from pathlib import Path
from typing import Optional, Sequence

import torch


def layers_with_params(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if any(True for _ in module.parameters(recurse=False))]


class Overflow:
    def __init__(self, at_steps: Sequence[int], layer: Optional[str] = None, rank: Optional[int] = None):
        """`layer`: the qualified name of the layer whose gradient gets the inf (default: the last layer with
        parameters, where backward starts); `rank`: only this rank's gradient (the ranks then disagree)."""
        self.at_steps, self.layer, self.rank = set(at_steps), layer, rank

    def setup(self, loop) -> None:
        layers = layers_with_params(loop.training.prepared.raw)
        if self.layer is not None and self.layer not in layers:
            raise ValueError(f"drill Overflow: '{self.layer}' is not a layer with parameters; layers: {layers}")

    @torch.no_grad()
    def after_backward(self, loop, step) -> None:
        if step.number not in self.at_steps or self.rank not in (None, loop.rank):
            return
        for name, tensor in reversed(loop.training.precision.named_tensors):  # the optimizer's view
            if (self.layer is None or name.rpartition(".")[0] == self.layer) and tensor.grad is not None:
                tensor.grad.view(-1)[0] = float("inf")
                return


class NanLoss:
    def __init__(self, at_step: Optional[int] = None, from_step: Optional[int] = None):
        self.at_step, self.from_step = at_step, from_step

    def after_backward(self, loop, step) -> None:
        if step.number == self.at_step or (self.from_step is not None and step.number >= self.from_step):
            step.loss = step.loss * float("nan")


class NanWeight:
    def __init__(self, at_step: int, rank: Optional[int] = None):
        self.at_step, self.rank = at_step, rank

    @torch.no_grad()
    def after_step(self, loop, step) -> None:
        if step.number == self.at_step and self.rank in (None, loop.rank):
            next(loop.training.prepared.raw.parameters()).view(-1)[0] = float("nan")


class KillRank:
    def __init__(self, rank: int, at_step: int, marker: Optional[str] = None):
        """`marker`: a file left when the rank is killed; while it exists, the rank is not killed again."""
        self.rank, self.at_step, self.marker = rank, at_step, marker

    def before_step(self, loop, step) -> None:
        if loop.rank != self.rank or step.number != self.at_step:
            return
        if self.marker is not None:
            if Path(self.marker).exists():
                return
            Path(self.marker).write_text(f"rank {self.rank} killed at step {self.at_step}\n")
        os._exit(1)


class AwaitNodeLoss:
    def __init__(self, rank: int, at_step: int, marker: str, wait_s: float = 120.0):
        """At `at_step`, `rank` writes its Ray node's ID to `marker` (once) and waits there for the test to remove
        that node (the rank dies with it); the other ranks wait in the step's collectives meanwhile."""
        self.rank, self.at_step, self.marker, self.wait_s = rank, at_step, marker, wait_s

    def before_step(self, loop, step) -> None:
        if loop.rank != self.rank or step.number != self.at_step or Path(self.marker).exists():
            return
        import ray

        Path(self.marker + ".tmp").write_text(ray.get_runtime_context().get_node_id())
        os.replace(self.marker + ".tmp", self.marker)
        time.sleep(self.wait_s)  # the node goes meanwhile; should it not, the run goes on and the test fails


class AwaitResize:
    def __init__(self, world_size: int, at_step: int, marker: str, wait_s: float = 120.0):
        """At `at_step` of an attempt on `world_size` ranks, rank 0 writes the step to `marker` (once) and waits
        there for Ray Train to resize the worker group (the attempt ends with that); the other ranks wait in the
        step's collectives meanwhile."""
        self.world_size, self.at_step, self.marker, self.wait_s = world_size, at_step, marker, wait_s

    def before_step(self, loop, step) -> None:
        if (loop.rank != 0 or loop.world_size != self.world_size or step.number != self.at_step
                or Path(self.marker).exists()):
            return
        Path(self.marker + ".tmp").write_text(str(step.number))
        os.replace(self.marker + ".tmp", self.marker)
        time.sleep(self.wait_s)  # a node joins meanwhile; should the group not grow, the run goes on and the test fails


class AwaitPreemption:
    def __init__(self, rank: int, at_step: int, marker: str, wait_s: float = 120.0):
        """At `at_step`, `rank` writes its process ID to `marker` (once) and waits, inside the step, until that process
        gets its preemption notice (the test's SIGTERM): the notice comes in the middle of a step."""
        self.rank, self.at_step, self.marker, self.wait_s = rank, at_step, marker, wait_s

    def before_step(self, loop, step) -> None:
        if loop.rank != self.rank or step.number != self.at_step or Path(self.marker).exists():
            return
        from orchestrator.train.preemption import Notice

        Path(self.marker + ".tmp").write_text(str(os.getpid()))
        os.replace(self.marker + ".tmp", self.marker)
        deadline = time.monotonic() + self.wait_s
        while Notice.received_at is None and time.monotonic() < deadline:
            time.sleep(0.05)


def first_time(marker: Optional[str], what: str) -> bool:
    """Whether a drill marked by `marker` has not happened yet; leaves the marker (None: every time)."""
    if marker is None:
        return True
    if Path(marker).exists():
        return False
    Path(marker).write_text(what + "\n")
    return True


class StallForward:
    def __init__(self, rank: int, from_step: int, marker: Optional[str] = None):
        self.rank, self.from_step, self.marker = rank, from_step, marker

    def setup(self, loop) -> None:
        if loop.rank == self.rank:
            self.loop = loop
            loop.training.prepared.raw.register_forward_pre_hook(self.blocked_forward)

    def blocked_forward(self, module, inputs) -> None:
        if module.training and self.loop.global_step >= self.from_step and first_time(
                self.marker, f"rank {self.rank} stalled at step {self.loop.global_step}"):
            while True:
                time.sleep(0.5)


class SigStop:
    def __init__(self, rank: int, at_step: int, marker: Optional[str] = None):
        self.rank, self.at_step, self.marker = rank, at_step, marker

    def before_step(self, loop, step) -> None:
        if loop.rank == self.rank and step.number == self.at_step and first_time(
                self.marker, f"rank {self.rank} stopped at step {self.at_step}"):
            os.kill(os.getpid(), signal.SIGSTOP)


class DiskFull:
    def __init__(self, at_step: int):
        self.at_step = at_step

    def on_checkpoint(self, loop, directory: Path, name: str) -> None:
        if loop.global_step != self.at_step:
            return
        import ray.train

        storage = ray.train.get_context().get_storage()  # where Ray Train is about to copy this checkpoint
        target = Path(storage.experiment_fs_path) / name
        target.mkdir(parents=True, exist_ok=True)
        (target / f"rank{loop.rank}.pt").symlink_to("/dev/full")


class ReadOnlyPath:
    def __init__(self, paths: Sequence[str], at_step: int, until_step: Optional[int] = None):
        """Make `paths` (files and directories: a SQLite store's file and its directory) read-only at the end of
        step `at_step` on rank 0, as a filesystem remounted read-only would; writable again at `until_step`."""
        self.paths, self.at_step, self.until_step = [str(p) for p in paths], at_step, until_step

    def after_step(self, loop, step) -> None:
        if loop.rank == 0 and step.number == self.at_step:
            make_read_only(self.paths, True)
        elif loop.rank == 0 and step.number == self.until_step:
            make_read_only(self.paths, False)


def make_read_only(paths: Sequence[str], read_only: bool) -> None:
    """chmod, and for root (whom modes do not stop) the immutable attribute as well (`chattr`, Linux)."""
    import subprocess

    for path in paths:
        if read_only:
            os.chmod(path, 0o555 if os.path.isdir(path) else 0o444)
        if os.geteuid() == 0:
            subprocess.run(["chattr", "+i" if read_only else "-i", path], check=True, capture_output=True)
        if not read_only:
            os.chmod(path, 0o755 if os.path.isdir(path) else 0o644)


class RemovePath:
    def __init__(self, path: str, at_step: int):
        """Remove `path` (a directory tree: an MLflow run's artifact root) at the end of step `at_step` on rank 0."""
        self.path, self.at_step = Path(path), at_step

    def after_step(self, loop, step) -> None:
        if loop.rank == 0 and step.number == self.at_step:
            import shutil

            shutil.rmtree(self.path)


class KillLoaderWorker:
    def __init__(self, at_step: int, rank: int = 0):
        """SIGKILL this rank's DataLoader worker processes (its child processes) at the start of step `at_step`,
        as the kernel's OOM killer would."""
        self.at_step, self.rank = at_step, rank

    def before_step(self, loop, step) -> None:
        if loop.rank != self.rank or step.number != self.at_step:
            return
        import signal

        import psutil

        children = psutil.Process().children()
        if not children:
            raise RuntimeError("drill KillLoaderWorker: this rank has no loader worker processes "
                               "(data.loader_workers: 0?)")
        for child in children:
            os.kill(child.pid, signal.SIGKILL)


class Interrupt:
    def __init__(self, at_step: int):
        """At the start of `at_step`, every rank raises: an attempt ended by a failure, its checkpoints kept."""
        self.at_step = at_step

    def before_step(self, loop, step) -> None:
        if step.number == self.at_step:
            raise RuntimeError(f"drill: interrupted at step {self.at_step}")
