"""Evaluation over the whole eval set, every rank scoring its shard."""

import torch

from orchestrator.train.collectives import all_reduce
from orchestrator.common.modes import eval_mode
from orchestrator.train.task import Perplexity, SummedMetric, TorchMetric, fp32
from orchestrator.train.training import Training


@torch.no_grad()
def evaluate(training: Training, batches, device: torch.device) -> dict[str, float]:
    """`eval/loss` and every `task.metrics` over the whole eval set: each rank scores its shard of `batches`
    (`Batch`es); then the loss and the summed metrics are reduced over all ranks in one all-reduce, and each
    torchmetrics Metric computes over all ranks with its own sync, so the figures are the whole set's, not
    rank 0's. Every rank makes the same collectives in the same order."""
    prepared, precision = training.prepared, training.precision
    model = prepared.model
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    for metric in training.metrics:
        metric.reset(device)
    with eval_mode(model):  # afterwards every module is back in its own mode (a frozen BatchNorm stays frozen)
        for batch in batches:
            batch = prepared.place(batch, device)
            with precision.forward():
                outputs = batch.forward(model)
            loss_sum += training.loss(outputs, batch.targets).double() * batch.size
            count += batch.size
            outputs = fp32(outputs)
            for metric in training.metrics:
                metric.update(outputs, batch.targets)
    summed = [(name, entry) for metric in training.metrics if isinstance(metric, SummedMetric)
              for name, entry in sorted(metric.sums.items())]
    names = sorted({name for name, _ in summed})
    totals = {name: [0.0, 0.0] for name in names}
    for name, (total, items) in summed:
        totals[name][0] += float(total)
        totals[name][1] += float(items)
    local = [loss_sum.item(), float(count)] + [totals[n][i] for n in names for i in (0, 1)]
    reduced = all_reduce(local, device)
    metrics = {"eval/loss": reduced[0] / max(reduced[1], 1.0)}
    for index, name in enumerate(names):
        total, items = reduced[2 + 2 * index], reduced[3 + 2 * index]
        metrics[f"eval/{name}"] = total / max(items, 1.0)
    for metric in training.metrics:
        if isinstance(metric, TorchMetric):
            metrics.update({f"eval/{key}": value for key, value in metric.compute().items()})
        elif isinstance(metric, Perplexity):
            metrics.update({f"eval/{key}": value for key, value in metric.of_loss(metrics["eval/loss"]).items()})
    return metrics
