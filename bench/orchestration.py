"""Throughput and start-up of our Ray Train job vs a plain torch DDP script and a plain Ray Train script.

What is compared (CPU, fp32, 2 ranks over gloo, the same model, synthetic data, per-rank batch,
optimizer, number of steps, and torch threads per rank):

- `ours`: a real `python -m orchestrator.submit JOB.yaml` in a subprocess, on a job file written
  to a temp dir (preset O0, synthetic data, MLflow in a SQLite file there, checkpoints there, no
  model logging). Its figures are what the worker reports and the driver logs: the
  `perf/samples_per_s` history (one window every `tracking.log_every_n_steps` steps, summed over
  ranks, timed on rank 0, the report hand-off left out) and `perf/time_to_first_step_s` (from the
  driver's `execute()`, just before Ray starts, to the end of the first step), read back from MLflow
  afterwards.
- `raytrain`: the script a user writes from Ray Train's guide, in a subprocess of its own that starts
  a local Ray as submit does (`ray.init`, submit's RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, OMP_NUM_THREADS
  = --threads, 1 CPU per worker, gloo): a `TorchTrainer` whose train function builds the job's data
  and model, `prepare_data_loader` (DistributedSampler), `prepare_model` (DDP), SGD with the job's
  hyper-parameters, cross-entropy, `ray.train.report({"loss": ...})` every `log_every` steps. No
  ampflow step code. Rank 0 timestamps like the `plain` ranks; its windows leave the report out, as
  ours's do.
- `plain`: `torch.multiprocessing.spawn` of 2 ranks running a hand-written loop: init_process_group,
  DistributedDataParallel, DistributedSampler + DataLoader, `zero_grad / backward / step`. Rank 0
  takes a timestamp every `log_every` steps, so its windows are the same steps as ours; launch time
  runs from the spawn call to the end of the first step on rank 0.
- `loop`: the same spawned harness running our training loop without Ray
  (`orchestrator.train.loop.TrainingLoop`, the loop every Ray Train worker runs, with a session that
  timestamps each report instead of handing it to Ray). It splits the gap in two:
  `loop_throughput` (loop / plain) is what our step code costs, `runtime_throughput` (ours / loop)
  what Ray Train (its processes, reporting, the worker thread) costs.

Throughput, two ways:
- default: the first `--warmup-windows` windows are left out of all; each run's figure is the median
  of its remaining windows, median over the repeats. Reports are outside the windows of ours and
  raytrain (both report every `log_every` steps; plain and loop do not report).
- `--by-difference SHORT,LONG`: every candidate runs SHORT and LONG steps, and its per-step cost is
  (process wall of LONG - process wall of SHORT) / (LONG - SHORT), medians of the repeats. The process
  wall (from starting the subprocess or the spawn to its exit, timed here) is the one clock that is
  the same for all four: it needs nothing from inside a candidate, and it holds everything each one
  does per step (reports and their waits, the relay, the MLflow writer), while start-up, warm-up and
  the end of the run (ours evaluates and checkpoints once) are the same in both runs and cancel. The
  data are sized for LONG in both runs so that they build the same tensors. Rank 0's own end-of-step-1
  to last-step time gives the same difference without the process (`ms_per_step_in_run_by_difference`,
  not available for ours, whose worker keeps no such timestamps) as a check on the noise. Every
  `*_throughput` ratio then compares per-step costs (steps per second).

Start-up (`raytrain_startup`, ours / raytrain): from starting the subprocess to the end of rank 0's
first step. For ours, the arrival of submit's "MLflow run ..." line (printed just before it starts
Ray) plus `perf/time_to_first_step_s`; it counts what submit does before Ray (imports, config, the
pre-flight, the MLflow run) as well. `launch_to_first_step_s` of raytrain counts from just before its
`ray.init`, the span ours's own figure covers.

The candidates run alternately (plain, loop, raytrain, ours, plain, ...; with --by-difference the
SHORT round, then the LONG round, per repeat). Threads: a Ray Train worker with its default 1 CPU gets
OMP_NUM_THREADS=1 from Ray (torch then uses 1 thread); the spawned ranks call torch.set_num_threads
with the same number, and the Ray subprocesses get OMP_NUM_THREADS set to it so they can never differ.
"""

import argparse
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
STARTUP_TARGET = "<= 1.1"
CANDIDATES = ("plain", "loop", "raytrain", "ours")
REPO = Path(__file__).resolve().parents[1]


def job_dict(args, tmp: Path, steps: int | None = None) -> dict:
    """The job every candidate trains; `steps` per run (default --steps). The synthetic data is sized for the
    longest run of the invocation, so runs of different lengths build the same tensors (same start-up cost)."""
    return {
        "model": {"name": args.model},
        "data": {"name": "synthetic", "synthetic_samples": max(args.step_counts) * args.batch_size * args.workers},
        "precision": {"preset": "O0"},
        "scaling": {"num_workers": args.workers},
        "run": {"epochs": 1, "batch_size": args.batch_size, "max_steps_per_epoch": steps or args.steps, "seed": 0},
        "tracking": {"uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "bench-orchestration",
                     "log_every_n_steps": args.log_every, "log_model": False},
        "checkpoint": {"storage_path": str(tmp / "ray_results")},
    }


def ray_env(args) -> dict:
    """The environment of a subprocess that starts its own local Ray the way submit does: no RAY_ADDRESS, torch
    threads per worker = --threads, and submit's report poll (or --health-check-interval-s)."""
    from orchestrator.run.driver import HEALTH_CHECK_INTERVAL_S

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env["OMP_NUM_THREADS"] = str(args.threads)
    # How often Ray Train's controller drains each worker's reports. submit sets HEALTH_CHECK_INTERVAL_S for a
    # local Ray unless the variable is set; the raytrain candidate gets the same value explicitly.
    env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(args.health_check_interval_s or HEALTH_CHECK_INTERVAL_S)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])  # Ray's workers too
    return env


def run_process(command: list[str], env: dict, timeout: float, marker: str | None = None) -> dict:
    """Run `command` from the repository root; its wall time, and when a stderr line containing `marker` came
    (seconds after the start), as seen from here."""
    import threading

    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    output = {"stdout": [], "stderr": [], "marker_s": None}

    def drain(stream, lines: list[str]) -> None:
        for line in stream:
            if marker and output["marker_s"] is None and marker in line:
                output["marker_s"] = time.perf_counter() - started
            lines.append(line)

    readers = [threading.Thread(target=drain, args=(process.stdout, output["stdout"]), daemon=True),
               threading.Thread(target=drain, args=(process.stderr, output["stderr"]), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        returncode = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()  # our own child only
        process.wait()
        raise
    wall = time.perf_counter() - started
    for reader in readers:
        reader.join()
    if returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} exited {returncode}:\n{''.join(output['stdout'])[-3000:]}\n"
                           f"{''.join(output['stderr'])[-3000:]}")
    return {"process_wall_s": wall, "marker_s": output["marker_s"]}


def run_ours(args, tmp: Path, index: int, steps: int) -> dict:
    import yaml
    from mlflow import MlflowClient

    name = f"bench-ours-{index}-{steps}"
    job_path = tmp / f"{name}.yaml"
    job = job_dict(args, tmp, steps)
    job["run"]["name"] = name
    job_path.write_text(yaml.safe_dump(job, sort_keys=False))
    # submit prints this line in execute() just before it takes `launched_at` and starts Ray: its arrival here
    # dates perf/time_to_first_step_s on our clock, so that start-up can count from the process start.
    done = run_process([sys.executable, "-m", "orchestrator.submit", str(job_path)], ray_env(args), args.timeout,
                       marker="MLflow run ")
    client = MlflowClient(tracking_uri=job["tracking"]["uri"])
    experiment = client.get_experiment_by_name(job["tracking"]["experiment"])
    runs = client.search_runs([experiment.experiment_id], filter_string=f"attributes.run_name = '{name}'")
    run_id = runs[0].info.run_id
    history = sorted(client.get_metric_history(run_id, "perf/samples_per_s"), key=lambda m: m.step)
    windows = [m.value for m in history]
    launch = client.get_run(run_id).data.metrics.get("perf/time_to_first_step_s")
    from_start = done["marker_s"] + launch if done["marker_s"] is not None and launch is not None else None
    return {"windows": windows, "steady": windows[args.warmup_windows:], "launch_to_first_step_s": launch,
            "process_start_to_first_step_s": from_start, "first_to_last_step_s": None,
            "process_wall_s": done["process_wall_s"]}


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
        with profiled(args.profile, candidate, rank):
            session = run_loop(cfg, rank, args, launched_at, str(Path(result_path).parent))
        if rank == 0:
            # The loop's first report says when step 1 ended (wall clock); windows run between its reports.
            first_step_end = time.perf_counter() - (time.time() - launched_at - session.first_step_s)
            write_windows(result_path, args, session.marks, session.first_step_s, first_step_end)
        dist.destroy_process_group()
        return
    torch.manual_seed(cfg.run.seed + rank)
    train_set, eval_set = build_datasets(cfg.data, cfg.model.num_classes)  # the same synthetic tensors as ours
    # As ray.train.torch.prepare_model: no DDP wrapper around a single rank.
    wrap = DistributedDataParallel if args.workers > 1 else (lambda model, **kwargs: model)
    loader, step_fn = plain_step(cfg, rank, args, train_set, eval_set, wrap)
    marks, first_step_s, first_step_end = [time.perf_counter()], None, None
    with profiled(args.profile, candidate, rank):
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
    dist.destroy_process_group()


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

    def report(self, metrics, checkpoint=None, checkpoint_name=None) -> None:
        if "train/loss" in metrics:  # a window of `log_every` steps ended
            self.marks.append(time.perf_counter())
        self.first_step_s = metrics.get("perf/time_to_first_step_s", self.first_step_s)
        self.local.report(metrics, checkpoint, checkpoint_name)

    def checkpoints(self):
        return []

    def fault_marker_dir(self):
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


def raytrain_train_func(config: dict) -> None:
    """The `raytrain` candidate's worker: Ray's getting-started script with the job's model, data and optimizer.

    Nothing of ampflow's step code: a DataLoader made a distributed one by `prepare_data_loader` (it adds the
    DistributedSampler and the move to the device), the model DDP-wrapped by `prepare_model`, SGD, cross-entropy,
    `ray.train.report` every `log_every` steps. Rank 0 takes the timestamps the `plain` ranks take.
    """
    import ray.train
    import ray.train.torch
    import torch.nn.functional as F
    from omegaconf import OmegaConf
    from torch.utils.data import DataLoader

    from orchestrator.train.data import build_datasets
    from orchestrator.train.models import build_model

    cfg, args = OmegaConf.create(config["job"]), argparse.Namespace(**config["args"])
    context = ray.train.get_context()
    rank = context.get_world_rank()
    torch.manual_seed(cfg.run.seed + rank)
    train_set, _ = build_datasets(cfg.data, cfg.model.num_classes)  # the same synthetic tensors as the others
    loader = ray.train.torch.prepare_data_loader(DataLoader(train_set, batch_size=cfg.run.batch_size, shuffle=True))
    model = ray.train.torch.prepare_model(build_model(cfg.model))
    o = cfg.optim
    optimizer = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    if context.get_world_size() > 1:
        loader.sampler.set_epoch(0)
    model.train()
    # Windows leave the report out, as ours's perf/samples_per_s does (`Window.exclude_since`): a window runs from
    # the end of one report to the start of the next. The reports stay in `first_to_last_step_s` and in the
    # process wall that --by-difference compares, and their time is recorded apart.
    marks, starts, report_s, first_step_s, first_step_end = [time.perf_counter()], [time.perf_counter()], 0.0, None, None
    with profiled(args.profile, "raytrain", rank):
        for step, (inputs, targets) in enumerate(loader, start=1):
            if step > args.steps:
                break
            loss = F.cross_entropy(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step == 1:
                first_step_s, first_step_end = time.time() - config["ray_started_at"], time.perf_counter()
            if step % args.log_every == 0:
                marks.append(time.perf_counter())
                ray.train.report({"loss": loss.item()})
                starts.append(time.perf_counter())
                report_s += starts[-1] - marks[-1]
    if rank == 0:
        import orchestrator

        write_windows(config["result_path"], args, marks, first_step_s, first_step_end, starts=starts[:-1],
                      last_step_end=starts[-1],  # after the last report
                      report_s_per_report=report_s / max(len(marks) - 1, 1),
                      process_start_to_first_step_s=first_step_s + config["ray_started_at"] - config["process_started_at"],
                      orchestrator_imported_from=str(Path(orchestrator.__file__).parent))


def raytrain_process(spec_path: str) -> int:
    """The `raytrain` subprocess: a local Ray started as submit starts it, a TorchTrainer, fit, shut down."""
    import json

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    spec = json.loads(Path(spec_path).read_text())
    spec["ray_started_at"] = time.time()  # as submit's `launched_at`: just before Ray starts
    ray.init(log_to_driver=False, logging_level="WARNING")
    try:
        trainer = TorchTrainer(
            raytrain_train_func, train_loop_config=spec,
            scaling_config=ScalingConfig(num_workers=spec["args"]["workers"], use_gpu=False),  # 1 CPU per worker
            run_config=RunConfig(name=spec["name"], storage_path=spec["storage_path"]),
            torch_config=TorchConfig(backend="gloo"))
        trainer.fit()
    finally:
        ray.shutdown()
    return 0


def run_raytrain(args, cfg: dict, tmp: Path, index: int) -> dict:
    import json

    name = f"raytrain{index}-{args.steps}"
    spec_path, result_path = tmp / f"{name}.spec.json", tmp / f"{name}.json"
    keep = ("workers", "steps", "log_every", "batch_size", "profile")
    spec = {"job": cfg, "args": {key: getattr(args, key) for key in keep}, "name": name,
            "storage_path": str(tmp / "ray_results"), "result_path": str(result_path),
            "process_started_at": time.time()}
    spec_path.write_text(json.dumps(spec))
    command = [sys.executable, "-c", "import sys; from bench.orchestration import raytrain_process; "
                                     "sys.exit(raytrain_process(sys.argv[1]))", str(spec_path)]
    done = run_process(command, ray_env(args), args.timeout)
    result = json.loads(result_path.read_text())
    result["steady"] = result["windows"][args.warmup_windows:]
    result["process_wall_s"] = done["process_wall_s"]
    return result


def per_step_by_difference(short: list[dict], long: list[dict], key: str, steps: tuple[int, int]) -> float | None:
    """Seconds per step: (median `key` of the long runs - that of the short runs) / (LONG - SHORT)."""
    if any(r.get(key) is None for r in short + long):
        return None
    return (common.median([r[key] for r in long]) - common.median([r[key] for r in short])) / (steps[1] - steps[0])


def main(argv=None) -> int:
    cli = common.parser(HARNESS, "our Ray Train worker loop vs a plain torch DDP loop and a plain Ray Train script: "
                                 "throughput and start-up")
    cli.add_argument("--model", default="simple_cnn", help="registry name (resnet18 works, about 10x slower)")
    cli.add_argument("--workers", type=int, default=2)
    cli.add_argument("--batch-size", type=int, help="per rank (default 64; 16 with --smoke)")
    cli.add_argument("--steps", type=int, help="optimizer steps per run (default 1000; 20 with --smoke)")
    cli.add_argument("--by-difference", metavar="SHORT,LONG",
                     help="per-step cost by difference: every candidate runs SHORT and LONG steps (e.g. 300,1300); "
                          "per step = (process wall of LONG - that of SHORT) / (LONG - SHORT), medians of --repeats; "
                          "replaces --steps")
    cli.add_argument("--log-every", type=int, help="steps per throughput window and per report (default 50; 5 with "
                                                   "--smoke)")
    cli.add_argument("--warmup-windows", type=int, help="windows left out at the start (default 4; 1 with --smoke)")
    cli.add_argument("--repeats", type=int, help="runs of each candidate, alternating (default 3; 1 with --smoke)")
    cli.add_argument("--threads", type=int, default=1, help="torch threads per rank (Ray's default for a "
                                                            "1-CPU worker is 1)")
    cli.add_argument("--health-check-interval-s", type=float,
                     help="RAY_TRAIN_HEALTH_CHECK_INTERVAL_S for ours and raytrain (default: submit's, 0.5 s). The "
                          "controller takes one report per worker per interval; ray.train.report blocks while the "
                          "previous one waits")
    cli.add_argument("--profile", metavar="DIR", help="cProfile rank 0's steps of plain, loop and raytrain into "
                                                      "DIR/CANDIDATE.pstats (the last run of each)")
    cli.add_argument("--timeout", type=float, default=900, help="seconds one submit or Ray Train run may take")
    args = cli.parse_args(argv)
    args.batch_size = args.batch_size or (16 if args.smoke else 64)
    args.steps = args.steps or (20 if args.smoke else 1000)
    args.log_every = args.log_every or (5 if args.smoke else 50)
    args.warmup_windows = args.warmup_windows if args.warmup_windows is not None else (1 if args.smoke else 4)
    args.repeats = args.repeats or (1 if args.smoke else 3)
    if args.profile:  # Ray's workers run in directories of their own
        args.profile = str(Path(args.profile).resolve())
    difference = None
    if args.by_difference:
        try:
            difference = tuple(int(part) for part in args.by_difference.split(","))
        except ValueError:
            difference = ()
        if len(difference) != 2 or not 0 < difference[0] < difference[1]:
            print("error: --by-difference takes SHORT,LONG step counts with SHORT < LONG, e.g. 300,1300",
                  file=sys.stderr)
            return 2
    args.step_counts = difference or (args.steps,)
    if any(n % args.log_every or n // args.log_every <= args.warmup_windows for n in args.step_counts):
        print("error: the step counts must be multiples of --log-every with more windows than --warmup-windows",
              file=sys.stderr)
        return 2

    from omegaconf import OmegaConf

    runs: dict[int, dict[str, list[dict]]] = {n: {name: [] for name in CANDIDATES} for n in args.step_counts}
    with tempfile.TemporaryDirectory(prefix="ampflow-bench-") as tmp_name:
        tmp = Path(tmp_name)
        for index in range(args.repeats):
            for steps in args.step_counts:
                run_args = argparse.Namespace(**{**vars(args), "steps": steps})
                cfg = OmegaConf.to_container(common.job_config(job_dict(run_args, tmp)), resolve=True)
                results = runs[steps]
                results["plain"].append(run_spawned("plain", run_args, cfg, tmp, index))
                results["loop"].append(run_spawned("loop", run_args, cfg, tmp, index))
                results["raytrain"].append(run_raytrain(run_args, cfg, tmp, index))
                results["ours"].append(run_ours(run_args, tmp, index, steps))
                print(f"repeat {index + 1}/{args.repeats}, {steps} steps: " + ", ".join(
                    f"{name} {common.median(results[name][-1]['steady']):.1f} samples/s "
                    f"{results[name][-1]['process_wall_s']:.1f} s" for name in CANDIDATES), flush=True)

    # Steady windows and start-up come from the longest runs (the only runs without --by-difference).
    longest = runs[args.step_counts[-1]]
    per_run = {name: [common.median(r["steady"]) for r in results] for name, results in longest.items()}
    throughput = {name: common.median(values) for name, values in per_run.items()}
    all_runs = {name: [r for n in args.step_counts for r in runs[n][name]] for name in CANDIDATES}

    def median_of(key: str) -> dict[str, float | None]:
        values = {name: [r[key] for r in results if r.get(key) is not None] for name, results in all_runs.items()}
        return {name: common.median(found) if found else None for name, found in values.items()}

    launch, from_start = median_of("launch_to_first_step_s"), median_of("process_start_to_first_step_s")
    wall = {name: common.median([r["process_wall_s"] for r in results]) for name, results in longest.items()}
    print(f"bench.orchestration on cpu ({os.cpu_count()} cores): {args.model}, {args.workers} ranks x batch "
          f"{args.batch_size}, fp32, {args.threads} torch thread(s) per rank, "
          f"{' and '.join(map(str, args.step_counts))} steps, windows of {args.log_every} steps (first "
          f"{args.warmup_windows} left out), {args.repeats} run(s) each")
    columns = ["candidate", "samples/s", "spread", "launch_to_first_step_s", "process_start_to_first_step_s",
               "process_wall_s"]
    rows = [[name, throughput[name], f"{common.spread(per_run[name]) * 100:.1f}%", launch[name], from_start[name],
             wall[name]] for name in CANDIDATES]
    figures = {**{f"{name}_samples_per_s": throughput[name] for name in CANDIDATES},
               **{f"{name}_samples_per_s_runs": per_run[name] for name in CANDIDATES},
               **{f"{name}_windows": [r["windows"] for r in longest[name]] for name in CANDIDATES},
               "launch_to_first_step_s": launch, "process_start_to_first_step_s": from_start,
               "process_wall_s": wall, "plain_threads": longest["plain"][0]["threads"],
               "raytrain_threads": longest["raytrain"][0]["threads"],
               "raytrain_orchestrator_imported_from": longest["raytrain"][0].get("orchestrator_imported_from")}
    if difference:
        ms_per_step = {name: 1000 * per_step_by_difference(runs[difference[0]][name], runs[difference[1]][name],
                                                           "process_wall_s", difference) for name in CANDIDATES}
        in_run = {name: per_step_by_difference(runs[difference[0]][name], runs[difference[1]][name],
                                               "first_to_last_step_s", difference) for name in CANDIDATES}
        in_run = {name: None if value is None else 1000 * value for name, value in in_run.items()}
        short_wall = {name: common.median([r["process_wall_s"] for r in runs[difference[0]][name]])
                      for name in CANDIDATES}
        fixed = {name: short_wall[name] - difference[0] * ms_per_step[name] / 1000 for name in CANDIDATES}
        columns += ["ms/step (difference)", "ms/step (in-run)", "fixed_s"]
        for row, name in zip(rows, CANDIDATES):
            row += [ms_per_step[name], "n/a" if in_run[name] is None else in_run[name], fixed[name]]
        figures.update({"ms_per_step_by_difference": ms_per_step, "ms_per_step_in_run_by_difference": in_run,
                        "fixed_cost_s": fixed,
                        "process_wall_s_runs": {f"{name}_{n}": [r["process_wall_s"] for r in runs[n][name]]
                                                for name in CANDIDATES for n in difference}})
        speed = {name: 1 / ms_per_step[name] for name in CANDIDATES}  # steps per ms: a throughput
    else:
        speed = throughput
    common.print_table(columns, rows)
    startup = from_start if from_start["ours"] is not None else launch
    common.finish(
        HARNESS, device=common.device_description(torch.device("cpu")).replace(
            f"torch threads {torch.get_num_threads()}", f"{os.cpu_count()} cores, {args.threads} torch thread(s) per rank"),
        config={"model": args.model, "workers": args.workers, "batch_size_per_rank": args.batch_size,
                "steps": list(args.step_counts), "by_difference": bool(difference),
                "throughput_from": "per-step cost by difference of process walls" if difference
                else "median of steady windows", "log_every_n_steps": args.log_every,
                "warmup_windows": args.warmup_windows, "repeats": args.repeats, "threads_per_rank": args.threads,
                "dtype": "float32 (O0)",
                "ray_train_health_check_interval_s": args.health_check_interval_s or "submit's default (orchestrator.run.driver.HEALTH_CHECK_INTERVAL_S)",
                "startup_from": "process start" if startup is from_start else "just before Ray starts",
                "smoke": args.smoke},
        figures=figures,
        ratios={"orchestration_throughput": speed["ours"] / speed["plain"],
                "loop_throughput": speed["loop"] / speed["plain"],
                "runtime_throughput": speed["ours"] / speed["loop"],
                "raytrain_throughput": speed["ours"] / speed["raytrain"],
                "launch_to_first_step": launch["ours"] / launch["plain"],
                "raytrain_startup": startup["ours"] / startup["raytrain"]},
        targets={"orchestration_throughput": TARGET, "raytrain_throughput": TARGET,
                 "raytrain_startup": STARTUP_TARGET}, json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
