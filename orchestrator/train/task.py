"""What the model is trained to do: the loss (`task.loss`) and the evaluation metrics (`task.metrics`).

Built in: `cross_entropy` (with `task.label_smoothing`), `mse` and `bce_with_logits` losses; `accuracy`
and `top5` metrics. Or the user's own, by import path (`package.module:name`, shipped to the workers as an
import-path model is):
- a loss `fn(outputs, targets) -> loss`: a scalar tensor, the mean over the batch;
- a metric `fn(outputs, targets) -> {name: (sum, count)}`: for each name, a sum and the number of items
  it is over, for this batch. Evaluation adds them up over all batches and all ranks and logs
  `eval/<name>` = total sum / total count (accuracy is `{"accuracy": (correct, batch size)}`).
Losses run in fp32 (outputs are cast to float32 first), whatever the forward pass computed in.
"""

from typing import Any, Callable

import torch
import torch.nn.functional as F

from orchestrator.config.imports import resolve_import_path
from orchestrator.config.names import check_loss_name

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Metric = Callable[[torch.Tensor, torch.Tensor], dict[str, tuple[Any, Any]]]


def _as_outputs(targets: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """Targets as float with the outputs' shape (`N` targets for `N x 1` outputs)."""
    targets = targets.float()
    return targets.view_as(outputs) if targets.numel() == outputs.numel() else targets


def build_loss(task) -> Loss:
    name = task.loss
    if name == "cross_entropy":
        smoothing = task.label_smoothing
        return lambda outputs, targets: F.cross_entropy(outputs.float(), targets, label_smoothing=smoothing)
    if name == "mse":
        return lambda outputs, targets: F.mse_loss(outputs.float(), _as_outputs(targets, outputs.float()))
    if name == "bce_with_logits":
        return lambda outputs, targets: F.binary_cross_entropy_with_logits(
            outputs.float(), _as_outputs(targets, outputs.float()))
    check_loss_name(name)  # an unknown name is refused here
    user_loss = resolve_import_path(name, "task.loss", kind="loss")
    return lambda outputs, targets: user_loss(outputs.float(), targets)


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, tuple[Any, Any]]:
    return {"accuracy": ((outputs.argmax(dim=1) == targets).sum(), targets.shape[0])}


def top5(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, tuple[Any, Any]]:
    best = outputs.topk(min(5, outputs.shape[1]), dim=1).indices
    return {"top5": ((best == targets.unsqueeze(1)).any(dim=1).sum(), targets.shape[0])}


BUILT_IN = {"accuracy": accuracy, "top5": top5}


def build_metrics(task) -> list[Metric]:
    return [BUILT_IN[name] if name in BUILT_IN else resolve_import_path(name, "task.metrics", kind="metric")
            for name in task.metrics]
