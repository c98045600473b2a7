"""Activation checkpointing by rule, measured: peak activation memory and the loss curve of the same job under FSDP2
without a checkpoint rule, with `{match: "blocks.*", checkpoint: full}` and with `checkpoint: selective`, as ratios
of one run (the target is full's: at most 0.5x; selective's is shown beside it).

The runs train the LM job (jobs/lm.yaml: the built-in `transformer_lm` decoder, `--layers` pre-norm blocks, each an
FSDP unit, on the lm_text data) from the same seed, on `--world-size` gloo ranks on the CPU through the Ray-free loop
(`orchestrator.train.local.spawn`, the worker's own loop). The activations are the memory ledger's
(`memory/activations_*_bytes` of rank 0: every tensor autograd saved for backward in one real forward pass, each
storage once); the loss curve is rank 0's `train/loss` at every step. Checkpointing recomputes each block's forward
in backward with the same kernels on the same inputs, so the curves agree to floating-point reordering (on the CPU,
exactly). Bytes do not depend on the machine's speed: one run says it.
"""

import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

from bench import common

REPO = Path(__file__).resolve().parents[1]

HARNESS = "rule_checkpoint"
TARGET = "<= 0.5"
LOSS_TOLERANCE = 1e-5
"""Largest relative difference of a step's loss allowed between the two runs (floating-point reordering)."""


def lm_job(rules: list, layers: int, steps: int, world_size: int, data_root: str) -> dict:
    """The LM job (jobs/lm.yaml: `transformer_lm` on the lm_text data) under FSDP2, each block a unit, with `rules`."""
    import yaml

    job = yaml.safe_load((REPO / "jobs" / "lm.yaml").read_text())
    job["model"]["kwargs"]["n_layer"] = layers
    job["data"]["root"] = data_root
    job["precision"] = {"preset": "O0", "rules": rules}
    job["scaling"] = {"num_workers": world_size, "strategy": "fsdp", "fsdp": {"wrap": ["Block"]}}
    job["run"] = {"epochs": 1, "batch_size": 16, "seed": 0, "max_steps_per_epoch": steps}
    job["tracking"] = {"log_every_n_steps": 1, "log_model": False}
    return job


def trained(rules: list, layers: int, steps: int, world_size: int, data_root: Optional[str] = None) -> dict:
    """Rank 0's loss at each step and its activation bytes (by dtype) for one run of the LM job (`data_root`: where
    its data and tokenizer are kept, shared by the runs; a temporary directory of its own when None)."""
    from omegaconf import OmegaConf

    from orchestrator.train.local import spawn

    with tempfile.TemporaryDirectory() as directory:
        cfg = common.job_config(lm_job(rules, layers, steps, world_size, data_root or str(Path(directory) / "data")))
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

    with tempfile.TemporaryDirectory() as data_root:  # the data and its tokenizer made once for the three runs
        plain, full, selective = (trained(rules, layers, steps, args.world_size, data_root) for rules in (
            [], [{"match": "blocks.*", "checkpoint": "full"}], [{"match": "blocks.*", "checkpoint": "selective"}]))
    plain_bytes, full_bytes, selective_bytes = (sum(run["activation_bytes"].values())
                                                for run in (plain, full, selective))
    loss_gap = max(abs(a - b) / max(abs(a), 1e-12) for run in (full, selective)
                   for a, b in zip(plain["losses"], run["losses"]))
    same_curve = all(len(run["losses"]) == steps for run in (plain, full, selective)) and loss_gap <= LOSS_TOLERANCE

    print(f"bench.rule_checkpoint: the LM job's transformer_lm ({layers} blocks), {args.world_size} gloo ranks on the "
          "CPU under FSDP2, "
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
