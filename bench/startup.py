"""Start-up: what a fresh process pays before its first step, ampflow's loop against a hand-written script.

Each candidate is a fresh Python process (interleaved rounds, median wall time from the process's start to the end
of its imports): what a rank pays when it is spawned, before it builds anything.

- `hand_written`: `import torch, torch.distributed, torch.nn.parallel` (a hand-written DDP script's imports);
- `ray_free_loop`: `import orchestrator.train.local` (the Ray-free loop a `spawn`ed rank runs);
- `ray_train_worker`: `import orchestrator.runner.worker` (what a Ray Train worker imports besides Ray itself);
- `ddp_wrap`: `hand_written` plus wrapping a one-layer model in DDP (one gloo rank): torch's DDP imports
  torch._dynamo when it wraps a model, for a hand-written script and for ampflow alike.

Figures: seconds per candidate; ratios `ray_free_loop_extra_s` and `ray_train_worker_extra_s` (seconds over
`hand_written`; the issue's target: within 2 s of a hand-written script to the first step). Process start and
imports only: a job's data and model are the user's, the same on both sides.
"""

import importlib.util
import subprocess
import sys
import time

import torch

from bench import common

HARNESS = "startup"
CANDIDATES = {
    "hand_written": "import torch, torch.distributed, torch.nn.parallel",
    "ray_free_loop": "import orchestrator.train.local",
    "ray_train_worker": "import orchestrator.runner.worker",
    "ddp_wrap": ("import os, torch, torch.distributed as dist, torch.nn.parallel\n"
                 "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=os.environ['PORT'])\n"
                 "dist.init_process_group('gloo', rank=0, world_size=1)\n"
                 "torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))\n"
                 "dist.destroy_process_group()"),
}
TARGETS = {"ray_free_loop_extra_s": "<= 2.0", "ray_train_worker_extra_s": "<= 2.0"}


def seconds(code: str, port: int) -> float:
    import os

    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PORT": str(port)})
    return time.perf_counter() - began


def main(argv=None) -> int:
    cli = common.parser(HARNESS, "process start + imports: the Ray-free loop and a Ray Train worker vs a hand-written "
                                 "script")
    cli.add_argument("--repeats", type=int, help="rounds (default 5; 1 with --smoke)")
    args = cli.parse_args(argv)
    repeats = args.repeats or (1 if args.smoke else 5)
    candidates = dict(CANDIDATES)
    if importlib.util.find_spec("ray") is None:  # a machine with torch alone (a GPU visit without the Ray pack)
        print("ray is not installed: the ray_train_worker candidate is left out", file=sys.stderr)
        del candidates["ray_train_worker"]
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for round_number in range(repeats):
        for name, code in candidates.items():
            times[name].append(seconds(code, 29700 + round_number))
    medians = {name: common.median(values) for name, values in times.items()}
    rows = [[name, medians[name], common.spread(times[name])] for name in candidates]
    print(f"bench.startup: {repeats} round(s), fresh processes")
    common.print_table(["candidate", "median s", "spread"], rows)
    ratios = {f"{name}_extra_s": medians[name] - medians["hand_written"]
              for name in ("ray_free_loop", "ray_train_worker") if name in medians}
    common.finish(HARNESS, device=common.device_description(torch.device("cpu")),
                  config={"repeats": repeats, "smoke": args.smoke},
                  figures={"seconds": medians, "rounds": times}, ratios=ratios,
                  targets={name: target for name, target in TARGETS.items() if name in ratios}, json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
