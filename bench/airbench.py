"""Epoch time of an airbench-class CIFAR-10 network: our Ray-free loop with every fast path vs a hand-written loop.

The network (`AirbenchNet`): a small all-convolutional net of the kind that trains CIFAR-10 to 94% in seconds:
a 2x2 patch stem, three groups of (conv, max-pool, BatchNorm, GELU, conv, BatchNorm, GELU) widening
64 -> 256 -> 256, a global max-pool and a linear classifier; about 2 M parameters. Both candidates keep the
BatchNorm layers in fp32 and everything else in fp16 with fp32 master weights and a dynamic loss scale
(preset O2), channels_last, fused SGD (Nesterov), and compile the model after its first step (`--no-compile`
turns that off for both).

- `ours`: `orchestrator.train.local.spawn`, the loop every Ray Train worker runs, on one rank, with every fast
  path on: `data.loader: device` (the whole set resident on the GPU, batches sliced there),
  `perf.channels_last`, `optim.implementation: fused`, `perf.compile`. Its epoch time is read from the loop's
  own end-of-epoch report (`perf/samples_per_s` over the epoch's steps; evaluation and checkpoints come only
  after the last epoch, reporting is left out of the window by the loop).
- `hand`: one function in this file, written as a user would without ampflow: the same network and weights'
  seed, the data as one tensor on the GPU, a `randperm` per epoch, `GradScaler` on fp32 master copies. Its
  GradScaler hands the scale to the fused SGD, which unscales and skips in its kernel without a host sync;
  ours reads its overflow flags once per step (guardrails, skip counters): part of what is measured.

Data: CIFAR-10's size and shape, synthetic (50,000 3x32x32 samples of 10 classes per epoch by default):
the files cannot be had without a network, and the values do not change the time of an epoch. No
augmentation on either side. The first epoch of every run (compilation, autotuning) is left out; the
figure is the median epoch time over the other epochs of every run, the candidates' runs alternating.

Ratio `airbench_epoch_throughput`: hand epoch time / ours epoch time (target >= 0.9).
`--smoke` runs tiny sizes on the CPU without compilation: it checks that both candidates run, nothing more.

    python -m bench.airbench --device cuda --json out/gpu-visit/airbench.json
"""

import gc
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bench import common

HARNESS = "airbench"
TARGET = ">= 0.9"
CIFAR_SHAPE = (3, 32, 32)


class ConvGroup(nn.Module):
    """conv -> max-pool (halves the size) -> BatchNorm -> GELU -> conv -> BatchNorm -> GELU."""

    def __init__(self, channels_in: int, channels_out: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, padding=1, bias=False)
        self.pool = nn.MaxPool2d(2)
        self.norm1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False)
        self.norm2 = nn.BatchNorm2d(channels_out)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.norm1(self.pool(self.conv1(x))))
        return self.act(self.norm2(self.conv2(x)))


class AirbenchNet(nn.Module):
    """A small CIFAR network in the airbench class (see the module's docstring)."""

    def __init__(self, num_classes: int = 10, widths: Sequence[int] = (64, 256, 256), stem_width: int = 24):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, stem_width, kernel_size=2), nn.GELU())
        channels = [stem_width, *widths]
        self.groups = nn.Sequential(*(ConvGroup(a, b) for a, b in zip(channels, channels[1:])))
        self.pool = nn.AdaptiveMaxPool2d(1)
        self.head = nn.Linear(channels[-1], num_classes, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.groups(self.stem(x))).flatten(1))


def synthetic_set(samples: int, device: torch.device, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(samples, *CIFAR_SHAPE, generator=generator)
    labels = torch.randint(0, 10, (samples,), generator=generator)
    return images.to(device), labels.to(device)


def job(args, device: torch.device) -> dict:
    """The `ours` job: the harness's sizes, every fast path on."""
    return {
        "model": {"name": "bench.airbench:AirbenchNet", "kwargs": {"widths": list(args.widths),
                                                                   "stem_width": args.stem_width}},
        "data": {"name": "synthetic", "synthetic_samples": args.samples, "loader": "device", "augment": False},
        "optim": {"name": "sgd", "lr": args.lr, "momentum": 0.9, "nesterov": True, "weight_decay": 5e-4,
                  "schedule": "none", "implementation": "fused"},
        "precision": {"preset": "O2"},
        "perf": {"channels_last": True, "compile": args.compile, "compile_backend": args.compile_backend},
        "scaling": {"num_workers": 1, "use_gpu": device.type == "cuda"},
        # One report per epoch (its window is the epoch's steps); evaluation and a checkpoint after the last only.
        "run": {"epochs": args.epochs, "batch_size": args.batch_size, "seed": 0,
                "eval_every_n_epochs": args.epochs},
        "tracking": {"log_every_n_steps": 10**9, "log_model": False},
        "checkpoint": {"every_n_epochs": args.epochs, "num_to_keep": 1},
    }


def run_ours(args, device: torch.device) -> list[float]:
    """Seconds per epoch of each epoch of one run of the loop, from its end-of-epoch reports."""
    from omegaconf import OmegaConf

    from bench.visit_quickstart import report_parts
    from orchestrator.train.local import spawn

    cfg = OmegaConf.to_container(common.job_config(job(args, device)), resolve=True)
    with tempfile.TemporaryDirectory(prefix="ampflow-airbench-") as tmp:
        reports = spawn(cfg, 1, Path(tmp))["reports"]
    speeds = [metrics["perf/samples_per_s"] for metrics, _, _ in map(report_parts, reports)
              if "perf/samples_per_s" in metrics]
    if len(speeds) != args.epochs:
        raise RuntimeError(f"expected one report with perf/samples_per_s per epoch ({args.epochs}), got {len(speeds)}")
    return [args.samples / speed for speed in speeds]


def run_hand(args, device: torch.device) -> list[float]:
    """Seconds per epoch of the hand-written loop: fp16 network with fp32 BatchNorm, fp32 masters, GradScaler."""
    torch.manual_seed(0)
    images, labels = synthetic_set(args.samples, device)
    model = AirbenchNet(widths=args.widths, stem_width=args.stem_width).to(device, memory_format=torch.channels_last)
    model.half()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.float()
    half = [p for p in model.parameters() if p.dtype == torch.float16]
    masters = [p.detach().float().requires_grad_() for p in half]
    fp32 = [p for p in model.parameters() if p.dtype == torch.float32]
    optimizer = torch.optim.SGD(masters + fp32, lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4,
                                fused=True)
    scaler = torch.amp.GradScaler(device.type)
    forward = model
    sync = common.synchronize(device)
    epoch_s, step = [], 0
    for _ in range(args.epochs):
        sync()
        started = time.perf_counter()
        order = torch.randperm(args.samples, device=device)
        for first in range(0, args.samples - args.batch_size + 1, args.batch_size):
            index = order[first:first + args.batch_size]
            inputs = images[index].half().contiguous(memory_format=torch.channels_last)
            loss = F.cross_entropy(forward(inputs), labels[index])
            scaler.scale(loss).backward()
            with torch.no_grad():
                for param, master in zip(half, masters):
                    master.grad, param.grad = param.grad.float(), None
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for param, master in zip(half, masters):
                    param.copy_(master)
            step += 1
            if step == 1 and args.compile:  # as ours: the first step eager, then compiled
                forward = torch.compile(model, backend=args.compile_backend)
        sync()
        epoch_s.append(time.perf_counter() - started)
    return epoch_s


def main(argv=None) -> int:
    cli = common.with_device(common.parser(HARNESS, "airbench-class CIFAR-10 epoch: our Ray-free loop with every fast "
                                                    "path vs a hand-written loop with the data on the GPU"))
    cli.add_argument("--samples", type=int, help="training samples per epoch (default 50000; 32 with --smoke)")
    cli.add_argument("--batch-size", type=int, help="default 500 (100 steps an epoch); 16 with --smoke")
    cli.add_argument("--epochs", type=int, help="epochs per run, the first left out (default 4; 2 with --smoke)")
    cli.add_argument("--repeats", type=int, help="runs of each candidate, alternating (default 2; 1 with --smoke)")
    cli.add_argument("--lr", type=float, default=0.01)
    cli.add_argument("--no-compile", dest="compile", action="store_false", default=None,
                     help="no torch.compile on either side (default: compile on CUDA, not on the CPU)")
    args = cli.parse_args(argv)
    device = common.chosen_device(args)
    if device is None:
        return 2
    gpu = device.type == "cuda"
    args.samples = args.samples or (32 if args.smoke else 50_000)
    args.batch_size = args.batch_size or (16 if args.smoke else 500)
    args.epochs = args.epochs or (2 if args.smoke else 4)
    args.repeats = args.repeats or (1 if args.smoke else 2)
    args.widths, args.stem_width = ((8, 16, 16), 8) if args.smoke else ((64, 256, 256), 24)
    args.compile = gpu if args.compile is None else args.compile
    args.compile_backend = "inductor" if gpu else "aot_eager"  # inductor on a CPU compiles for minutes
    if args.epochs < 2 or args.samples % args.batch_size:
        print("error: --epochs must be >= 2 (the first is left out) and --samples a multiple of --batch-size (no "
              "partial batch to recompile for)", file=sys.stderr)
        return 2

    runs: dict[str, list[list[float]]] = {"ours": [], "hand": []}
    for index in range(args.repeats):
        for name, run in (("ours", run_ours), ("hand", run_hand)):
            runs[name].append(run(args, device))
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
        print(f"repeat {index + 1}/{args.repeats}: " + ", ".join(
            f"{name} {common.median(epochs[-1][1:]) * 1e3:.1f} ms/epoch" for name, epochs in runs.items()), flush=True)
    timed = {name: [s for epochs in per_run for s in epochs[1:]] for name, per_run in runs.items()}
    epoch_s = {name: common.median(values) for name, values in timed.items()}

    print(f"bench.airbench on {common.device_description(device)}: {args.samples} samples x {args.epochs} epochs "
          f"(first left out), batch {args.batch_size}, O2, compile {'on' if args.compile else 'off'}, "
          f"{args.repeats} run(s) each")
    common.print_table(["candidate", "epoch s", "samples/s", "spread"],
                       [[name, epoch_s[name], args.samples / epoch_s[name],
                         f"{common.spread(timed[name]) * 100:.1f}%"] for name in runs])
    common.finish(
        HARNESS, device=common.device_description(device),
        config={"model": "AirbenchNet", "widths": list(args.widths), "stem_width": args.stem_width,
                "samples": args.samples, "batch_size": args.batch_size, "epochs": args.epochs,
                "repeats": args.repeats, "preset": "O2", "compile": args.compile,
                "compile_backend": args.compile_backend, "data": "synthetic, on the device, no augmentation",
                "smoke": args.smoke},
        figures={"epoch_s": epoch_s, "samples_per_s": {name: args.samples / s for name, s in epoch_s.items()},
                 "epoch_s_runs": runs},
        ratios={"airbench_epoch_throughput": epoch_s["hand"] / epoch_s["ours"]},
        targets={"airbench_epoch_throughput": TARGET}, json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
