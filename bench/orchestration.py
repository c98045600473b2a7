"""Steady-state throughput and launch time of our Ray Train worker loop vs a plain torch DDP script.

What is compared (CPU, fp32, 2 ranks over gloo, the same model, synthetic data, per-rank batch,
optimizer, number of steps, and torch threads per rank):

- `ours`: a real `python -m orchestrator.submit JOB.yaml` in a subprocess, on a job file written
  to a temp dir (preset O0, synthetic data, MLflow in a SQLite file there, checkpoints there, no
  model logging). Its figures are what the worker reports and the driver logs: the
  `perf/samples_per_s` history (one window every `tracking.log_every_n_steps` steps, summed over
  ranks, timed on rank 0) and `perf/time_to_first_step_s` (from the driver's `execute()`, before
  Ray starts, to the end of the first step), read back from MLflow afterwards.
- `plain`: `torch.multiprocessing.spawn` of 2 ranks running a hand-written loop: init_process_group,
  DistributedDataParallel, DistributedSampler + DataLoader, `zero_grad / backward / step`. Rank 0
  takes a timestamp every `log_every` steps, so its windows are the same steps as ours; launch time
  runs from the spawn call to the end of the first step on rank 0.
- `loop`: the same spawned harness running our training loop without Ray
  (`orchestrator.train.loop.TrainingLoop`, the loop every Ray Train worker runs, with a session that
  timestamps each report instead of handing it to Ray). It splits the gap in two:
  `loop_throughput` (loop / plain) is what our step code costs, `runtime_throughput` (ours / loop)
  what Ray Train (its processes, reporting, the worker thread) costs.

The first `--warmup-windows` windows are left out of all; each run's figure is the median of its
remaining windows, and the candidates run alternately (plain, loop, ours, plain, ...), median over
the repeats. Threads: a Ray Train worker with its default 1 CPU gets OMP_NUM_THREADS=1 from Ray
(torch then uses 1 thread); the spawned ranks call torch.set_num_threads with the same number, and
the submit subprocess gets OMP_NUM_THREADS set to it so they can never differ.
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import common

HARNESS = "orchestration"
TARGET = ">= 0.97"
CANDIDATES = ("plain", "loop", "ours")
REPO = Path(__file__).resolve().parents[1]


def job_dict(args, tmp: Path) -> dict:
    return {
        "model": {"name": args.model},
        "data": {"name": "synthetic", "synthetic_samples": args.steps * args.batch_size * args.workers},
        "precision": {"preset": "O0"},
        "scaling": {"num_workers": args.workers},
        "run": {"epochs": 1, "batch_size": args.batch_size, "max_steps_per_epoch": args.steps, "seed": 0},
        "tracking": {"uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "bench-orchestration",
                     "log_every_n_steps": args.log_every, "log_model": False},
        "checkpoint": {"storage_path": str(tmp / "ray_results")},
    }


def run_ours(args, tmp: Path, index: int) -> dict:
    import yaml
    from mlflow import MlflowClient

    job_path = tmp / f"ours{index}.yaml"
    job = job_dict(args, tmp)
    job["run"]["name"] = f"bench-ours-{index}"
    job_path.write_text(yaml.safe_dump(job, sort_keys=False))
    # A local Ray of its own, and the job's MLflow URI.
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env["OMP_NUM_THREADS"] = str(args.threads)
    if args.health_check_interval_s is not None:  # how often Ray Train's controller drains each worker's reports
        env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(args.health_check_interval_s)
    else:
        env.pop("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", None)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "orchestrator.submit", str(job_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"orchestrator.submit exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    client = MlflowClient(tracking_uri=job["tracking"]["uri"])
    experiment = client.get_experiment_by_name(job["tracking"]["experiment"])
    runs = client.search_runs([experiment.experiment_id], filter_string=f"attributes.run_name = 'bench-ours-{index}'")
    run_id = runs[0].info.run_id
    history = sorted(client.get_metric_history(run_id, "perf/samples_per_s"), key=lambda m: m.step)
    windows = [m.value for m in history]
    return {"windows": windows, "steady": windows[args.warmup_windows:],
            "launch_to_first_step_s": client.get_run(run_id).data.metrics.get("perf/time_to_first_step_s"),
            "process_wall_s": wall}


def spawned_rank(rank: int, candidate: str, args, cfg: dict, launched_at: float, result_path: str,
                 rendezvous: str) -> None:
    """One rank of `plain` or `loop` (a process of torch.multiprocessing.spawn); rank 0 writes the windows."""
    import json

    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.nn.parallel import DistributedDataParallel

    from orchestrator.train.data import build_datasets

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=args.workers)
    cfg = OmegaConf.create(cfg)
    if candidate == "loop":  # seeds, data and model as every Ray Train worker makes them
        result = run_loop(cfg, rank, args, launched_at, str(Path(result_path).parent))
        if rank == 0:
            Path(result_path).write_text(json.dumps({**result, "threads": torch.get_num_threads()}))
        dist.destroy_process_group()
        return
    torch.manual_seed(cfg.run.seed + rank)
    train_set, eval_set = build_datasets(cfg.data, cfg.model.num_classes)  # the same synthetic tensors as ours
    # As ray.train.torch.prepare_model: no DDP wrapper around a single rank.
    wrap = DistributedDataParallel if args.workers > 1 else (lambda model, **kwargs: model)
    loader, step_fn = plain_step(cfg, rank, args, train_set, eval_set, wrap)
    marks, first_step_s = [time.perf_counter()], None
    for step, (inputs, targets) in enumerate(loader, start=1):
        if step > args.steps:
            break
        step_fn(step, inputs, targets)
        if step == 1:
            first_step_s = time.time() - launched_at
        if step % args.log_every == 0:
            marks.append(time.perf_counter())
    if rank == 0:
        samples = args.log_every * args.batch_size * args.workers
        windows = [samples / (b - a) for a, b in zip(marks, marks[1:])]
        Path(result_path).write_text(json.dumps({"windows": windows, "launch_to_first_step_s": first_step_s,
                                                 "threads": torch.get_num_threads()}))
    dist.destroy_process_group()


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

    def report(self, metrics, checkpoint=None, checkpoint_name=None) -> None:
        if "train/loss" in metrics:  # a window of `log_every` steps ended
            self.marks.append(time.perf_counter())
        self.first_step_s = metrics.get("perf/time_to_first_step_s", self.first_step_s)
        self.local.report(metrics, checkpoint, checkpoint_name)

    def checkpoints(self):
        return []

    def fault_marker_dir(self):
        return None


def run_loop(cfg, rank: int, args, launched_at: float, tmp: str) -> dict:
    """Our training loop (`orchestrator.train.loop.TrainingLoop`), as every Ray Train worker runs it, in the
    spawned rank; windows are the times between its reports."""
    from orchestrator.train.loop import TrainingLoop

    session = TimingSession(rank, args.workers, Path(tmp) / f"loop-rank{rank}")
    TrainingLoop(cfg, session, launched_at=launched_at).run()
    samples = args.log_every * args.batch_size * args.workers
    return {"windows": [samples / (b - a) for a, b in zip(session.marks, session.marks[1:])],
            "launch_to_first_step_s": session.first_step_s}


def run_spawned(candidate: str, args, cfg: dict, tmp: Path, index: int) -> dict:
    import json

    import torch.multiprocessing as mp

    result_path = tmp / f"{candidate}{index}.json"
    rendezvous = tmp / f"{candidate}{index}.rendezvous"  # a file, not a port: nothing to race other jobs for
    started = time.perf_counter()
    launched_at = time.time()
    mp.spawn(spawned_rank, args=(candidate, args, cfg, launched_at, str(result_path), str(rendezvous)),
             nprocs=args.workers, join=True)
    result = json.loads(result_path.read_text())
    result["steady"] = result["windows"][args.warmup_windows:]
    result["process_wall_s"] = time.perf_counter() - started
    return result


def main(argv=None) -> int:
    cli = common.parser(HARNESS, "our Ray Train worker loop vs a plain torch DDP loop: throughput and launch time")
    cli.add_argument("--model", default="simple_cnn", help="registry name (resnet18 works, about 10x slower)")
    cli.add_argument("--workers", type=int, default=2)
    cli.add_argument("--batch-size", type=int, help="per rank (default 64; 16 with --smoke)")
    cli.add_argument("--steps", type=int, help="optimizer steps per run (default 1000; 20 with --smoke)")
    cli.add_argument("--log-every", type=int, help="steps per throughput window (default 50; 5 with --smoke)")
    cli.add_argument("--warmup-windows", type=int, help="windows left out at the start (default 4; 1 with --smoke)")
    cli.add_argument("--repeats", type=int, help="runs of each candidate, alternating (default 3; 1 with --smoke)")
    cli.add_argument("--threads", type=int, default=1, help="torch threads per rank (Ray's default for a "
                                                            "1-CPU worker is 1)")
    cli.add_argument("--health-check-interval-s", type=float,
                     help="RAY_TRAIN_HEALTH_CHECK_INTERVAL_S for our run (default: submit's, 0.5 s). The controller takes "
                          "one report per worker per interval; ray.train.report blocks while the previous one waits")
    cli.add_argument("--timeout", type=float, default=900, help="seconds one submit run may take")
    args = cli.parse_args(argv)
    args.batch_size = args.batch_size or (16 if args.smoke else 64)
    args.steps = args.steps or (20 if args.smoke else 1000)
    args.log_every = args.log_every or (5 if args.smoke else 50)
    args.warmup_windows = args.warmup_windows if args.warmup_windows is not None else (1 if args.smoke else 4)
    args.repeats = args.repeats or (1 if args.smoke else 3)
    if args.steps % args.log_every or args.steps // args.log_every <= args.warmup_windows:
        print("error: --steps must be a multiple of --log-every with more windows than --warmup-windows",
              file=sys.stderr)
        return 2

    from omegaconf import OmegaConf

    runs: dict[str, list[dict]] = {name: [] for name in CANDIDATES}
    with tempfile.TemporaryDirectory(prefix="ampflow-bench-") as tmp_name:
        tmp = Path(tmp_name)
        cfg = OmegaConf.to_container(common.job_config(job_dict(args, tmp)), resolve=True)
        for index in range(args.repeats):
            runs["plain"].append(run_spawned("plain", args, cfg, tmp, index))
            runs["loop"].append(run_spawned("loop", args, cfg, tmp, index))
            runs["ours"].append(run_ours(args, tmp, index))
            print(f"repeat {index + 1}/{args.repeats}: " + ", ".join(
                f"{name} {common.median(runs[name][-1]['steady']):.1f} samples/s" for name in CANDIDATES), flush=True)

    per_run = {name: [common.median(r["steady"]) for r in results] for name, results in runs.items()}
    throughput = {name: common.median(values) for name, values in per_run.items()}
    launch = {name: common.median([r["launch_to_first_step_s"] for r in results]) for name, results in runs.items()}
    wall = {name: common.median([r["process_wall_s"] for r in results]) for name, results in runs.items()}
    print(f"bench.orchestration on cpu ({os.cpu_count()} cores): {args.model}, {args.workers} ranks x batch "
          f"{args.batch_size}, fp32, {args.threads} torch thread(s) per rank, {args.steps} steps, windows of "
          f"{args.log_every} steps (first {args.warmup_windows} left out), {args.repeats} run(s) each")
    common.print_table(
        ["candidate", "samples/s", "spread", "launch_to_first_step_s", "process_wall_s"],
        [[name, throughput[name], f"{common.spread(per_run[name]) * 100:.1f}%", launch[name], wall[name]]
         for name in CANDIDATES])
    figures = {**{f"{name}_samples_per_s": throughput[name] for name in CANDIDATES},
               **{f"{name}_samples_per_s_runs": per_run[name] for name in CANDIDATES},
               **{f"{name}_windows": [r["windows"] for r in runs[name]] for name in CANDIDATES},
               "launch_to_first_step_s": launch, "process_wall_s": wall, "plain_threads": runs["plain"][0]["threads"]}
    common.finish(
        HARNESS, device=common.device_description(torch.device("cpu")).replace(
            f"torch threads {torch.get_num_threads()}", f"{os.cpu_count()} cores, {args.threads} torch thread(s) per rank"),
        config={"model": args.model, "workers": args.workers, "batch_size_per_rank": args.batch_size,
                "steps": args.steps, "log_every_n_steps": args.log_every, "warmup_windows": args.warmup_windows,
                "repeats": args.repeats, "threads_per_rank": args.threads, "dtype": "float32 (O0)",
                "ray_train_health_check_interval_s": args.health_check_interval_s or "submit's default (orchestrator.run.driver.HEALTH_CHECK_INTERVAL_S)",
                "smoke": args.smoke},
        figures=figures,
        ratios={"orchestration_throughput": throughput["ours"] / throughput["plain"],
                "loop_throughput": throughput["loop"] / throughput["plain"],
                "runtime_throughput": throughput["ours"] / throughput["loop"],
                "launch_to_first_step": launch["ours"] / launch["plain"]},
        targets={"orchestration_throughput": TARGET}, json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
