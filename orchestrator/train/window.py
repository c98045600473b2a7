"""The training loss and throughput since the last report, kept on the device until read."""

import time
from typing import Optional

import torch

from orchestrator.train.collectives import all_reduce


class Window:
    """Training loss and throughput since the last report, kept on the device until read: a step adds to it without
    the host waiting for the device, whether its loss counts (finite on every rank) being a device value too."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.counted = torch.zeros((), dtype=torch.float64, device=self.device)
        """Samples whose loss counts (steps whose loss was finite on every rank)."""
        self.samples = 0
        """Samples of every step added since the last read (on the host)."""
        self.grad_norm_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.grad_norm_steps = torch.zeros((), dtype=torch.float64, device=self.device)
        self.started = time.perf_counter()
        self.read_samples = 0.0
        """The samples of every rank counted at the last read (`perf/samples_per_s` x its seconds)."""

    def exclude_since(self, since: float) -> None:
        """Leave the time from `since` until now (reporting, evaluation, checkpointing) out of the throughput."""
        if self.samples == 0:  # read just before: the window starts now
            self.started = time.perf_counter()
        else:
            self.started += time.perf_counter() - since

    def add(self, loss: torch.Tensor, batch_size: int, counted: Optional[torch.Tensor] = None) -> None:
        """A step's mean loss over `batch_size` samples; `counted` (1.0 or 0.0 on the device, default 1.0): whether
        it counts (a loss that was not finite is left out, with its samples)."""
        weighted = loss.detach().double() * batch_size
        if counted is None:
            self.loss_sum += weighted
            self.counted += batch_size
        else:
            keep = counted.to(self.loss_sum.device) > 0
            self.loss_sum += torch.where(keep, weighted, 0.0)
            self.counted += keep.double() * batch_size
        self.samples += batch_size

    def add_grad_norm(self, norm: torch.Tensor, taken: Optional[torch.Tensor] = None) -> None:
        """A step's gradient norm before clipping (`optim.clip_grad_norm`); `taken` (1.0 or 0.0 on the device,
        default 1.0): only a step whose update was applied counts."""
        if taken is None:
            self.grad_norm_sum += norm.double()
            self.grad_norm_steps += 1
        else:
            keep = taken.to(self.grad_norm_sum.device) > 0
            self.grad_norm_sum += torch.where(keep, norm.double(), 0.0)
            self.grad_norm_steps += keep.double()

    def state(self) -> dict[str, float]:
        """This rank's unreported loss sum and sample count, and gradient norms (for a checkpoint)."""
        return {"loss_sum": self.loss_sum.item(), "samples": int(self.counted.item()),
                "grad_norm_sum": self.grad_norm_sum.item(), "grad_norm_steps": int(self.grad_norm_steps.item())}

    def load_state(self, state: dict[str, float]) -> None:
        self.loss_sum.fill_(state["loss_sum"])
        self.samples = int(state["samples"])
        self.counted.fill_(self.samples)
        self.grad_norm_sum.fill_(state.get("grad_norm_sum", 0.0))  # absent from checkpoints of older versions
        self.grad_norm_steps.fill_(int(state.get("grad_norm_steps", 0)))

    def read(self, only_counted: bool = False) -> dict[str, float]:
        """Global mean loss, samples/s and (with clipping) mean gradient norm over all ranks (one all-reduce),
        then reset. No `train/loss` when no step since the last read computed one (all skipped for a non-finite
        loss): a loss that was not computed is not reported; `only_counted`: then nothing at all."""
        elapsed = time.perf_counter() - self.started
        values = torch.stack([self.loss_sum, self.counted, self.grad_norm_sum, self.grad_norm_steps]).tolist()
        loss_sum, samples, norm_sum, norm_steps = all_reduce(values, self.device)
        self.reset()
        self.read_samples = samples
        if only_counted and not samples:
            return {}
        metrics = {"perf/samples_per_s": samples / max(elapsed, 1e-9)}
        if samples:
            metrics["train/loss"] = loss_sum / samples
        if norm_steps:
            metrics["train/grad_norm"] = norm_sum / norm_steps
        return metrics
