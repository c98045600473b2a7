"""What the model is trained to do: the `task` section (its loss, output and metrics)."""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING


@dataclass
class MetricSection:
    name: str = MISSING
    """`accuracy`, `top5`, `token_accuracy` (per-token outputs; targets of `-100` ignored), an import path to your own function `fn(outputs, targets) -> {name: (sum, count)}`, or
    to a torchmetrics.Metric class (`torchmetrics.classification:MulticlassF1Score`)."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for a torchmetrics Metric's constructor (`{num_classes: 4, average: macro}`)."""
    log_as: Optional[str] = None
    """A torchmetrics Metric is logged as `eval/<log_as>`; null: its class name in snake case
    (`MulticlassF1Score` -> `eval/multiclass_f1_score`). A function's names are the keys it returns."""


@dataclass
class TaskSection:
    loss: str = "cross_entropy"
    """`cross_entropy` (classification), `mse`, `bce_with_logits`, `next_token` (a causal language model's: the
    logits [N, T, vocab] at each position against the next position's label, -100 ignored), `model` (the loss the
    model returns, its outputs' `loss`: the model is given the targets as well, under `task.target`'s name or
    `labels`, as Hugging Face models take them), or an import path `package.module:fn` to your own
    `fn(outputs, targets) -> loss` (the batch mean)."""
    label_smoothing: float = 0.0
    """Label smoothing of `cross_entropy` (0: none)."""
    metrics: List[MetricSection] = field(default_factory=lambda: [MetricSection(name="accuracy")])
    """Evaluation metrics, logged as `eval/<name>`: `accuracy`, `top5`, `token_accuracy`, `perplexity` (exp of
    `eval/loss`), import paths to your own `fn(outputs, targets) -> {name: (sum, count)}` (summed over batches and
    ranks), or `{name: <torchmetrics Metric class>, kwargs: {...}}` (updated per batch, computed over all ranks by
    torchmetrics). A bare string is `{name: ...}`."""
    inputs: List[str] = field(default_factory=list)
    """The parts of a batch the model takes, by key (a dict batch), attribute (a dataclass or named tuple) or
    index (a tuple): named ones are passed as keyword arguments (`model(input_ids=..., attention_mask=...)`),
    indices positionally. Empty: a batch is `(inputs, targets)` (inputs a tensor, a tuple of positional inputs or
    a dict of keyword inputs), or, with `task.target` set, every part of the batch but the target."""
    target: Optional[str] = None
    """The part of a batch the loss and metrics compare the outputs with (`labels`, or an index); null: batches are
    `(inputs, targets)` pairs."""
    output: Optional[str] = None
    """The part of the model's outputs that is its prediction, for the built-in losses and metrics, torchmetrics,
    export and predict: a key (a dict, a Hugging Face `ModelOutput`), an attribute or an index (a tuple); null:
    `logits` where the outputs have it, else the outputs as they are."""
