"""What each fast-path switch buys: samples/s of the worker's own step with one switch on at a time.

One process, no Ray, no DDP (the DDP knobs and the comm hook need several GPUs). Every candidate
is a fresh training loop (`orchestrator.train.loop.TrainingLoop`) from the same seed under the same
preset, fed by the loader its config asks for, stepped by the loop's own `train_step` (its hooks, the
audit and compile after the first step included). Candidates:

- `baseline`: every fast path off (`FAST_PATHS_OFF`): `data.loader: dataloader` (a DataLoader over host tensors,
  pinned memory), NCHW, eager, the optimizer's foreach kernels, no cudnn.benchmark.
- `defaults`: the job as a user writes it: on CUDA the defaults (channels_last for convolutions, the fused
  optimizer, cudnn.benchmark, the tensor dataset on the device; docs/performance.md, "Defaults on CUDA").
- `device_loader`, `channels_last`, `fused`, `cudnn_benchmark`, `compile`: one switch each on top of the baseline.
- `all`: every switch together.
- `hand_written`: the loop a user writes by hand with torch.amp, outside ampflow: the same model and initial
  weights, SGD with the same settings, autocast + GradScaler under a float16 preset (plain fp32 under O0), a
  DataLoader over the same tensors (pinned, non-blocking copies), NCHW, no cudnn.benchmark.

Ratios: each switch's speed-up over `baseline`; `baseline_time_vs_hand_written` (the baseline's time per sample
over the hand-written loop's: at most 1.02 is the target: ampflow with its fast paths off costs what the hand-written
loop costs) and `defaults_speedup_vs_hand_written` (at least 1.3 on a GPU). Throughput is timed after `--warmup`
steps (compilation happens there), synchronised.
"""

import sys
import time

import torch

from bench import common

HARNESS = "fast_paths"
FAST_PATHS_OFF = ["data.loader=dataloader", "perf.channels_last=false", "optim.implementation=foreach",
                  "perf.cudnn_benchmark=false", "perf.compile=false"]
"""Every fast path off: what `baseline` (and the hand-written loop) run."""
SWITCHES = {
    "baseline": FAST_PATHS_OFF,
    "defaults": [],
    "device_loader": FAST_PATHS_OFF + ["data.loader=device"],
    "channels_last": FAST_PATHS_OFF + ["perf.channels_last=true"],
    "fused": FAST_PATHS_OFF + ["optim.implementation=fused"],
    "cudnn_benchmark": FAST_PATHS_OFF + ["perf.cudnn_benchmark=true"],
    "compile": FAST_PATHS_OFF + ["perf.compile=true"],
    "all": ["data.loader=device", "perf.channels_last=true", "optim.implementation=fused", "perf.cudnn_benchmark=true",
            "perf.compile=true"],
}
TARGETS = {"baseline_time_vs_hand_written": "<= 1.02", "defaults_speedup_vs_hand_written": ">= 1.3"}


def job(model: str, preset: str, batch: int, samples: int, overrides: list[str], compile_backend: str):
    return common.job_config({
        "model": {"name": model}, "data": {"name": "synthetic", "synthetic_samples": samples, "augment": False},
        "precision": {"preset": preset}, "scaling": {"num_workers": 1}, "run": {"batch_size": batch},
        "tracking": {"system_metrics_interval_s": 0},
    }, overrides + [f"perf.compile_backend={compile_backend}"])


def hand_written_samples_per_s(*, device: torch.device, model: str, preset: str, batch: int, samples: int,
                               warmup: int, steps: int) -> float:
    """The torch.amp loop a user writes by hand, on the same model, weights, optimizer settings and data."""
    import contextlib

    from orchestrator.precision import AmpSettings
    from orchestrator.train.data import build_datasets
    from orchestrator.train.models import build_model

    cfg = job(model, preset, batch, samples, FAST_PATHS_OFF, "inductor")
    torch.backends.cudnn.benchmark = False
    amp = AmpSettings.from_config(cfg.precision)
    torch.manual_seed(cfg.run.seed)
    net = build_model(cfg.model).to(device)
    optim = cfg.optim
    optimizer = torch.optim.SGD(net.parameters(), lr=optim.lr, momentum=optim.momentum,
                                weight_decay=optim.weight_decay, nesterov=optim.nesterov and optim.momentum > 0)
    scaler = torch.amp.GradScaler(device.type, enabled=amp.scaler_enabled)
    train, _ = build_datasets(cfg.data, cfg.model.num_classes)
    loader = torch.utils.data.DataLoader(train, batch_size=batch, shuffle=True, drop_last=True,
                                         pin_memory=device.type == "cuda")
    autocast = (lambda: torch.autocast(device.type, dtype=amp.compute_dtype)) if amp.autocast_enabled \
        else contextlib.nullcontext
    sync = common.synchronize(device)
    step, started, timed = 0, None, 0
    while True:
        for inputs, targets in loader:
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with autocast():
                loss = torch.nn.functional.cross_entropy(net(inputs), targets)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            step += 1
            if step == warmup:
                sync()
                started = time.perf_counter()
            elif step > warmup:
                timed += inputs.shape[0]
                if step == warmup + steps:
                    sync()
                    return timed / (time.perf_counter() - started)


def samples_per_s(overrides: list[str], *, device: torch.device, model: str, preset: str, batch: int,
                  samples: int, warmup: int, steps: int, compile_backend: str) -> float:
    cfg = job(model, preset, batch, samples, overrides, compile_backend)
    stepper = common.LoopStepper(cfg, device)  # the worker's loop, stepped on its own data loader
    loader, position = stepper.loop.train_loader, stepper.loop.position
    sync = common.synchronize(device)
    step, epoch, started, timed = 0, 0, None, 0
    try:
        while True:
            position.set_position(epoch, 0, batch)
            for batch in loader:
                step += 1
                stepper.step(batch.args[0], batch.targets)
                if step == warmup:
                    sync()
                    started = time.perf_counter()
                elif step > warmup:
                    timed += batch.size
                    if step == warmup + steps:
                        sync()
                        return timed / (time.perf_counter() - started)
            epoch += 1
    finally:
        stepper.close()


def main(argv=None) -> int:
    cli = common.with_device(common.parser(HARNESS, "samples/s of the worker step with each fast-path switch"))
    cli.add_argument("--model", help="default resnet18 (simple_cnn with --smoke)")
    cli.add_argument("--preset", default="O1", help="precision preset (default O1: fp16 autocast + GradScaler)")
    cli.add_argument("--batch-size", type=int, help="default 512 on cuda, 32 on cpu, 8 with --smoke")
    cli.add_argument("--steps", type=int, help="timed steps (default 50 on cuda, 10 on cpu, 3 with --smoke)")
    cli.add_argument("--warmup", type=int, help="untimed steps first (default 15 on cuda, 3 on cpu, 2 with --smoke)")
    args = cli.parse_args(argv)
    device = common.chosen_device(args)
    if device is None:
        return 2
    gpu = device.type == "cuda"
    model = args.model or ("simple_cnn" if args.smoke else "resnet18")
    batch = args.batch_size or (8 if args.smoke else 512 if gpu else 32)
    steps = args.steps or (3 if args.smoke else 50 if gpu else 10)
    warmup = args.warmup or (2 if args.smoke else 15 if gpu else 3)
    preset = "O0" if args.smoke else args.preset  # CPU half precision is emulated: the smoke run stays fp32
    backend = "inductor" if gpu else "aot_eager"  # inductor on this CPU compiles for minutes
    figures = {}
    sizes = dict(device=device, model=model, preset=preset, batch=batch, samples=batch * (steps + warmup + 1),
                 warmup=warmup, steps=steps)
    for name, overrides in SWITCHES.items():
        figures[name] = samples_per_s(overrides, compile_backend=backend, **sizes)
        print(f"{name:<16} {figures[name]:10.1f} samples/s", flush=True)
    figures["hand_written"] = hand_written_samples_per_s(**sizes)
    print(f"{'hand_written':<16} {figures['hand_written']:10.1f} samples/s", flush=True)
    ratios = {f"{name}_speedup": figures[name] / figures["baseline"] for name in SWITCHES if name != "baseline"}
    ratios["baseline_time_vs_hand_written"] = figures["hand_written"] / figures["baseline"]
    ratios["defaults_speedup_vs_hand_written"] = figures["defaults"] / figures["hand_written"]
    common.finish(HARNESS, device=common.device_description(device),
                  config={"model": model, "preset": preset, "batch_size": batch, "steps": steps, "warmup": warmup,
                          "compile_backend": backend},
                  figures={"samples_per_s": figures}, ratios=ratios, targets=TARGETS if gpu else {},
                  json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
