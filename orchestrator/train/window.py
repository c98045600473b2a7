"""The training loss and throughput since the last report, kept on the device until read."""

import time

import torch

from orchestrator.train.collectives import all_reduce


class Window:
    """Training loss and throughput since the last report, kept on the device until read."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.samples = 0
        self.grad_norm_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.grad_norm_steps = 0
        self.started = time.perf_counter()

    def exclude_since(self, since: float) -> None:
        """Leave the time from `since` until now (reporting, evaluation, checkpointing) out of the throughput."""
        if self.samples == 0:  # read just before: the window starts now
            self.started = time.perf_counter()
        else:
            self.started += time.perf_counter() - since

    def add(self, loss: torch.Tensor, batch_size: int) -> None:
        self.loss_sum += loss.detach().double() * batch_size
        self.samples += batch_size

    def add_grad_norm(self, norm: torch.Tensor) -> None:
        """A taken step's gradient norm before clipping (`optim.clip_grad_norm`)."""
        self.grad_norm_sum += norm.double()
        self.grad_norm_steps += 1

    def state(self) -> dict[str, float]:
        """This rank's unreported loss sum and sample count, and gradient norms (for a checkpoint)."""
        return {"loss_sum": self.loss_sum.item(), "samples": self.samples,
                "grad_norm_sum": self.grad_norm_sum.item(), "grad_norm_steps": self.grad_norm_steps}

    def load_state(self, state: dict[str, float]) -> None:
        self.loss_sum.fill_(state["loss_sum"])
        self.samples = int(state["samples"])
        self.grad_norm_sum.fill_(state.get("grad_norm_sum", 0.0))  # absent from checkpoints of older versions
        self.grad_norm_steps = int(state.get("grad_norm_steps", 0))

    def read(self) -> dict[str, float]:
        """Global mean loss, samples/s and (with clipping) mean gradient norm over all ranks (one all-reduce),
        then reset. No `train/loss` when no step since the last read computed one (all skipped for a non-finite
        loss): a loss that was not computed is not reported."""
        elapsed = time.perf_counter() - self.started
        loss_sum, samples, norm_sum, norm_steps = all_reduce(
            [self.loss_sum.item(), float(self.samples), self.grad_norm_sum.item(), float(self.grad_norm_steps)],
            self.device)
        metrics = {"perf/samples_per_s": samples / max(elapsed, 1e-9)}
        if samples:
            metrics["train/loss"] = loss_sum / samples
        if norm_steps:
            metrics["train/grad_norm"] = norm_sum / norm_steps
        self.reset()
        return metrics
