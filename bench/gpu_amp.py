"""What mixed precision buys on a GPU: ResNet-18 training steps in fp32, fp16 and bf16.

Candidates (CUDA only; CIFAR-shaped synthetic data kept on the GPU, 10 classes, batch 512, the
`resnet18` of orchestrator.train.models adapted to 32x32, SGD with momentum, the same initial weights):

- `fp32`: no autocast, with TF32 OFF (`torch.backends.cuda.matmul.allow_tf32 = False`,
  `torch.backends.cudnn.allow_tf32 = False`), so the baseline is true fp32 arithmetic;
- `fp32_tf32`: the same with TF32 ON (both flags True, what many training scripts set): the second baseline,
  throughput only (TF32 changes the arithmetic, not the memory);
- `fp16`: `torch.autocast(dtype=float16)` + `torch.amp.GradScaler`;
- `bf16`: `torch.autocast(dtype=bfloat16)`, no scaler (bf16 has fp32's exponent range);

each with channels_last off (NCHW) and on. cudnn.benchmark is on for all of them (fixed shapes).

Throughput: interleaved rounds of every candidate, CUDA-synchronised wall clock, warm-up steps
(cudnn autotuning included) excluded, median over rounds. Peak memory: measured apart, one
candidate at a time, `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, over
building the model and optimizer and a few steps, minus what was allocated before (the shared
data): model, gradients, optimizer state, activations and workspace of that candidate alone.

Ratios, per channels_last setting (suffix `_nchw` or `_channels_last`): `fp16_speedup`,
`bf16_speedup` (samples/s vs fp32 of the same layout; target >= 2.5) and `fp16_peak_memory`,
`bf16_peak_memory` (peak bytes vs fp32 of the same layout; target <= 0.6); and against the TF32 baseline
`fp16_speedup_vs_tf32`, `bf16_speedup_vs_tf32` (no target: they say how much of the gain TF32 alone gives).
Each candidate sets the TF32 flags at every step (cuDNN keys its algorithm choice by them), so they interleave.

Imports only torch, torchvision (through orchestrator.train.models), the standard library and
bench.common, so it runs where Ray and MLflow are not installed. Without CUDA it prints
`skipped: no CUDA device` and exits 0.
"""

import contextlib
import gc
import sys

import torch
import torch.nn.functional as F

from bench import common

HARNESS = "gpu_amp"
SPEEDUP_TARGET, MEMORY_TARGET = ">= 2.5", "<= 0.6"
DTYPES = {"fp32": None, "fp32_tf32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class Candidate:
    """One (dtype, layout) set-up: its own model and optimizer, stepping on the shared batches."""

    def __init__(self, dtype_name: str, channels_last: bool, weights: dict, batches: list, device: torch.device):
        from orchestrator.train.models import resnet18

        self.dtype = DTYPES[dtype_name]
        self.tf32 = dtype_name == "fp32_tf32"
        self.format = torch.channels_last if channels_last else torch.contiguous_format
        self.model = resnet18(num_classes=10)
        self.model.load_state_dict(weights)
        self.model.to(device, memory_format=self.format)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.dtype == torch.float16)
        self.batches = [(x.contiguous(memory_format=self.format), y) for x, y in batches]
        self.index = 0

    def step(self) -> None:
        inputs, targets = self.batches[self.index % len(self.batches)]
        self.index += 1
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = self.tf32
        context = torch.autocast("cuda", dtype=self.dtype) if self.dtype is not None else contextlib.nullcontext()
        with context:
            loss = F.cross_entropy(self.model(inputs).float(), targets)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()


def name_of(dtype_name: str, channels_last: bool) -> str:
    return f"{dtype_name}_{'channels_last' if channels_last else 'nchw'}"


def main(argv=None) -> int:
    cli = common.parser(HARNESS, "ResNet-18 train steps on CUDA: fp32 (TF32 off, and on) vs fp16+GradScaler vs "
                                 "bf16, channels_last off/on: throughput and peak memory")
    cli.add_argument("--batch-size", type=int, help="default 512; 64 with --smoke")
    cli.add_argument("--repeats", type=int, help="timed rounds per candidate (default 7; 2 with --smoke)")
    cli.add_argument("--steps", type=int, help="steps per round (default 20; 3 with --smoke)")
    cli.add_argument("--warmup", type=int, help="untimed steps per candidate (default 15; 3 with --smoke)")
    args = cli.parse_args(argv)
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        if args.json:
            common.write_json(args.json, {"harness": HARNESS, "skipped": "no CUDA device", "torch": torch.__version__,
                                          "command": common.command_line(HARNESS)})
        return 0
    batch = args.batch_size or (64 if args.smoke else 512)
    repeats = args.repeats or (2 if args.smoke else 7)
    steps = args.steps or (3 if args.smoke else 20)
    warmup = args.warmup or (3 if args.smoke else 15)
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True

    from orchestrator.train.models import resnet18

    torch.manual_seed(0)
    weights = resnet18(num_classes=10).state_dict()
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(batch, 3, 32, 32, generator=generator).to(device),
                torch.randint(0, 10, (batch,), generator=generator).to(device)) for _ in range(4)]
    setups = [(d, cl) for cl in (False, True) for d in DTYPES]

    # Peak memory, one candidate alive at a time.
    peak = {}
    for dtype_name, channels_last in setups:
        if dtype_name == "fp32_tf32":
            continue
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        candidate = Candidate(dtype_name, channels_last, weights, batches, device)
        for _ in range(3):
            candidate.step()
        torch.cuda.synchronize()
        peak[name_of(dtype_name, channels_last)] = torch.cuda.max_memory_allocated(device) - before
        del candidate

    # Throughput, interleaved.
    gc.collect()
    torch.cuda.empty_cache()
    candidates = {name_of(d, cl): Candidate(d, cl, weights, batches, device) for d, cl in setups}
    times = common.interleaved({name: c.step for name, c in candidates.items()}, warmup=warmup, repeats=repeats,
                               steps=steps, sync=common.synchronize(device))
    throughput = {name: batch / common.median(values) for name, values in times.items()}

    print(f"bench.gpu_amp on {common.device_description(device)}: resnet18 (32x32), batch {batch}, TF32 off but for "
          f"fp32_tf32, {repeats} rounds x {steps} steps after {warmup} warm-up steps each")
    common.print_table(["candidate", "samples/s", "ms/step", "spread", "peak MiB"],
                       [[name, throughput[name], common.median(times[name]) * 1e3,
                         f"{common.spread(times[name]) * 100:.1f}%", peak[name] / 2**20 if name in peak else "-"]
                        for name in candidates])
    ratios, targets = {}, {}
    for layout in ("nchw", "channels_last"):
        for dtype_name in ("fp16", "bf16"):
            speedup, memory = f"{dtype_name}_speedup_{layout}", f"{dtype_name}_peak_memory_{layout}"
            ratios[speedup] = throughput[f"{dtype_name}_{layout}"] / throughput[f"fp32_{layout}"]
            ratios[memory] = peak[f"{dtype_name}_{layout}"] / peak[f"fp32_{layout}"]
            targets[speedup], targets[memory] = SPEEDUP_TARGET, MEMORY_TARGET
            ratios[f"{dtype_name}_speedup_vs_tf32_{layout}"] = (throughput[f"{dtype_name}_{layout}"]
                                                                / throughput[f"fp32_tf32_{layout}"])
    common.finish(
        HARNESS, device=common.device_description(device),
        config={"model": "resnet18 (32x32)", "batch_size": batch, "tf32": "off, on for fp32_tf32",
                "cudnn_benchmark": True,
                "warmup": warmup, "repeats": repeats, "steps_per_repeat": steps, "smoke": args.smoke},
        figures={"samples_per_s": throughput, "peak_bytes": peak,
                 "ms_per_step_repeats": {name: [t * 1e3 for t in values] for name, values in times.items()}},
        ratios=ratios, targets=targets, json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
