"""Train/eval modes belong to the user: what we run restores them, and `run.freeze_norm` pins norms to eval.

A module the user put in eval mode (a frozen BatchNorm when fine-tuning) must still be in eval
mode after an evaluation, an export or a summary. `eval_mode` calls the model's own `eval()` and, after,
its own `train()` (so a model overriding them, e.g. keeping its norm layers in eval mode as mmdetection's
`norm_eval` does, runs its override both ways), then restores every module's own flag as it was.
`train_mode` starts training the same way: the model's own `train()`, and what the user froze stays frozen.
"""

from contextlib import contextmanager
from typing import Iterator

from torch import nn

from orchestrator.precision.policy import NORM_TYPES


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """The model in eval mode inside (its own `eval()`); afterwards its own `train()` when it was training, and each
    module's training flag what it was before."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        if flags[0][1]:
            model.train()
        for module, training in flags:
            module.training = training


def train_mode(model: nn.Module) -> nn.Module:
    """The model in training mode by its own `train()` (an override runs: norm layers kept in eval mode,
    mmdetection's `norm_eval`); a module the user put in eval mode before (a BatchNorm frozen in the constructor)
    stays in eval mode."""
    frozen = [module for module in model.modules() if not module.training]
    model.train()
    for module in frozen:
        module.training = False
    return model


def freeze_norm(model: nn.Module) -> int:
    """Put every normalisation layer in eval mode: its running statistics stay as they are. Returns how many."""
    norms = [module for module in model.modules() if isinstance(module, NORM_TYPES)]
    for module in norms:
        module.eval()
    return len(norms)
