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
first step. For ours, the `launched_at` of its run record (when submit starts Ray, and the MLflow run's
creation beside it) minus the process start, plus `perf/time_to_first_step_s`; it counts what submit does
before Ray (imports, config, the pre-flight) as well. `launch_to_first_step_s` of raytrain counts from just
before its `ray.init`, the span ours's own figure covers.

Paired ratios (`raytrain_throughput_paired`, `raytrain_startup_paired`): ours / raytrain repeat by repeat,
of the two runs made back to back, then the median. A slow spell of a shared machine slows both runs of
a pair, so these move less than the ratio of two medians. `--candidates raytrain,ours` runs only those
two, for more pairs in the same time.

The candidates run alternately (plain, loop, raytrain, ours, plain, ...; with --by-difference the
SHORT round, then the LONG round, per repeat). Threads: a Ray Train worker with its default 1 CPU gets
OMP_NUM_THREADS=1 from Ray (torch then uses 1 thread); the spawned ranks call torch.set_num_threads
with the same number, and the Ray subprocesses get OMP_NUM_THREADS set to it so they can never differ.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

from bench import common
from bench.orchestration_ray import job_dict, run_ours, run_raytrain
from bench.orchestration_spawned import run_spawned

HARNESS = "orchestration"
TARGET = ">= 0.97"
STARTUP_TARGET = "<= 1.1"
CANDIDATES = ("plain", "loop", "raytrain", "ours")
TARGETS = {"orchestration_throughput": TARGET, "raytrain_throughput": TARGET, "raytrain_throughput_paired": TARGET,
           "raytrain_startup": STARTUP_TARGET, "raytrain_startup_paired": STARTUP_TARGET}



def per_step_by_difference(short: list[dict], long: list[dict], key: str, steps: tuple[int, int]) -> float | None:
    """Seconds per step: (median `key` of the long runs - that of the short runs) / (LONG - SHORT)."""
    if any(r.get(key) is None for r in short + long):
        return None
    return (common.median([r[key] for r in long]) - common.median([r[key] for r in short])) / (steps[1] - steps[0])


def paired(runs: dict[int, dict[str, list[dict]]], difference: tuple[int, int] | None, ours: str,
           other: str) -> dict[str, float]:
    """Ratios repeat by repeat, of runs made back to back (a slow spell of the machine slows both), then their
    median: `*_paired` throughput from the steady windows (with --by-difference: from each repeat's own
    difference of process walls), start-up from the process start."""
    longest = runs[max(runs)]
    if ours not in longest or other not in longest:
        return {}
    pairs = list(zip(longest[ours], longest[other]))
    if difference:  # steps per second of one repeat: its LONG wall minus its SHORT wall, over the steps between
        def cost(name: str, index: int) -> float:
            return runs[difference[1]][name][index]["process_wall_s"] - runs[difference[0]][name][index]["process_wall_s"]

        throughput = [cost(other, i) / cost(ours, i) for i in range(len(pairs))]
    else:
        throughput = [common.median(a["steady"]) / common.median(b["steady"]) for a, b in pairs]
    found = {"raytrain_throughput_paired": throughput}
    starts = [(a["process_start_to_first_step_s"], b["process_start_to_first_step_s"]) for a, b in pairs]
    if all(a is not None and b is not None for a, b in starts):
        found["raytrain_startup_paired"] = [a / b for a, b in starts]
    return {name: common.median(values) for name, values in found.items()}


def ratios(speed: dict, launch: dict, startup: dict, paired_ratios: dict[str, float]) -> dict[str, float]:
    """Every ratio whose candidates ran (`--candidates`)."""
    wanted = {"orchestration_throughput": (speed, "ours", "plain"), "loop_throughput": (speed, "loop", "plain"),
              "runtime_throughput": (speed, "ours", "loop"), "raytrain_throughput": (speed, "ours", "raytrain"),
              "launch_to_first_step": (launch, "ours", "plain"), "raytrain_startup": (startup, "ours", "raytrain")}
    found = {name: figures[a] / figures[b] for name, (figures, a, b) in wanted.items()
             if figures.get(a) is not None and figures.get(b) is not None}
    return {**found, **paired_ratios}


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
    cli.add_argument("--address", help="ours and raytrain join the Ray at this address (host:port of its GCS) "
                                       "instead of each starting a local Ray of its own: their start-up figures "
                                       "then leave out Ray's own start. For the harness's test, which runs on the "
                                       "test suite's shared Ray; measure without it")
    cli.add_argument("--candidates", default=",".join(CANDIDATES),
                     help="which candidates run, comma-separated (default all; e.g. raytrain,ours for more repeats of "
                          "the two the raytrain ratios compare in the same time)")
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
    chosen = tuple(name for name in CANDIDATES if name in args.candidates.split(","))
    unknown = set(args.candidates.split(",")) - set(CANDIDATES)
    if unknown or not chosen:
        print(f"error: --candidates takes names from {', '.join(CANDIDATES)}", file=sys.stderr)
        return 2
    if any(n % args.log_every or n // args.log_every <= args.warmup_windows for n in args.step_counts):
        print("error: the step counts must be multiples of --log-every with more windows than --warmup-windows",
              file=sys.stderr)
        return 2

    from omegaconf import OmegaConf

    runs: dict[int, dict[str, list[dict]]] = {n: {name: [] for name in chosen} for n in args.step_counts}
    with tempfile.TemporaryDirectory(prefix="ampflow-bench-") as tmp_name:
        tmp = Path(tmp_name)
        for index in range(args.repeats):
            for steps in args.step_counts:
                run_args = argparse.Namespace(**{**vars(args), "steps": steps})
                cfg = OmegaConf.to_container(common.job_config(job_dict(run_args, tmp)), resolve=True)
                results = runs[steps]
                for name in chosen:
                    if name in ("plain", "loop"):
                        results[name].append(run_spawned(name, run_args, cfg, tmp, index))
                    elif name == "raytrain":
                        results[name].append(run_raytrain(run_args, cfg, tmp, index))
                    else:
                        results[name].append(run_ours(run_args, tmp, index, steps))
                print(f"repeat {index + 1}/{args.repeats}, {steps} steps: " + ", ".join(
                    f"{name} {common.median(results[name][-1]['steady']):.1f} samples/s "
                    f"{results[name][-1]['process_wall_s']:.1f} s" for name in chosen), flush=True)

    # Steady windows and start-up come from the longest runs (the only runs without --by-difference).
    longest = runs[args.step_counts[-1]]
    per_run = {name: [common.median(r["steady"]) for r in results] for name, results in longest.items()}
    throughput = {name: common.median(values) for name, values in per_run.items()}
    all_runs = {name: [r for n in args.step_counts for r in runs[n][name]] for name in chosen}

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
             wall[name]] for name in chosen]
    figures = {**{f"{name}_samples_per_s": throughput[name] for name in chosen},
               **{f"{name}_samples_per_s_runs": per_run[name] for name in chosen},
               **{f"{name}_windows": [r["windows"] for r in longest[name]] for name in chosen},
               "launch_to_first_step_s": launch, "process_start_to_first_step_s": from_start,
               "process_wall_s": wall,
               **{f"{name}_threads": longest[name][0]["threads"] for name in ("plain", "raytrain") if name in chosen},
               "raytrain_orchestrator_imported_from":
                   longest["raytrain"][0].get("orchestrator_imported_from") if "raytrain" in chosen else None}
    if difference:
        ms_per_step = {name: 1000 * per_step_by_difference(runs[difference[0]][name], runs[difference[1]][name],
                                                           "process_wall_s", difference) for name in chosen}
        in_run = {name: per_step_by_difference(runs[difference[0]][name], runs[difference[1]][name],
                                               "first_to_last_step_s", difference) for name in chosen}
        in_run = {name: None if value is None else 1000 * value for name, value in in_run.items()}
        short_wall = {name: common.median([r["process_wall_s"] for r in runs[difference[0]][name]])
                      for name in chosen}
        fixed = {name: short_wall[name] - difference[0] * ms_per_step[name] / 1000 for name in chosen}
        columns += ["ms/step (difference)", "ms/step (in-run)", "fixed_s"]
        for row, name in zip(rows, chosen):
            row += [ms_per_step[name], "n/a" if in_run[name] is None else in_run[name], fixed[name]]
        figures.update({"ms_per_step_by_difference": ms_per_step, "ms_per_step_in_run_by_difference": in_run,
                        "fixed_cost_s": fixed,
                        "process_wall_s_runs": {f"{name}_{n}": [r["process_wall_s"] for r in runs[n][name]]
                                                for name in chosen for n in difference}})
        speed = {name: 1 / ms_per_step[name] for name in chosen}  # steps per ms: a throughput
    else:
        speed = throughput
    common.print_table(columns, rows)
    startup = from_start if from_start.get("ours") is not None else launch
    found = ratios(speed, launch, startup, paired(runs, difference, "ours", "raytrain"))
    common.finish(
        HARNESS, device=common.device_description(torch.device("cpu")).replace(
            f"torch threads {torch.get_num_threads()}", f"{os.cpu_count()} cores, {args.threads} torch thread(s) per rank"),
        config={"model": args.model, "workers": args.workers, "batch_size_per_rank": args.batch_size,
                "steps": list(args.step_counts), "by_difference": bool(difference),
                "throughput_from": "per-step cost by difference of process walls" if difference
                else "median of steady windows", "log_every_n_steps": args.log_every,
                "warmup_windows": args.warmup_windows, "repeats": args.repeats, "threads_per_rank": args.threads,
                "dtype": "float32 (O0)",
                "ray_train_health_check_interval_s": args.health_check_interval_s or "submit's default (orchestrator.runner.ray_start.HEALTH_CHECK_INTERVAL_S)",
                "startup_from": "process start" if startup is from_start else "just before Ray starts",
                "ray": f"joined at {args.address}" if args.address else "a local Ray of each run's own",
                "smoke": args.smoke},
        figures=figures,
        ratios=found,
        targets={name: target for name, target in TARGETS.items() if name in found}, json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
