"""`python -m orchestrator.summary MODEL --input 3,64,64 [--precision O3] [--optimizer adam] [--json]
[--strategy fsdp --world-size N]`

A model summary that tells the truth about dtypes: the policy is applied to the model, one real
training step runs (forward, backward, optimizer step; loss scaling off so the optimizer always
steps), and every number is measured on the live tensors: parameters as stored, gradients,
optimizer state, fp32 masters and the activations autograd saved for backward.

With `--strategy fsdp --world-size N` the parameters, gradients and optimizer state are what rank 0
of N will hold of them under FSDP (`predict_rank_bytes`: its shards in their storage dtype, exact on
two ranks as bench.fsdp_memory measures; no separate masters: the fp32 shards are the masters), and
the activations are the measured ones (per rank, at this batch size).
"""

import argparse
import json
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional, Sequence

import torch
from torch import nn

from orchestrator.cli.program import prog
from orchestrator.config.loader import load_precision
from orchestrator.config.schema import OptimSection
from orchestrator.errors import BadInput, command_exit
from orchestrator.precision.ledger import CATEGORIES, MemoryLedger
from orchestrator.tracking.secrets import install_console_redaction
from orchestrator.train.models import build_model
from orchestrator.train.optim import build_optimizer
from orchestrator.precision import MasterWeights, Policy, apply, autocast_context, dtype_name, plan

OPTIMIZERS = ("sgd", "adam", "adamw")
STRATEGIES = ("ddp", "fsdp")


@dataclass
class _ModelSpec:
    name: str
    num_classes: Optional[int]
    kwargs: dict


def parse_input(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(size < 1 for size in shape):
        raise BadInput(f"--input: '{text}' is not a shape like 3,64,64 (channels,height,width; no batch).")
    return shape


def summarize(model_name: str, input_shape: Sequence[int], *, preset: str = "O0", optimizer: str = "sgd",
              batch_size: int = 1, num_classes: Optional[int] = None, activations: bool = True,
              device: Optional[torch.device] = None, strategy: str = "ddp", world_size: int = 1,
              wrap: Sequence[str] = ()) -> dict[str, Any]:
    """The summary as the `--json` object (per rank under `strategy` over `world_size` ranks)."""
    if strategy not in STRATEGIES:
        raise BadInput(f"--strategy: '{strategy}' is not one of {', '.join(STRATEGIES)}.")
    if world_size < 1:
        raise BadInput(f"--world-size: must be >= 1, got {world_size}.")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision_cfg = load_precision(preset)
    policy = Policy.from_config(precision_cfg)
    amp = policy.amp
    model = build_model(_ModelSpec(model_name, num_classes, {})).to(device)
    plans = plan(model, policy)
    masters = MasterWeights(model, plans) if policy.master_weights else None
    apply(model, policy, plans, device.type)
    params = masters.optimizer_params(model) if masters else model.parameters()
    opt = build_optimizer(OptimSection(name=optimizer, lr=1e-3), params)
    ledger = MemoryLedger(model)

    shapes: dict[str, list[int]] = {}
    hooks = [module.register_forward_hook(partial(_record_shape, shapes=shapes, name=name))
             for name, module in model.named_modules()]
    if activations:
        with autocast_context(amp, device.type), ledger.probe.recording():
            output = model(torch.randn(batch_size, *input_shape, device=device))
        output.float().sum().backward()
    else:  # no forward pass: real zero gradients, so the optimizer still allocates its real state
        for param in model.parameters():
            param.grad = torch.zeros_like(param)
        ledger.bytes["activations"] = ledger.bytes["weight_casts"] = {}
    for hook in hooks:
        hook.remove()
    ledger.record_backward()
    if masters:
        masters.grads_to_masters()
    opt.step()
    if masters:
        masters.masters_to_params()
    ledger.record_state(opt, masters)

    layers = []
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not own and (name == "" or any(True for _ in module.children())):
            continue  # containers without parameters of their own
        layers.append({
            "name": name, "type": type(module).__name__, "output_shape": shapes.get(name),
            "params": sum(p.numel() for p in own),
            "param_dtype": dtype_name(own[0].dtype) if own else None,
            "bytes": sum(p.numel() * p.element_size() for p in own),
        })
    summary = {
        "model": model_name, "input": list(input_shape), "batch_size": batch_size,
        "precision": precision_cfg.preset, "optimizer": optimizer, "activations_measured": activations,
        "strategy": strategy, "world_size": world_size,
        "total_params": sum(p.numel() for p in model.parameters()),
        "bytes": {category: dict(sorted(ledger.bytes.get(category, {}).items())) for category in CATEGORIES},
        "layers": layers,
    }
    if strategy == "fsdp":
        summary.update(_fsdp_rank0(model, policy, plans, opt, masters, world_size, wrap, device))
        summary["bytes"].update({category: dict(sorted(per_dtype.items()))
                                 for category, per_dtype in summary.pop("predicted").items()})
        summary["bytes"]["master"] = {}  # the fp32 shards are the masters
    return summary


def _fsdp_rank0(model: nn.Module, policy: Policy, plans: dict, opt: torch.optim.Optimizer,
                masters: Optional[MasterWeights], world_size: int, wrap: Sequence[str], device: torch.device
                ) -> dict[str, Any]:
    """What rank 0 of `world_size` holds under FSDP (the most of any rank), its units and the gathered peak."""
    # torch.distributed.fsdp: over a second to import, for --strategy fsdp only
    from orchestrator.precision.fsdp import FsdpSettings, plan_units
    from orchestrator.train.fsdp_memory import gathered_bytes, predict_rank_bytes

    fsdp_plan = plan_units(model, policy, plans, FsdpSettings(wrap=tuple(wrap)), device.type)
    stepped = masters.optimizer_params(model) if masters else model.parameters()
    states = {name: sum(1 for value in opt.state[tensor].values() if torch.is_tensor(value) and value.dim() > 0)
              for (name, _), tensor in zip(model.named_parameters(), stepped)}
    return {
        "predicted": predict_rank_bytes(model, fsdp_plan, world_size, rank=0, optimizer_states=states),
        "gathered_bytes": gathered_bytes(model, fsdp_plan),
        "units": [{"name": unit.label, "reason": unit.reason, "compute_dtype": dtype_name(unit.compute_dtype),
                   "storage_dtype": dtype_name(unit.storage_dtype), "params": len(unit.params)}
                  for unit in fsdp_plan.units],
    }


def _record_shape(module: nn.Module, args: tuple, output: Any, *, shapes: dict, name: str) -> None:
    if name not in shapes and isinstance(output, torch.Tensor):
        shapes[name] = list(output.shape)


def _mib(size: int) -> str:
    return f"{size / 2**20:.2f}"


def render(summary: dict[str, Any]) -> str:
    """Human output in the spirit of torchsummary, with dtypes and every category measured."""
    rule = "-" * 96
    lines = [rule, f"{'Layer (type)':<36}{'Output Shape':<22}{'Param #':>12}{'dtype':>10}{'Bytes':>16}", "=" * 96]
    for layer in summary["layers"]:
        shape = str([-1, *layer["output_shape"][1:]]) if layer["output_shape"] else "-"
        lines.append(f"{layer['name'] + ' (' + layer['type'] + ')':<36}{shape:<22}{layer['params']:>12,}"
                     f"{layer['param_dtype'] or '-':>10}{layer['bytes']:>16,}")
    bytes_ = summary["bytes"]
    params_bytes = sum(bytes_["params"].values())
    lines += ["=" * 96, f"Total params: {summary['total_params']:,}",
              f"Precision: {summary['precision']}    optimizer: {summary['optimizer']}    "
              f"input: {'x'.join(map(str, summary['input']))}    batch: {summary['batch_size']}", rule]
    for category in CATEGORIES:
        per_dtype = bytes_[category]
        if category in ("activations", "weight_casts") and not summary["activations_measured"]:
            detail = "not measured (--no-activations)"
        else:
            detail = ", ".join(f"{dtype} {size:,} B" for dtype, size in per_dtype.items()) or "none"
        lines.append(f"{category:<13}{_mib(sum(per_dtype.values())):>10} MiB   {detail}")
    total = sum(sum(per_dtype.values()) for per_dtype in bytes_.values())
    lines += [rule, f"Params size (MB): {_mib(params_bytes)}",
              f"Estimated Total Size (MB): {_mib(total)}  (every category above)", rule]
    if summary.get("strategy") == "fsdp":
        lines += [f"FSDP over {summary['world_size']} ranks: params, grads and optimizer are rank 0's shards "
                  "(the fp32 shards are the masters); activations per rank.",
                  f"Gathered while a unit computes (the root's and the largest other unit's): "
                  f"{_mib(summary['gathered_bytes'])} MiB on top.",
                  *(f"  unit {u['name']:<30} {u['compute_dtype']:>9} computed, {u['storage_dtype']:>9} stored, "
                    f"{u['params']} parameters ({u['reason']})" for u in summary["units"]), rule]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    install_console_redaction()  # a user model's own lines and errors may carry a token from the environment
    parser = argparse.ArgumentParser(prog=prog("summary"),
                                     description="A precision-aware model summary: real bytes by dtype.")
    parser.add_argument("model", help="registry name (simple_cnn, resnet18, three_conv) or package.module:Name")
    parser.add_argument("--input", default="3,32,32", help="input shape without the batch, e.g. 3,64,64")
    parser.add_argument("--precision", default="O0", help="a preset: O0, O1, O2, O3, bf16-mixed, bf16-true, 16-mixed...")
    parser.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS, help="whose state to measure (default sgd)")
    parser.add_argument("--batch-size", type=int, default=1, help="batch of the measured step (activations scale with it)")
    parser.add_argument("--num-classes", type=int, default=None, help="passed to the model (default: the model's own)")
    parser.add_argument("--no-activations", action="store_true",
                        help="skip the forward/backward pass (fast; activations are not measured)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--strategy", default="ddp", choices=STRATEGIES,
                        help="ddp: every rank holds everything; fsdp: rank 0's shards of params, grads, optimizer")
    parser.add_argument("--world-size", type=int, default=1, help="ranks the model is sharded over (--strategy fsdp)")
    parser.add_argument("--wrap", nargs="*", default=[], metavar="GLOB",
                        help="FSDP units, as scaling.fsdp.wrap (default: each direct child holding parameters)")
    args = parser.parse_args(argv)
    try:
        if args.batch_size < 1:
            raise BadInput(f"--batch-size: must be >= 1, got {args.batch_size}.")
        summary = summarize(args.model, parse_input(args.input), preset=args.precision, optimizer=args.optimizer,
                            batch_size=args.batch_size, num_classes=args.num_classes,
                            activations=not args.no_activations, strategy=args.strategy,
                            world_size=args.world_size, wrap=args.wrap)
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary) if args.json else render(summary))
    return 0


if __name__ == "__main__":
    command_exit(main())
