"""Deliberate failures for tests and drills (the `faults` section; everything off by default).

- `overflow_at_steps`: after backward, an inf is written into one layer's gradient (on every rank,
  or on `overflow_rank` only), exactly what an fp16 overflow looks like to the GradScaler.
- `nan_loss_at_step`: the loss of that step is NaN on every rank: a forward pass that is not finite.
"""

from typing import Optional, Sequence

import torch
from torch import nn

from orchestrator.errors import BadInput


def layers_with_params(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if any(True for _ in module.parameters(recurse=False))]


def check(faults_cfg, model: nn.Module) -> None:
    """Driver-side: the layer named by `faults.overflow_layer` exists and has parameters."""
    layer = faults_cfg.overflow_layer
    if layer is not None and layer not in layers_with_params(model):
        names = layers_with_params(model)
        raise BadInput(f"faults.overflow_layer: '{layer}' is not a layer with parameters of this model. "
                       f"Layers: {', '.join(names[:12])}{', ...' if len(names) > 12 else ''}.")


class Faults:
    def __init__(self, faults_cfg, rank: int):
        self.cfg, self.rank = faults_cfg, rank
        self.overflow_steps = set(faults_cfg.overflow_at_steps)

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if step == self.cfg.nan_loss_at_step:
            return loss * float("nan")
        return loss

    @torch.no_grad()
    def gradients(self, step: int, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Write an inf into the first gradient element of the chosen layer (the optimizer's view of it)."""
        if step not in self.overflow_steps or self.cfg.overflow_rank not in (None, self.rank):
            return
        target = self._target(named_tensors)
        if target is not None and target.grad is not None:
            target.grad.view(-1)[0] = float("inf")

    def _target(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> Optional[torch.Tensor]:
        layer = self.cfg.overflow_layer
        for name, tensor in reversed(named_tensors):  # default: the last layer, where backward starts
            if layer is None or name.rpartition(".")[0] == layer:
                return tensor
        return None
