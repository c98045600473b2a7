"""bench.orchestration's candidates in plain processes (torch.multiprocessing, gloo, no Ray): `plain`, a
hand-written DDP loop, and `loop`, our training loop without Ray. Rank 0 writes its windows to a file.
"""

import time
from pathlib import Path

import torch


def spawned_rank(rank: int, candidate: str, args, cfg: dict, launched_at: float, result_path: str,
                 rendezvous: str) -> None:
    """One rank of `plain` or `loop` (a process of torch.multiprocessing.spawn); rank 0 writes the windows."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from orchestrator.train.local import exit_rank

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=args.workers)
    cfg = OmegaConf.create(cfg)
    if candidate == "loop":  # seeds, data and model as every Ray Train worker makes them
        with profiled(args.profile, candidate, rank):
            session = run_loop(cfg, rank, args, launched_at, str(Path(result_path).parent))
        if rank == 0:
            # The loop's first report says when step 1 ended (wall clock); windows run between its reports.
            first_step_end = time.perf_counter() - (time.time() - launched_at - session.first_step_s)
            write_windows(result_path, args, session.marks, session.first_step_s, first_step_end)
    else:
        run_plain(cfg, rank, args, launched_at, result_path)
    dist.destroy_process_group()
    exit_rank()


def run_plain(cfg, rank: int, args, launched_at: float, result_path: str) -> None:
    """The hand-written DDP loop's steps; rank 0 writes the windows."""
    from torch.nn.parallel import DistributedDataParallel

    from orchestrator.train.data import build_datasets

    torch.manual_seed(cfg.run.seed + rank)
    train_set, eval_set = build_datasets(cfg.data, cfg.model.num_classes)  # the same synthetic tensors as ours
    # As ray.train.torch.prepare_model: no DDP wrapper around a single rank.
    wrap = DistributedDataParallel if args.workers > 1 else (lambda model, **kwargs: model)
    loader, step_fn = plain_step(cfg, rank, args, train_set, eval_set, wrap)
    marks, first_step_s, first_step_end = [time.perf_counter()], None, None
    with profiled(args.profile, "plain", rank):
        for step, (inputs, targets) in enumerate(loader, start=1):
            if step > args.steps:
                break
            step_fn(step, inputs, targets)
            if step == 1:
                first_step_s, first_step_end = time.time() - launched_at, time.perf_counter()
            if step % args.log_every == 0:
                marks.append(time.perf_counter())
    if rank == 0:
        write_windows(result_path, args, marks, first_step_s, first_step_end)


def write_windows(result_path: str, args, marks: list[float], first_step_s: float, first_step_end: float,
                  starts: list[float] | None = None, last_step_end: float | None = None, **extra) -> None:
    """Rank 0's record: throughput of each window of `log_every` steps, start-up, end of step 1 to the last step.

    A window runs from `starts[i]` (default: the previous mark) to `marks[i + 1]`; `first_to_last_step_s` is the
    wall time from the end of step 1 to `last_step_end` (default: the last mark), whatever happened in between.
    """
    import json

    samples = args.log_every * args.batch_size * args.workers
    starts = starts if starts is not None else marks[:-1]
    windows = [samples / (end - start) for start, end in zip(starts, marks[1:])]
    Path(result_path).write_text(json.dumps({
        "windows": windows, "launch_to_first_step_s": first_step_s, "first_to_last_step_s": (last_step_end or marks[-1]) - first_step_end,
        "threads": torch.get_num_threads(), **extra}))


def profiled(directory: str | None, candidate: str, rank: int):
    """cProfile around rank 0's steps when --profile DIR is given (DIR/CANDIDATE.pstats); else nothing."""
    import contextlib

    if directory is None or rank != 0:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def profile():
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        try:
            yield
        finally:
            profiler.disable()
            Path(directory).mkdir(parents=True, exist_ok=True)
            profiler.dump_stats(str(Path(directory) / f"{candidate}.pstats"))

    return profile()


def plain_step(cfg, rank: int, args, train_set, eval_set, wrap):
    """A hand-written loop: DistributedSampler + DataLoader, DDP, `zero_grad / backward / step`."""
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler

    from orchestrator.train.models import build_model

    sampler = DistributedSampler(train_set, num_replicas=args.workers, rank=rank, shuffle=True, seed=cfg.run.seed)
    sampler.set_epoch(0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=0)
    model = wrap(build_model(cfg.model))
    o = cfg.optim
    optimizer = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)

    def step(index: int, inputs, targets) -> None:
        loss = F.cross_entropy(model(inputs).float(), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return loader, step


class TimingSession:
    """A Ray-free session for our training loop that timestamps each window report (every `log_every` steps)
    and keeps checkpoints in a temp dir: the loop runs exactly as it does under Ray Train, minus Ray."""

    def __init__(self, rank: int, world_size: int, directory: Path):
        from orchestrator.train.local import LocalSession

        self.local = LocalSession(rank, world_size, torch.device("cpu"), directory)
        self.rank, self.world_size, self.device = rank, world_size, self.local.device
        self.marks: list[float] = []
        self.first_step_s = None

    def report(self, wire, checkpoint=None, checkpoint_name=None) -> None:
        metrics = wire["metrics"]  # the report's wire form (`orchestrator.common.report.Report.to_wire`)
        if "train/loss" in metrics:  # a window of `log_every` steps ended
            self.marks.append(time.perf_counter())
        self.first_step_s = metrics.get("perf/time_to_first_step_s", self.first_step_s)
        self.local.report(wire, checkpoint, checkpoint_name)

    def checkpoints(self):
        return []

    def logged_through(self):
        return None


def run_loop(cfg, rank: int, args, launched_at: float, tmp: str) -> "TimingSession":
    """Our training loop (`orchestrator.train.loop.TrainingLoop`), as every Ray Train worker runs it, in the
    spawned rank; windows are the times between its reports."""
    from orchestrator.train.loop import TrainingLoop

    session = TimingSession(rank, args.workers, Path(tmp) / f"loop-rank{rank}-{args.steps}")
    TrainingLoop(cfg, session, launched_at=launched_at).run()
    return session


def run_spawned(candidate: str, args, cfg: dict, tmp: Path, index: int) -> dict:
    import json

    import torch.multiprocessing as mp

    result_path = tmp / f"{candidate}{index}-{args.steps}.json"
    rendezvous = tmp / f"{candidate}{index}-{args.steps}.rendezvous"  # a file, not a port: nothing to race other jobs for
    started = time.perf_counter()
    launched_at = time.time()
    mp.spawn(spawned_rank, args=(candidate, args, cfg, launched_at, str(result_path), str(rendezvous)),
             nprocs=args.workers, join=True)
    result = json.loads(result_path.read_text())
    result["steady"] = result["windows"][args.warmup_windows:]
    result["process_wall_s"] = time.perf_counter() - started
    result["process_start_to_first_step_s"] = result["launch_to_first_step_s"]  # spawn is the process start
    return result
