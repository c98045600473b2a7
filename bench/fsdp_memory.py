"""Memory per rank under FSDP vs DDP: parameters + gradients + optimizer state (+ fp32 masters), measured.

For each preset, two ranks (torch.multiprocessing, gloo, CPU) build the same model and take one training step
twice, each time as the worker does (`build_training` + `train_step`, the product's own step): under DDP (every
rank holds the whole model, its gradients, its optimizer state and, under O2, the fp32 masters) and under FSDP
(`scaling.strategy: fsdp`: each rank holds its shards; under O2 the fp32 shards are the masters). The loss scale
starts at 128 so that the first fp16 step is taken (a skipped one would leave Adam's state unmade). Each rank's bytes are read on its live tensors (the
memory ledger's categories); rank 0 holds the most under FSDP (it gets the larger half of each odd first
dimension). The ratio is FSDP's bytes over DDP's on rank 0; with two ranks it is about 0.5 when nothing
but sharding changes (O0), lower where FSDP drops a copy (O2: no fp16 parameters beside the fp32 masters).
The figures also say whether `predict_rank_bytes` (what `orchestrator.summary --strategy fsdp` prints)
matched the measurement exactly. No timing: bytes are the same on any machine.
"""

import sys
import tempfile
from pathlib import Path

import torch

from bench import common

HARNESS = "fsdp_memory"
TARGET = "<= 0.55"
CATEGORIES = ("params", "grads", "optimizer", "master")


def _bytes(measured: dict) -> int:
    return sum(sum(measured.get(category, {}).values()) for category in CATEGORIES)


def rank_main(rank: int, world_size: int, job: dict, directory: str) -> None:
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from orchestrator.train.fsdp_memory import predict_rank_bytes
    from orchestrator.train.local import exit_rank
    from orchestrator.precision.ledger import bytes_by_dtype, optimizer_state_tensors
    from orchestrator.train.step import train_step
    from orchestrator.train.training import build_training

    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=world_size)
    cfg = OmegaConf.create(job)
    cpu = torch.device("cpu")
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randn(cfg.run.batch_size, 3, 32, 32, generator=generator)
    targets = torch.randint(0, cfg.model.num_classes, (cfg.run.batch_size,), generator=generator)

    torch.manual_seed(0)
    as_ddp = OmegaConf.merge(cfg, {"scaling": {"strategy": "ddp"}})  # the job says fsdp: the baseline is DDP
    training = build_training(as_ddp, cpu, rank=rank, world_size=world_size, total_steps=1)
    train_step(training, inputs, targets, cpu, 1)
    model, masters = training.prepared.raw, training.precision.masters
    pairs = masters.pairs if masters else []
    ddp = {"params": bytes_by_dtype(model.parameters()), "grads": bytes_by_dtype(p.grad for p in model.parameters()),
           "optimizer": bytes_by_dtype(optimizer_state_tensors(training.optimizer)),
           "master": bytes_by_dtype([m for _, m in pairs] + [m.grad for _, m in pairs])}
    del training, model, masters, pairs

    torch.manual_seed(0)
    training = build_training(cfg, cpu, rank=rank, world_size=world_size, total_steps=1)  # the job's fsdp
    _, outcome = train_step(training, inputs, targets, cpu, 1)
    if not outcome.stepped:
        raise RuntimeError("the FSDP step was skipped (a non-finite gradient): its optimizer state is not made")
    strategy, sharded, optimizer = training.strategy, training.prepared.raw, training.optimizer
    fsdp = strategy.memory(optimizer)
    states = 2 if cfg.optim.name in ("adam", "adamw") else int(cfg.optim.momentum > 0)
    predicted = predict_rank_bytes(sharded, strategy.plan, world_size, rank=rank, optimizer_states=states)
    torch.save({"ddp": ddp, "fsdp": fsdp, "predicted": predicted}, f"{directory}/rank{rank}.pt")
    dist.destroy_process_group()
    exit_rank()


def measure(job: dict, world_size: int) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(rank_main, args=(world_size, job, directory), nprocs=world_size, join=True)
        return [torch.load(Path(directory) / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def main(argv=None) -> int:
    cli = common.parser(HARNESS, "parameters + gradients + optimizer state per rank: FSDP vs DDP, measured")
    cli.add_argument("--model", help="registry name (default: resnet18; simple_cnn with --smoke)")
    cli.add_argument("--presets", nargs="*", default=["O0", "O2"], help="precision presets (default O0 O2)")
    cli.add_argument("--optimizer", default="adam", choices=("sgd", "adam", "adamw"))
    cli.add_argument("--world-size", type=int, default=2, help="ranks (gloo, CPU; default 2)")
    args = cli.parse_args(argv)
    model = args.model or ("simple_cnn" if args.smoke else "resnet18")
    presets = ["O0"] if args.smoke else args.presets

    figures, ratios, targets, rows = {}, {}, {}, []
    for preset in presets:
        cfg = common.job_config({"model": {"name": model}, "data": {"name": "synthetic"},
                                 "precision": {"preset": preset, "init_scale": 128.0},
                                 "optim": {"name": args.optimizer},
                                 "run": {"batch_size": 2}, "scaling": {"strategy": "fsdp"}})
        from omegaconf import OmegaConf

        ranks = measure(OmegaConf.to_container(cfg, resolve=True), args.world_size)
        ddp, fsdp = _bytes(ranks[0]["ddp"]), max(_bytes(rank["fsdp"]) for rank in ranks)
        exact = all(rank["fsdp"] == rank["predicted"] for rank in ranks)
        figures[preset] = {"ddp_rank_bytes": [rank["ddp"] for rank in ranks],
                           "fsdp_rank_bytes": [rank["fsdp"] for rank in ranks],
                           "predicted_rank_bytes": [rank["predicted"] for rank in ranks],
                           "prediction_exact": exact}
        ratios[f"{preset}_state_bytes"] = fsdp / ddp
        targets[f"{preset}_state_bytes"] = TARGET
        rows.append([preset, f"{ddp / 2**20:.2f}", f"{fsdp / 2**20:.2f}", fsdp / ddp, exact])
    print(f"bench.fsdp_memory: {model}, {args.optimizer}, {args.world_size} gloo ranks on the CPU; MiB per rank of "
          "params + grads + optimizer state + fp32 masters (the largest rank)")
    common.print_table(["preset", "DDP MiB", "FSDP MiB", "FSDP/DDP", "prediction exact"], rows)
    common.finish(HARNESS, device=common.device_description(torch.device("cpu")),
                  config={"model": model, "presets": presets, "optimizer": args.optimizer,
                          "world_size": args.world_size, "smoke": args.smoke},
                  figures=figures, ratios=ratios, targets=targets, json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
