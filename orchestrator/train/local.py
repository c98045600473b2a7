"""The training loop in plain processes, without Ray: for tests, benchmarks and machines without Ray.

`LocalSession` keeps reports in memory (as `Report`s) and checkpoints in a local directory (each rank adds its files
to `<directory>/<checkpoint name>`, as Ray Train's storage does). `spawn()` runs a job on `world_size`
processes of `torch.multiprocessing` joined by gloo (or NCCL on GPUs) through a file rendezvous, and
returns rank 0's reports and final fp32 weights.
"""

import os
import shutil
import sys
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, NoReturn, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from orchestrator.checkpoint.files import Candidate, local_candidates
from orchestrator.train.collectives import spans_ranks
from orchestrator.train.loop import TrainingLoop
from orchestrator.train.hooks.watchdog import STACKS, STALLED_EXIT, Stall, StepStalled, collective_timeout_s
from orchestrator.train.allocator import allocator_env
from orchestrator.common.report import Report


class LocalSession:
    def __init__(self, rank: int, world_size: int, device: torch.device, directory: Path):
        self.rank, self.world_size, self.device, self.directory = rank, world_size, device, Path(directory)
        self.reports: list[Report] = []

    def report(self, metrics: dict[str, Any], checkpoint: Optional[Path] = None,
               checkpoint_name: Optional[str] = None) -> None:
        if checkpoint is not None:
            shutil.copytree(checkpoint, self.directory / checkpoint_name, dirs_exist_ok=True)
        if spans_ranks():
            dist.barrier()  # as ray.train.report: a checkpoint is complete on every rank before anyone goes on
        self.reports.append(Report.from_wire(metrics))

    def checkpoints(self) -> list[Candidate]:
        return local_candidates(self.directory)

    def logged_through(self) -> None:
        return None  # the reports stay in this process: no driver can lose them

    def write_diagnostic(self, relative_path: str, text: str) -> None:
        path = self.directory / relative_path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def exit_rank() -> NoReturn:
    """End a rank process of `torch.multiprocessing.spawn` that finished its work: exit 0 now, output flushed,
    without Python's finalization.

    A gloo worker thread can still be dropping the work object of the rank's last collective when the main
    thread finishes; that destructor takes the GIL, and a C++ thread taking the GIL while Python finalizes
    aborts the process (SIGABRT, "terminate called without an active exception", seen in a few of every hundred
    short 2-rank runs with torch 2.14's ProcessGroupGloo). Call it after `dist.destroy_process_group()`, on success
    only: an exception still goes to spawn, which reports its traceback."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank_main(rank: int, job: dict[str, Any], world_size: int, directory: str, result: str) -> None:
    cfg = OmegaConf.create(job)
    OmegaConf.set_readonly(cfg, True)  # read, never changed: its parts are built once (`orchestrator.config.job`)
    use_gpu = cfg.scaling.use_gpu and torch.cuda.is_available()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if use_gpu else torch.device("cpu")
    if use_gpu:
        torch.cuda.set_device(device)  # as Ray Train does: NCCL and FSDP's device mesh use the current device
    timeout_s = collective_timeout_s(cfg.failure.step_timeout_s)  # as launch.build_trainer sets Ray Train's
    dist.init_process_group("nccl" if use_gpu else "gloo", init_method=f"file://{directory}/rendezvous",
                            rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s) if timeout_s is not None else None)
    try:
        session = LocalSession(rank, world_size, device, Path(directory) / "checkpoints")
        training = TrainingLoop(cfg, session).run()
        weights = training.full_state_dict()  # under FSDP gathered to rank 0: every rank takes part
        if rank == 0:
            torch.save({"reports": [report.to_wire() for report in session.reports], "weights": weights}, result)
    finally:
        dist.destroy_process_group()
    exit_rank()


STOP_GRACE_S = 5.0


def stalled_cause(run_dir: Path, world_size: int) -> str:
    """The one-line cause of the newest attempt the watchdog ended, from the stacks in `run_dir`."""
    attempts = sorted((run_dir / STACKS).iterdir()) if (run_dir / STACKS).is_dir() else []
    if not attempts:
        return "a rank's watchdog ended the run, but no stack was written"
    texts = {int(path.stem[len("rank"):]): path.read_text() for path in attempts[-1].glob("rank*.txt")}
    return Stall.of(texts, world_size).cause(str(attempts[-1]))


@contextmanager
def environment(variables: dict[str, str]) -> Iterator[None]:
    """`variables` in this process's environment meanwhile (processes started meanwhile inherit them)."""
    previous = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def spawn(job: dict[str, Any], world_size: int, directory: Path) -> dict[str, Any]:
    """Train a resolved job (a plain dict: `OmegaConf.to_container(cfg, resolve=True)`) on `world_size` local
    processes; returns rank 0's `reports` and final fp32 `weights`. Checkpoints go to `directory/checkpoints`.
    The ranks start with the allocator settings of `perf.keep_freed_memory`, as Ray Train workers do."""
    directory.mkdir(parents=True, exist_ok=True)
    result = directory / "rank0.pt"
    with environment(allocator_env(job["perf"]["keep_freed_memory"])):
        context = mp.spawn(_rank_main, args=(job, world_size, str(directory), str(result)), nprocs=world_size,
                           join=False)
        try:
            # A failed rank's peers get a few seconds to end on their own (a stalled attempt's watchdogs write
            # their stacks meanwhile), then SIGTERM, then SIGKILL (a stopped process heeds only that).
            while not context.join(grace_period=STOP_GRACE_S):
                pass
        except mp.ProcessExitedException as exc:
            if exc.exit_code == STALLED_EXIT:
                raise StepStalled(stalled_cause(directory / "checkpoints", world_size)) from exc
            raise
    outcome = torch.load(result, weights_only=True)
    return {**outcome, "reports": [Report.from_wire(wire) for wire in outcome["reports"]]}
