"""Activation checkpointing by rule, measured: peak activation memory and the loss curve of the same job under FSDP2
without a checkpoint rule, with `{match: "blocks.*", checkpoint: full}` and with `checkpoint: selective`, as ratios
of one run (the target is full's: at most 0.5x; selective's is shown beside it).

Both jobs train the same small causal decoder (`bench.decoder_lm`: `--layers` pre-norm blocks, each an FSDP unit)
on the same token sequences from the same seed, on `--world-size` gloo ranks on the CPU through the Ray-free loop
(`orchestrator.train.local.spawn`, the worker's own loop). The activations are the memory ledger's
(`memory/activations_*_bytes` of rank 0: every tensor autograd saved for backward in one real forward pass, each
storage once); the loss curve is rank 0's `train/loss` at every step. Checkpointing recomputes each block's forward
in backward with the same kernels on the same inputs, so the curves agree to floating-point reordering (on the CPU,
exactly). Bytes do not depend on the machine's speed: one run says it.
"""

import sys
import tempfile
from pathlib import Path

import torch

from bench import common

HARNESS = "rule_checkpoint"
TARGET = "<= 0.5"
LOSS_TOLERANCE = 1e-5
"""Largest relative difference of a step's loss allowed between the two runs (floating-point reordering)."""


def decoder_job(rules: list, layers: int, steps: int, world_size: int) -> dict:
    return {"model": {"name": "bench.decoder_lm:TinyDecoder", "num_classes": 64, "kwargs": {"layers": layers}},
            "data": {"name": "bench.decoder_lm:make_datasets"},
            "task": {"inputs": ["input_ids"], "target": "labels", "loss": "model", "output": "logits",
                     "metrics": ["token_accuracy"]},
            "optim": {"name": "adamw", "lr": 0.003},
            "scaling": {"num_workers": world_size, "strategy": "fsdp", "fsdp": {"wrap": ["Block"]}},
            "precision": {"rules": rules},
            "run": {"epochs": 1, "batch_size": 16, "max_steps_per_epoch": steps},
            "tracking": {"log_every_n_steps": 1, "log_model": False}}


def trained(rules: list, layers: int, steps: int, world_size: int) -> dict:
    """Rank 0's loss at each step and its activation bytes (by dtype) for one run of the decoder job."""
    from omegaconf import OmegaConf

    from orchestrator.train.local import spawn

    cfg = common.job_config(decoder_job(rules, layers, steps, world_size))
    with tempfile.TemporaryDirectory() as directory:
        outcome = spawn(OmegaConf.to_container(cfg, resolve=True), world_size=world_size, directory=Path(directory))
    reports = outcome["reports"]
    activations = {key.removeprefix("memory/activations_").removesuffix("_bytes"): int(value)
                   for report in reports for key, value in report.metrics.items()
                   if key.startswith("memory/activations_")}
    audit = next((report.tables["precision/audit"] for report in reports if "precision/audit" in report.tables), [])
    return {"losses": [report.metrics["train/loss"] for report in reports if "train/loss" in report.metrics],
            "activation_bytes": activations,
            "checkpointed": sorted(entry["name"] for entry in audit if entry.get("checkpoint"))}


def main(argv=None) -> int:
    cli = common.parser(HARNESS, "peak activation memory and loss curve under FSDP2: checkpoint full, selective, none")
    cli.add_argument("--layers", type=int, default=None, help="decoder blocks (default 4; 2 with --smoke)")
    cli.add_argument("--steps", type=int, default=None, help="optimizer steps (default 8; 2 with --smoke)")
    cli.add_argument("--world-size", type=int, default=2, help="ranks (gloo, CPU; default 2)")
    args = cli.parse_args(argv)
    layers = args.layers or (2 if args.smoke else 4)
    steps = args.steps or (2 if args.smoke else 8)

    plain = trained([], layers, steps, args.world_size)
    full = trained([{"match": "blocks.*", "checkpoint": "full"}], layers, steps, args.world_size)
    selective = trained([{"match": "blocks.*", "checkpoint": "selective"}], layers, steps, args.world_size)
    plain_bytes, full_bytes, selective_bytes = (sum(run["activation_bytes"].values())
                                                for run in (plain, full, selective))
    loss_gap = max(abs(a - b) / max(abs(a), 1e-12) for run in (full, selective)
                   for a, b in zip(plain["losses"], run["losses"]))
    same_curve = all(len(run["losses"]) == steps for run in (plain, full, selective)) and loss_gap <= LOSS_TOLERANCE

    print(f"bench.rule_checkpoint: TinyDecoder ({layers} blocks), {args.world_size} gloo ranks on the CPU under FSDP2, "
          f"{steps} steps; rank 0's activations (memory ledger) and train/loss")
    common.print_table(["run", "activation MiB", "losses"], [
        ["no checkpointing", f"{plain_bytes / 2**20:.3f}", " ".join(f"{v:.5f}" for v in plain["losses"])],
        ["checkpoint: full", f"{full_bytes / 2**20:.3f}", " ".join(f"{v:.5f}" for v in full["losses"])],
        ["checkpoint: selective", f"{selective_bytes / 2**20:.3f}",
         " ".join(f"{v:.5f}" for v in selective["losses"])]])
    print(f"largest relative loss difference: {loss_gap:.2e} (tolerance {LOSS_TOLERANCE:g}); same curve: {same_curve}")
    common.finish(HARNESS, device=common.device_description(torch.device("cpu")),
                  config={"layers": layers, "steps": steps, "world_size": args.world_size, "smoke": args.smoke},
                  figures={"plain": plain, "checkpoint_full": full, "checkpoint_selective": selective,
                           "max_relative_loss_difference": loss_gap, "same_loss_curve": same_curve},
                  ratios={"activation_bytes": full_bytes / plain_bytes,
                          "selective_activation_bytes": selective_bytes / plain_bytes},
                  targets={"activation_bytes": TARGET},
                  json_path=args.json)
    return 0 if same_curve else 1


if __name__ == "__main__":
    sys.exit(main())
