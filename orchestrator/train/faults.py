"""Deliberate failures for tests and drills (the `faults` section; everything off by default).

- `overflow_at_steps`: after backward, an inf is written into one layer's gradient (on every rank,
  or on `overflow_rank` only), exactly what an fp16 overflow looks like to the GradScaler.
- `nan_loss_at_step`: the loss of that step is NaN on every rank: a forward pass that is not finite.
- `kill_rank` + `at_step`: that rank's process dies with `os._exit` at the start of the step, as
  a preempted node or an OOM kill would: no exception, no cleanup. With `once` (the default) a
  marker file in the run's storage keeps the restarted worker group from dying again.
"""

import os
from typing import Any, Optional, Sequence

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
    def __init__(self, faults_cfg, rank: int, marker_dir: Optional[tuple[Any, str]] = None):
        """`marker_dir`: (pyarrow filesystem, directory) where `once` leaves its marker."""
        self.cfg, self.rank, self.marker_dir = faults_cfg, rank, marker_dir
        self.overflow_steps = set(faults_cfg.overflow_at_steps)

    def kill(self, step: int) -> None:
        """Die here if this rank is to be killed at this step (and, with `once`, has not been yet)."""
        if self.cfg.kill_rank != self.rank or self.cfg.at_step != step:
            return
        if self.cfg.once and self.marker_dir is not None:
            from pyarrow.fs import FileType

            filesystem, directory = self.marker_dir
            marker = f"{directory}/.ampflow_fault_kill_rank{self.rank}_step{step}"
            if filesystem.get_file_info(marker).type != FileType.NotFound:
                return
            with filesystem.open_output_stream(marker) as out:
                out.write(b"killed once by faults.kill_rank\n")
        os._exit(1)

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
