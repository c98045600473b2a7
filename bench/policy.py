"""Per-step cost of the per-layer precision policy machinery vs the same thing written by hand.

What is compared (one process, no Ray, the same device, weights, batches and optimizer):

- `policy`: the model the worker's training loop (`orchestrator.train.loop.TrainingLoop`) builds under
  the bf16-mixed preset plus rules that pin layers to float32 (default for resnet18: every BatchNorm
  and the classifier `fc`), stepped by the loop's own `train_step` (its hooks among it: audit, memory
  table; the schedule and the loss window).
- `plain`: the same model and weights under a hand-written `torch.autocast(dtype=bfloat16)`, with
  the same layers wrapped by hand in a module that turns autocast off and casts its input to
  float32 (what a user writes without ampflow), and `zero_grad / backward / optimizer.step()`.

Both run the same kernels in the same dtypes: under the rules, the policy keeps the pinned layers'
parameters in float32 and runs them with autocast off on float32 inputs, and leaves every other
layer to autocast, exactly like the hand-written wrapper. bf16 needs no loss scaler, so the
GuardedScaler steps without any sync. The harness checks it: both produce bitwise-equal logits on
the same weights and batch (`same_logits` in the figures). What is left in the difference is the
machinery: forward pre-hooks that cast inputs, the hooks that enter and leave the autocast-off
region, and the step's bookkeeping (GuardedScaler counters, MemoryLedger after its first step).
"""

import fnmatch
import itertools
import sys

import torch
import torch.nn.functional as F
from torch import nn

from bench import common

HARNESS = "policy"
TARGET = "<= 1.03"
DEFAULT_RULES = {"resnet18": ["BatchNorm*", "fc"], "simple_cnn": ["classifier.3"]}


class Float32(nn.Module):
    """A layer pinned to float32 by hand: autocast off inside, input cast to float32."""

    def __init__(self, inner: nn.Module, device_type: str):
        super().__init__()
        self.inner, self.device_type = inner, device_type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device_type, enabled=False):
            return self.inner(x.float())


def pin_by_hand(model: nn.Module, globs: list[str], device_type: str) -> int:
    """Wrap each module whose class name or qualified name matches a glob (outermost match only)."""
    pinned = 0
    for name, module in list(model.named_modules()):
        if name and any(fnmatch.fnmatchcase(type(module).__name__, g) or fnmatch.fnmatchcase(name, g)
                        for g in globs):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            if isinstance(parent, Float32):
                continue
            setattr(parent, child, Float32(module, device_type))
            pinned += 1
    return pinned


def main(argv=None) -> int:
    cli = common.with_device(common.parser(HARNESS, "policy (per-layer rules) step time vs hand-written autocast"))
    cli.add_argument("--model", help="registry name (default: resnet18; simple_cnn with --smoke)")
    cli.add_argument("--batch-size", type=int, help="default 16 on cpu, 256 on cuda, 8 with --smoke")
    cli.add_argument("--rules", nargs="*", help="globs pinned to float32 (default per model)")
    cli.add_argument("--repeats", type=int,
                     help="timed rounds per candidate (default 21 on cuda, 7 on cpu; 2 with --smoke)")
    cli.add_argument("--steps", type=int, help="steps per round (default 3 on cpu, 20 on cuda; 2 with --smoke)")
    cli.add_argument("--warmup", type=int, help="untimed steps per candidate (default 3; 2 with --smoke)")
    args = cli.parse_args(argv)
    device = common.chosen_device(args)
    if device is None:
        return 2
    gpu = device.type == "cuda"
    model_name = args.model or ("simple_cnn" if args.smoke else "resnet18")
    batch = args.batch_size or (8 if args.smoke else 256 if gpu else 16)
    repeats = args.repeats or (2 if args.smoke else 21 if gpu else 7)  # a GPU figure: 20 rounds or more
    steps = args.steps or (2 if args.smoke else 20 if gpu else 3)
    warmup = args.warmup or (2 if args.smoke else 3)
    globs = args.rules if args.rules is not None else DEFAULT_RULES.get(model_name, [])

    from orchestrator.train.models import build_model

    cfg = common.job_config({"model": {"name": model_name}, "data": {"name": "synthetic"},
                      "precision": {"preset": "bf16-mixed", "rules": [{"match": g, "dtype": "float32"} for g in globs]},
                      "run": {"batch_size": batch}, "tracking": {"system_metrics_interval_s": 0}})
    stepper = common.LoopStepper(cfg, device)  # the worker's loop, stepped on the batches below
    training = stepper.training

    plain_model = build_model(cfg.model)
    plain_model.load_state_dict(training.precision.fp32_state_dict())
    pinned = pin_by_hand(plain_model, globs, device.type)
    plain_model.to(device)
    o = cfg.optim
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)

    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(batch, 3, 32, 32, generator=generator).to(device),
                torch.randint(0, cfg.model.num_classes, (batch,), generator=generator).to(device)) for _ in range(4)]

    # Same computation? Same weights (the plain model was loaded from the policy model's), same batch.
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        policy_logits, plain_logits = training.prepared.model(batches[0][0]), plain_model(batches[0][0])
    same_logits = torch.equal(policy_logits, plain_logits)
    max_logit_diff = (policy_logits.float() - plain_logits.float()).abs().max().item()
    # That forward filled the policy's audit: close it as the worker does after its first step.
    training.precision.close_audit()

    policy_batches, plain_batches = itertools.cycle(batches), itertools.cycle(batches)

    def policy_step() -> None:
        stepper.step(*next(policy_batches))

    def plain_step() -> None:
        inputs, targets = next(plain_batches)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(plain_model(inputs).float(), targets)
        plain_opt.zero_grad(set_to_none=True)
        loss.backward()
        plain_opt.step()

    times = common.interleaved({"policy": policy_step, "plain": plain_step}, warmup=warmup, repeats=repeats,
                               steps=steps, sync=common.synchronize(device))
    med = {name: common.median(values) for name, values in times.items()}
    rows = [[name, batch, med[name] * 1e3, batch / med[name], f"{common.spread(values) * 100:.1f}%"]
            for name, values in times.items()]
    print(f"bench.policy on {common.device_description(device)}: {model_name}, batch {batch}, bf16-mixed, "
          f"float32 rules {globs} ({pinned} layers pinned by hand), {repeats} rounds x {steps} steps")
    common.print_table(["candidate", "batch", "ms/step", "samples/s", "spread"], rows)
    print(f"same_logits = {same_logits} (max |difference| {max_logit_diff:.3g})")
    ratio = med["policy"] / med["plain"]
    common.finish(
        HARNESS, device=common.device_description(device),
        config={"model": model_name, "batch_size": batch, "preset": "bf16-mixed", "float32_rules": globs,
                "layers_pinned": pinned, "warmup": warmup, "repeats": repeats, "steps_per_repeat": steps,
                "smoke": args.smoke},
        figures={"policy_ms_per_step": med["policy"] * 1e3, "plain_ms_per_step": med["plain"] * 1e3,
                 "policy_ms_per_step_repeats": [t * 1e3 for t in times["policy"]],
                 "plain_ms_per_step_repeats": [t * 1e3 for t in times["plain"]],
                 "same_logits": same_logits, "max_logit_diff": max_logit_diff},
        ratios={"policy_step_time": ratio}, targets={"policy_step_time": TARGET}, json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
