"""Time per epoch of a whole training run: ampflow's loop against the torch.amp script a user writes by hand.

Each run is a fresh Python process, started here and timed here from its start to its exit, so every candidate pays
its own imports, CUDA start-up, data building, evaluation and final checkpoint. Every candidate runs `--short` and
`--long` epochs. Its time per epoch, two ways:
- in the runs: each run stamps the end of every epoch, its evaluation done and the device synchronised (the
  hand-written script in its loop, ampflow's through a job callback, `EpochClock`); the figure is the median of the
  long runs' epochs after their first (the time from one epoch's end to the next's: its steps, data loading,
  evaluation, loss logging and report). Start-up's noise stays out of it. The ratios are read from it.
- by difference (`*_by_difference`): (wall of the long run - wall of the short run) / (long - short), medians of the
  `--repeats`: start-up and the end of a run cancel, but their noise does not.
The candidates alternate, each repeat rotated.

The job, the same for all: a registry model (ResNet-18 of CIFAR's shape by default), `synthetic` CIFAR-shaped data
(`--steps-per-epoch` batches of `--batch-size` per epoch, an eighth of that for evaluation), SGD with momentum,
Nesterov and weight decay under a one-cycle schedule, `--preset` (O1: fp16 autocast + GradScaler), an evaluation
every epoch, the loss read on the host every `tracking.log_every_n_steps` steps, one checkpoint at the end of the run.

- `hand_written`: the script a user writes with torch.amp, outside ampflow: the same model, initial weights and
  tensors; a DataLoader that shuffles, pinned memory and non-blocking copies; NCHW, no cudnn.benchmark, the
  optimizer's default (foreach) kernels; `optimizer.zero_grad`, autocast, `scaler.scale(loss).backward()`,
  `scaler.step`, `scaler.update`, `scheduler.step`; `loss.item()` every `log_every_n_steps` steps for its progress
  line; after each epoch an evaluation under autocast whose accuracy is summed on the device and read once; at the
  end, `torch.save` of the model's and the optimizer's state.
- `baseline`: ampflow's Ray-free loop (`orchestrator.train.local.spawn`, one rank: the loop every Ray Train worker
  runs) with every fast path off (`bench.fast_paths.FAST_PATHS_OFF`): the work the hand-written script does, plus
  everything ampflow adds per step (the guarded loss scaler, counters, telemetry, hooks) and per epoch.
- `defaults`: the same job with ampflow's defaults (on CUDA: docs/performance.md, "Defaults on CUDA").

Ratios: `baseline_epoch_vs_hand_written` (time per epoch; target at most 1.02: with its fast paths off ampflow costs
what the hand-written script costs) and `defaults_speedup_vs_hand_written` (hand-written time per epoch / the
defaults': target at least 1.3 on a GPU). `baseline_fixed_extra_s`, `defaults_fixed_extra_s`: seconds a run costs
besides its epochs (the short run's wall less its epochs timed in the runs: start-up, data building, the first
epoch's warm-up, the end of the run), over the hand-written script's. `spawn` starts its rank in a second Python
process, which imports torch again: a Ray Train worker is that process, and `python -m orchestrator.submit` pays
Ray's start instead (`bench.orchestration`).
"""

import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import common

HARNESS = "epoch"
CANDIDATES = ("hand_written", "baseline", "defaults")
TARGETS = {"baseline_epoch_vs_hand_written": "<= 1.02", "defaults_speedup_vs_hand_written": ">= 1.3"}


def job(args, epochs: int, overrides: list[str]):
    """The job every candidate trains (the hand-written script reads its settings from it too)."""
    samples = args.batch_size * args.steps_per_epoch
    return common.job_config({
        "model": {"name": args.model},
        "data": {"name": "synthetic", "synthetic_samples": samples, "augment": False},
        "optim": {"name": "sgd", "lr": 0.2, "momentum": 0.9, "nesterov": True, "weight_decay": 5e-4,
                  "schedule": "onecycle"},
        "precision": {"preset": args.preset},
        "scaling": {"num_workers": 1, "use_gpu": args.device == "cuda"},
        "run": {"epochs": epochs, "batch_size": args.batch_size},
        "checkpoint": {"every_n_epochs": epochs},  # one at the end of the run, as the hand-written script saves
    }, overrides)


class EpochClock:
    """A callback (the job's `callbacks`) that stamps the end of each epoch, its evaluation done, into a JSON file:
    the times between stamps are epochs timed inside the run, free of start-up's noise."""

    def __init__(self, path: str):
        self.path, self.stamps = Path(path), []

    def end_epoch(self, loop, report) -> None:
        stamp(self.stamps, self.path, loop.device)


def stamp(stamps: list[float], path: Path, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stamps.append(time.perf_counter())
    path.write_text(json.dumps(stamps))


def hand_written(cfg, device: torch.device, directory: Path, stamps_path: Path) -> None:
    """The torch.amp training script a user writes by hand (see the module's docstring)."""
    import contextlib

    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from orchestrator.precision import AmpSettings
    from orchestrator.train.data import build_datasets
    from orchestrator.train.models import build_model
    from orchestrator.train.optim import ONECYCLE_WARMUP

    torch.backends.cudnn.benchmark = False
    amp = AmpSettings.from_config(cfg.precision)
    torch.manual_seed(cfg.run.seed)
    net = build_model(cfg.model).to(device)
    train, val = build_datasets(cfg.data, cfg.model.num_classes)
    pin = device.type == "cuda"
    loader = DataLoader(train, batch_size=cfg.run.batch_size, shuffle=True, drop_last=True, pin_memory=pin)
    val_loader = DataLoader(val, batch_size=cfg.run.batch_size, pin_memory=pin)
    o = cfg.optim
    optimizer = torch.optim.SGD(net.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay,
                                nesterov=o.nesterov)
    total = cfg.run.epochs * len(loader)  # each phase at least 1 step, as ampflow's schedule keeps for tiny runs
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=o.lr, total_steps=total,
                                                    pct_start=min(max(ONECYCLE_WARMUP, 2 / total), 1 - 1 / total))
    scaler = torch.amp.GradScaler(device.type, enabled=amp.scaler_enabled)
    autocast = (lambda: torch.autocast(device.type, dtype=amp.compute_dtype)) if amp.autocast_enabled \
        else contextlib.nullcontext
    log_every = cfg.tracking.log_every_n_steps
    stamps: list[float] = []  # the harness's clock, not the script's
    for epoch in range(cfg.run.epochs):
        net.train()
        for index, (inputs, targets) in enumerate(loader):
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with autocast():
                loss = F.cross_entropy(net(inputs), targets)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if (index + 1) % log_every == 0:
                print(f"epoch {epoch + 1} step {index + 1} loss {loss.item():.4f}", flush=True)
        net.eval()
        correct = torch.zeros((), dtype=torch.long, device=device)
        with torch.no_grad(), autocast():
            for inputs, targets in val_loader:
                inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
                correct += (net(inputs).argmax(1) == targets).sum()
        print(f"epoch {epoch + 1} eval accuracy {correct.item() / len(val):.4f}", flush=True)
        stamp(stamps, stamps_path, device)
    torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict()}, directory / "final.pt")


def overrides_of(candidate: str) -> list[str]:
    from bench.fast_paths import FAST_PATHS_OFF

    return {"hand_written": FAST_PATHS_OFF, "baseline": FAST_PATHS_OFF, "defaults": []}[candidate]


def child(args) -> int:
    """One run of one candidate, in this process (the parent times the process)."""
    clock = [f"callbacks=[{{name: 'bench.epoch:EpochClock', kwargs: {{path: '{args.stamps}'}}}}]"]
    cfg = job(args, args.epochs, overrides_of(args.child) + ([] if args.child == "hand_written" else clock))
    with tempfile.TemporaryDirectory(prefix="bench-epoch-") as tmp:
        if args.child == "hand_written":
            hand_written(cfg, torch.device(args.device), Path(tmp), Path(args.stamps))
            return 0
        from omegaconf import OmegaConf

        from orchestrator.train.local import spawn

        outcome = spawn(OmegaConf.to_container(cfg, resolve=True), 1, Path(tmp))
        final = outcome["reports"][-1].metrics
        print(f"eval accuracy {final.get('eval/accuracy', float('nan')):.4f}", flush=True)
    return 0


def run_once(args, candidate: str, epochs: int) -> tuple[float, list[float]]:
    """Seconds from starting a fresh process running `candidate` for `epochs` epochs to its exit, and the seconds
    each epoch after the first took inside the run (from one epoch's end to the next's)."""
    with tempfile.TemporaryDirectory(prefix="bench-epoch-clock-") as tmp:
        stamps_path = Path(tmp) / "stamps.json"
        command = [sys.executable, "-m", "bench.epoch", "--child", candidate, "--epochs", str(epochs),
                   "--device", args.device, "--model", args.model, "--preset", args.preset,
                   "--batch-size", str(args.batch_size), "--steps-per-epoch", str(args.steps_per_epoch),
                   "--stamps", str(stamps_path)]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(f"{candidate} ({epochs} epochs) exited {done.returncode}:\n{done.stderr[-3000:]}")
        stamps = json.loads(stamps_path.read_text())
    if len(stamps) != epochs:
        raise RuntimeError(f"{candidate} ({epochs} epochs) stamped {len(stamps)} epoch end(s)")
    return seconds, [later - earlier for earlier, later in zip(stamps, stamps[1:])]


def main(argv=None) -> int:
    cli = common.with_device(common.parser(HARNESS, "time per epoch of a whole run, ours vs a hand-written torch.amp "
                                                    "script, each run a fresh process"))
    cli.add_argument("--model", help="registry name (default resnet18; simple_cnn with --smoke)")
    cli.add_argument("--preset", help="precision preset (default O1; O0 with --smoke: CPU half precision is emulated)")
    cli.add_argument("--batch-size", type=int, help="default 512 (8 with --smoke)")
    cli.add_argument("--steps-per-epoch", type=int, help="default 98 (50,176 samples, CIFAR-10's size; 3 with --smoke)")
    cli.add_argument("--short", type=int, default=1, help="epochs of the short run (default 1)")
    cli.add_argument("--long", type=int, help="epochs of the long run (default 5; 2 with --smoke)")
    cli.add_argument("--repeats", type=int, help="runs of each candidate and length (default 2; 1 with --smoke)")
    cli.add_argument("--candidates", default=",".join(CANDIDATES), help="which to run (default all)")
    cli.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    cli.add_argument("--child", choices=CANDIDATES, help=None)  # internal: one run of one candidate
    cli.add_argument("--epochs", type=int, help=None)  # internal: the child's epochs
    cli.add_argument("--stamps", help=None)  # internal: where the child stamps its epochs' ends
    args = cli.parse_args(argv)
    args.model = args.model or ("simple_cnn" if args.smoke else "resnet18")
    args.preset = args.preset or ("O0" if args.smoke else "O1")
    args.batch_size = args.batch_size or (8 if args.smoke else 512)
    args.steps_per_epoch = args.steps_per_epoch or (3 if args.smoke else 98)
    if args.child:
        return child(args)
    device = common.chosen_device(args)
    if device is None:
        return 2
    long = args.long or (2 if args.smoke else 5)
    repeats = args.repeats or (1 if args.smoke else 2)
    candidates = [name.strip() for name in args.candidates.split(",") if name.strip()]
    unknown = sorted(set(candidates) - set(CANDIDATES))
    if unknown or long <= args.short:
        print(f"error: --candidates takes {', '.join(CANDIDATES)} (got {', '.join(unknown)}); --long must exceed "
              "--short" if unknown else "error: --long must exceed --short", file=sys.stderr)
        return 2
    walls: dict[str, dict[int, list[float]]] = {name: {args.short: [], long: []} for name in candidates}
    epochs_in_run: dict[str, list[float]] = {name: [] for name in candidates}  # the long runs' epochs after the first
    for repeat in range(repeats):
        order = candidates[repeat % len(candidates):] + candidates[:repeat % len(candidates)]
        for epochs in (args.short, long):
            for name in order:
                seconds, epoch_seconds = run_once(args, name, epochs)
                walls[name][epochs].append(seconds)
                if epochs == long:
                    epochs_in_run[name].extend(epoch_seconds)
                print(f"repeat {repeat + 1}: {name:<13} {epochs} epoch(s) {seconds:8.2f} s; epochs after the first "
                      f"{', '.join(f'{x:.3f}' for x in epoch_seconds) or '-'} s", flush=True)
    per_epoch = {name: common.median(values) for name, values in epochs_in_run.items()}
    by_difference = {name: (common.median(w[long]) - common.median(w[args.short])) / (long - args.short)
                     for name, w in walls.items()}
    # What a run costs besides its epochs (start-up, data building, the first epoch's warm-up, the end of the run).
    fixed = {name: common.median(w[args.short]) - args.short * per_epoch[name] for name, w in walls.items()}
    for name in candidates:
        print(f"{name:<13} {per_epoch[name]:8.3f} s per epoch in the runs (spread "
              f"{common.spread(epochs_in_run[name]) * 100:.1f}%), {by_difference[name]:8.3f} by difference of the "
              f"process walls, {fixed[name]:6.2f} s besides the epochs")
    ratios = {}
    for label, figures in (("", per_epoch), ("_by_difference", by_difference)):
        hand = figures.get("hand_written", math.nan)
        if "baseline" in figures:
            ratios[f"baseline_epoch_vs_hand_written{label}"] = figures["baseline"] / hand
        if "defaults" in figures:
            ratios[f"defaults_speedup_vs_hand_written{label}"] = hand / figures["defaults"]
    for name in ("baseline", "defaults"):
        if name in fixed and "hand_written" in fixed:
            ratios[f"{name}_fixed_extra_s"] = fixed[name] - fixed["hand_written"]
    common.finish(HARNESS, device=common.device_description(device),
                  config={"model": args.model, "preset": args.preset, "batch_size": args.batch_size,
                          "steps_per_epoch": args.steps_per_epoch, "short": args.short, "long": long,
                          "repeats": repeats},
                  figures={"seconds_per_epoch": per_epoch, "seconds_per_epoch_in_runs": epochs_in_run,
                           "seconds_per_epoch_by_difference": by_difference, "seconds_besides_epochs": fixed,
                           "process_wall_s": {name: {str(e): v for e, v in w.items()} for name, w in walls.items()}},
                  ratios=ratios, targets=TARGETS if device.type == "cuda" else {}, json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
