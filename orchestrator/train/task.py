"""What the model is trained to do: the loss (`task.loss`) and the evaluation metrics (`task.metrics`).

Built in: `cross_entropy` (with `task.label_smoothing`), `mse`, `bce_with_logits` and `next_token` (a causal
language model's: the logits at each position against the next position's label, -100 ignored) losses;
`accuracy`, `top5` and `perplexity` (exp of the evaluation's mean loss, `eval/loss`) metrics, and `token_accuracy`
for per-token outputs (a tagger's `N x tokens x classes` scores against `N x tokens` targets, the tokens whose
target is `IGNORE_INDEX` left out: padding, as Hugging Face marks it). Or the user's own, by import path
(`package.module:name`, shipped to the workers as an import-path model is):
- a loss `fn(outputs, targets) -> loss`: a scalar tensor, the mean over the batch;
- a metric `fn(outputs, targets) -> {name: (sum, count)}`: for each name, a sum and the number of items
  it is over, for this batch. Evaluation adds them up over all batches and all ranks and logs
  `eval/<name>` = total sum / total count (accuracy is `{"accuracy": (correct, batch size)}`);
- a `torchmetrics.Metric` class (`{name: torchmetrics.classification:MulticlassF1Score, kwargs: {...}}`): updated
  with every batch, computed over all ranks by torchmetrics' own sync, logged as `eval/<log_as>`. Any metric that
  is not a mean over samples (macro-F1, AUROC, mAP) needs this.
Losses and metrics see fp32 outputs (floating outputs are cast to float32 first), whatever the forward pass
computed in.

Models that return more than one tensor (a dict, a dataclass, a tuple, a Hugging Face `ModelOutput`): the built-in
losses and metrics, and torchmetrics Metrics, read the prediction from the part `task.output` names (a key, an
attribute or an index), else from `logits` where the outputs have it; the user's own functions get the outputs
whole. `task.loss: model` is the loss the model returns (its outputs' `loss`), the model given the targets too.
"""

import math
import warnings
from functools import partial
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn.functional as F

from orchestrator.config.imports import resolve_import_path
from orchestrator.config.names import NEXT_TOKEN_LOSS, check_loss_name, is_torchmetrics_class, snake_case
from orchestrator.errors import BadInput
from orchestrator.common.values import map_tensors, prediction
from orchestrator.train.batch import MODEL_LOSS

Loss = Callable[[Any, Any], torch.Tensor]


def fp32(outputs: Any) -> Any:
    """The outputs with every floating tensor in float32 (what losses and metrics are given)."""
    return map_tensors(lambda t: t.float() if t.is_floating_point() else t, outputs)


def _as_outputs(targets: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """Targets as float with the outputs' shape (`N` targets for `N x 1` outputs)."""
    targets = targets.float()
    return targets.view_as(outputs) if targets.numel() == outputs.numel() else targets


MODEL_LOSS_HINT = ("With task.loss: model the model is given the targets (as `labels`, or under task.target's name) "
                   "and returns its loss: a `loss` key or attribute, or the first item of a tuple, as Hugging Face "
                   "models do. For a model that does not, name a loss: cross_entropy, mse, bce_with_logits or your "
                   "own package.module:fn.")


def model_loss_of(outputs: Any) -> Any:
    """The loss a model returned (`task.loss: model`): index 0 of a tuple, else its outputs' `loss` (a key or an
    attribute); None when they hold none."""
    if isinstance(outputs, (tuple, list)):
        return outputs[0] if outputs else None
    if isinstance(outputs, Mapping):
        return outputs.get("loss")
    loss = getattr(outputs, "loss", None) if not isinstance(outputs, torch.Tensor) else None
    return None if callable(loss) else loss


def model_loss(outputs: Any, targets: Any) -> torch.Tensor:
    """`task.loss: model`: the loss the model computed (its outputs' `loss`: a key, an attribute, or index 0 of a
    tuple, as Hugging Face models return it when given `labels`)."""
    loss = model_loss_of(outputs)
    if loss is None:
        raise BadInput(f"task.loss: model: the model's output has no part 'loss' (it is {type(outputs).__name__}). "
                       f"{MODEL_LOSS_HINT}")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise BadInput(f"task.loss: model: the model's loss is {type(loss).__name__}"
                       f"{' of shape ' + str(list(loss.shape)) if isinstance(loss, torch.Tensor) else ''}, not a "
                       "scalar tensor. A model computes its own loss when given the targets (`labels`); or name a "
                       "loss.")
    return loss.float()


IGNORE_INDEX = -100
"""The target of a token that no metric or loss counts (padding, a prompt): torch's `cross_entropy` default and
Hugging Face's."""


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal language-modelling loss: the logits at positions 0..T-2 (`[N, T, vocab]`) against the labels
    at 1..T (`[N, T]`, the input ids themselves, as Hugging Face's causal LMs take them), mean cross-entropy over
    the tokens whose label is not `IGNORE_INDEX`."""
    if logits.dim() != 3 or labels.dim() != 2 or logits.shape[:2] != labels.shape:
        raise ValueError(f"next_token takes logits [batch, sequence, vocab] and labels [batch, sequence]; got "
                         f"{list(logits.shape)} and {list(labels.shape)}")
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX)


def build_loss(task) -> Loss:
    name, output = task.loss, getattr(task, "output", None)  # a run logged before task.output has none
    if name == MODEL_LOSS:
        return model_loss
    if name == "cross_entropy":
        smoothing = task.label_smoothing
        return lambda outputs, targets: F.cross_entropy(prediction(outputs, output).float(), targets,
                                                        label_smoothing=smoothing)
    if name == NEXT_TOKEN_LOSS:
        return lambda outputs, targets: next_token_loss(prediction(outputs, output), targets)
    if name == "mse":
        return lambda outputs, targets: F.mse_loss(prediction(outputs, output).float(),
                                                   _as_outputs(targets, prediction(outputs, output).float()))
    if name == "bce_with_logits":
        return lambda outputs, targets: F.binary_cross_entropy_with_logits(
            prediction(outputs, output).float(), _as_outputs(targets, prediction(outputs, output).float()))
    check_loss_name(name)  # an unknown name is refused here
    user_loss = resolve_import_path(name, "task.loss", kind="loss")
    return lambda outputs, targets: user_loss(fp32(outputs), targets)


def _per_token(outputs: torch.Tensor, targets: torch.Tensor) -> bool:
    return isinstance(targets, torch.Tensor) and targets.dim() >= 2 and outputs.dim() == targets.dim() + 1


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, tuple[Any, Any]]:
    if _per_token(outputs, targets):
        raise ValueError(f"per-token outputs ({'x'.join(map(str, outputs.shape))} scores for "
                         f"{'x'.join(map(str, targets.shape))} targets): 'accuracy' takes one prediction per sample. "
                         f"Name the metric for tokens, task.metrics: [token_accuracy] (targets of {IGNORE_INDEX} "
                         "ignored)")
    return {"accuracy": ((outputs.argmax(dim=1) == targets).sum(), targets.shape[0])}


def token_accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, tuple[Any, Any]]:
    """The share of tokens whose best-scored class is their target, over every token whose target is not
    `IGNORE_INDEX`: scores `N x tokens x classes` (the class dim last), targets `N x tokens`."""
    if not _per_token(outputs, targets):
        raise ValueError(f"'token_accuracy' takes per-token scores (N x tokens x classes) and targets (N x tokens); "
                         f"got {'x'.join(map(str, outputs.shape))} scores for {'x'.join(map(str, targets.shape))} "
                         "targets. For one prediction per sample, name 'accuracy'")
    counted = targets != IGNORE_INDEX
    return {"token_accuracy": (((outputs.argmax(dim=-1) == targets) & counted).sum(), counted.sum())}


def top5(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, tuple[Any, Any]]:
    best = outputs.topk(min(5, outputs.shape[1]), dim=1).indices
    return {"top5": ((best == targets.unsqueeze(1)).any(dim=1).sum(), targets.shape[0])}


class Perplexity:
    """`perplexity`: exp of the evaluation's mean loss (`eval/loss`, a cross-entropy per token for `next_token` or
    a causal LM's own loss), logged as `eval/perplexity`. It reads nothing of the batches: the loss is the
    evaluation's, reduced over all ranks already."""

    name = "perplexity"

    def reset(self, device: torch.device) -> None:
        pass

    def update(self, outputs: Any, targets: Any) -> None:
        pass

    def of_loss(self, loss: float) -> dict[str, float]:
        return {self.name: math.exp(loss) if loss < 709 else math.inf}  # exp overflows a float past 709


BUILT_IN = {"accuracy": accuracy, "top5": top5, "token_accuracy": token_accuracy, "perplexity": Perplexity}


class SummedMetric:
    """A metric function `fn(outputs, targets) -> {name: (sum, count)}`: sums and counts added up over this rank's
    batches here, over the ranks by the evaluation (one all-reduce for every such metric)."""

    def __init__(self, function: Callable[[Any, Any], dict[str, tuple[Any, Any]]], name: str,
                 reads: Callable[[Any], Any] = lambda outputs: outputs):
        self.function, self.name, self.reads = function, name, reads
        self.sums: dict[str, list[Any]] = {}
        """name -> [sum, count] over this rank's batches so far (tensors stay on the device until the end)."""

    def reset(self, device: torch.device) -> None:
        self.sums = {}

    def update(self, outputs: Any, targets: Any) -> None:
        returned = self.function(self.reads(outputs), targets)
        if not isinstance(returned, dict) or not all(isinstance(v, (tuple, list)) and len(v) == 2
                                                     for v in returned.values()):
            raise TypeError(f"it returned {type(returned).__name__} {str(returned)[:100]}, not {{name: (sum, "
                            "count)}}")
        for key, (total, items) in returned.items():
            entry = self.sums.setdefault(key, [0.0, 0.0])
            entry[0], entry[1] = entry[0] + total, entry[1] + items


class TorchMetric:
    """A torchmetrics Metric: updated per batch, `compute()` gathers every rank's state (torchmetrics' own sync, a
    collective every rank makes) and gives the whole eval set's value."""

    def __init__(self, metric: Any, key: str, reads: Callable[[Any], Any] = lambda outputs: outputs):
        self.metric, self.key, self.reads = metric, key, reads

    def reset(self, device: torch.device) -> None:
        self.metric.reset()
        self.metric.to(device)

    def update(self, outputs: Any, targets: Any) -> None:
        self.metric.update(self.reads(outputs), targets)

    def compute(self) -> dict[str, float]:
        """`{key: value}`; a metric giving one value per class or a dict gives `key/<index or name>` for each."""
        with warnings.catch_warnings():  # a rank whose shard is empty still takes part in the sync
            warnings.filterwarnings("ignore", message=".*compute.*before.*update.*")
            value = self.metric.compute()
        if isinstance(value, dict):
            return {f"{self.key}/{name}": float(v) for name, v in value.items()}
        value = torch.as_tensor(value)
        if value.numel() == 1:
            return {self.key: float(value)}
        return {f"{self.key}/{index}": float(v) for index, v in enumerate(value.flatten())}


def build_metric(spec, output: Optional[str] = None) -> SummedMetric | TorchMetric | Perplexity:
    """`spec`'s metric; the built-in ones and torchmetrics read the prediction (`task.output`, or `logits`)."""
    reads = partial(prediction, output=output)
    if spec.name == Perplexity.name:
        return Perplexity()
    if spec.name in BUILT_IN:
        return SummedMetric(BUILT_IN[spec.name], spec.name, reads)
    target = resolve_import_path(spec.name, "task.metrics", kind="metric")
    if is_torchmetrics_class(target):
        return TorchMetric(target(**dict(spec.kwargs)), spec.log_as or snake_case(target.__name__), reads)
    return SummedMetric(target, spec.name)


def build_metrics(task) -> list[SummedMetric | TorchMetric | Perplexity]:
    return [build_metric(spec, getattr(task, "output", None)) for spec in task.metrics]
