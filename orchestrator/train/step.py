"""One optimizer step of one rank: forward, backward, step. The `Precision` object does the rest.

`Step` is what the loop's hooks see of a step: its number, its micro-batches, and once they are known its
loss and outcome. `accumulated_step` is the maths of it, without Ray and without the loop, so tests and
benchmarks can call it on its own.
"""

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from orchestrator.precision import StepOutcome
from orchestrator.train.batch import Batch
from orchestrator.train.training import Training


@dataclass
class Step:
    """One optimizer step, as the loop's hooks see it."""

    number: int
    """The global optimizer step, from 1 (skipped steps count)."""
    epoch: int
    """The epoch, from 0."""
    index: int
    """The step's place in its epoch, from 0."""
    batches: list[Batch] = field(default_factory=list)
    """Its micro-batches (`run.accumulate_steps` of them), on the host as the loader gave them."""
    weights: Optional[list[float]] = None
    """What each micro-batch's loss is multiplied by before backward, when they differ in size (an elastic run's
    global batch shared out unevenly: its size x world size / global batch); None: 1 / their number."""
    loss: Optional[torch.Tensor] = None
    """The micro-batches' mean loss, on the device, once backward ran (what the step decides on)."""
    outcome: Optional[StepOutcome] = None
    """Stepped or skipped, and why, once the optimizer step ran."""

    @property
    def samples(self) -> int:
        """Samples this rank trained on in this step."""
        return sum(batch.size for batch in self.batches)


def train_step(training: Training, inputs, targets, device: torch.device, step: int,
               after_backward: Optional[Callable[[Step], None]] = None) -> tuple[torch.Tensor, StepOutcome]:
    """One optimizer step on one `(inputs, targets)` batch: forward, backward, step; the same decision (step or
    skip) on every rank."""
    record = Step(number=step, epoch=0, index=0, batches=[Batch.pair(inputs, targets)])
    accumulated_step(training, record, device, after_backward)
    return record.loss, record.outcome


def accumulated_step(training: Training, step: Step, device: torch.device,
                     after_backward: Optional[Callable[[Step], None]] = None) -> None:
    """One optimizer step over `step.batches` (`run.accumulate_steps` of them): forward and backward of each,
    the loss divided by their number (or times `step.weights`), the gradients' reduction only on the last;
    `after_backward(step)`; then one step (unscale, clip, step or skip) and one loss-scale update. Sets `step.loss`
    (the mean loss of this rank's samples) and `step.outcome`."""
    model, precision = training.prepared.model, training.precision
    micro_batches = step.batches
    training.optimizer.zero_grad(set_to_none=True)
    losses = []
    for index, batch in enumerate(micro_batches):
        batch = training.prepared.place(batch, device)
        last = index == len(micro_batches) - 1
        with contextlib.nullcontext() if last else training.strategy.no_sync():
            with precision.forward():
                loss = training.loss(batch.forward(model), batch.targets)
            if step.weights is not None:
                precision.backward(loss * step.weights[index])
            else:
                precision.backward(loss / len(micro_batches) if len(micro_batches) > 1 else loss)
        losses.append(loss.detach())
    if step.weights is not None:  # the mean over this rank's samples (the weights are host floats: no copy)
        step.loss = sum(loss * weight for loss, weight in zip(losses, step.weights)) / sum(step.weights)
    else:
        step.loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
    if after_backward is not None:
        after_backward(step)
    step.outcome = precision.step(training.optimizer, step.loss, step.number, training.clip_grad_norm,
                                  training.strategy.clip)
