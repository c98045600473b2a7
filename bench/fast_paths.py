"""What each fast-path switch buys: samples/s of the worker's own step with one switch on at a time.

One process, no Ray, no DDP (the DDP knobs and the comm hook need several GPUs). Every candidate
is a fresh training loop (`orchestrator.train.loop.TrainingLoop`) from the same seed under the same
preset, fed by the loader its config asks for, stepped by the loop's own `train_step` (its hooks, the
audit and compile after the first step included). Candidates:

- `baseline`: `data.loader: dataloader` (a DataLoader over host tensors, pinned memory), NCHW, eager,
  the optimizer's default kernels.
- `device_loader`: `data.loader: device` (the data on the device, batches sliced there).
- `channels_last`, `fused`, `compile`: one switch each on top of the baseline.
- `all`: every switch together.

Throughput is timed after `--warmup` steps (compilation happens there), synchronised.
"""

import sys
import time

import torch

from bench import common

HARNESS = "fast_paths"
SWITCHES = {
    "baseline": [],
    "device_loader": ["data.loader=device"],
    "channels_last": ["perf.channels_last=true"],
    "fused": ["optim.implementation=fused"],
    "compile": ["perf.compile=true"],
    "all": ["data.loader=device", "perf.channels_last=true", "optim.implementation=fused", "perf.compile=true"],
}


def samples_per_s(overrides: list[str], *, device: torch.device, model: str, preset: str, batch: int,
                  samples: int, warmup: int, steps: int, compile_backend: str) -> float:
    cfg = common.job_config({
        "model": {"name": model}, "data": {"name": "synthetic", "synthetic_samples": samples, "augment": False},
        "precision": {"preset": preset}, "scaling": {"num_workers": 1}, "run": {"batch_size": batch},
        "tracking": {"system_metrics_interval_s": 0},
    }, overrides + [f"perf.compile_backend={compile_backend}"])
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
    for name, overrides in SWITCHES.items():
        figures[name] = samples_per_s(overrides, device=device, model=model, preset=preset, batch=batch,
                                      samples=batch * (steps + warmup + 1), warmup=warmup, steps=steps,
                                      compile_backend=backend)
        print(f"{name:<14} {figures[name]:10.1f} samples/s", flush=True)
    ratios = {f"{name}_speedup": figures[name] / figures["baseline"] for name in SWITCHES if name != "baseline"}
    common.finish(HARNESS, device=common.device_description(device),
                  config={"model": model, "preset": preset, "batch_size": batch, "steps": steps, "warmup": warmup,
                          "compile_backend": backend},
                  figures={"samples_per_s": figures}, ratios=ratios, targets={}, json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
