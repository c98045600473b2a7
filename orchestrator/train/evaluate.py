"""Evaluation over the whole eval set, every rank scoring its shard."""

import torch

from orchestrator.train.collectives import all_reduce
from orchestrator.train.modes import eval_mode
from orchestrator.train.training import Training


@torch.no_grad()
def evaluate(training: Training, loader, device: torch.device) -> dict[str, float]:
    """`eval/loss` and every `task.metrics` over the whole eval set: each rank scores its shard, then the sums
    are reduced over all ranks (one all-reduce), so the figures are the whole set's, not rank 0's."""
    prepared, precision = training.prepared, training.precision
    model = prepared.model
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    sums: dict[str, list] = {}  # name -> [sum, count]
    count = 0
    with eval_mode(model):  # afterwards every module is back in its own mode (a frozen BatchNorm stays frozen)
        for inputs, targets in loader:
            inputs, targets = prepared.inputs(inputs, device), targets.to(device, non_blocking=True)
            with precision.forward():
                outputs = model(inputs)
            loss_sum += training.loss(outputs, targets).double() * targets.shape[0]
            count += targets.shape[0]
            for metric in training.metrics:
                for name, (total, items) in metric(outputs.float(), targets).items():
                    entry = sums.setdefault(name, [0.0, 0.0])
                    entry[0], entry[1] = entry[0] + total, entry[1] + items
    names = sorted(sums)
    local = [loss_sum.item(), float(count)] + [float(sums[n][i]) for n in names for i in (0, 1)]
    reduced = all_reduce(local, device)
    metrics = {"eval/loss": reduced[0] / max(reduced[1], 1.0)}
    for index, name in enumerate(names):
        total, items = reduced[2 + 2 * index], reduced[3 + 2 * index]
        metrics[f"eval/{name}"] = total / max(items, 1.0)
    return metrics
