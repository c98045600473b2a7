"""One rank's training step and what surrounds it, without Ray.

`train_step` (forward, backward, step: the `Precision` object does the rest), `after_step` (its
bookkeeping), `evaluate` (loss and accuracy reduced over all ranks), the loss/throughput `Window`,
memory peaks and what a collapsed loss scale does. `orchestrator.train.loop` drives them.
"""

import contextlib
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from orchestrator.precision import LossScaleCollapsed, StepOutcome
from orchestrator.train.memory import peak_bytes, peak_reserved_bytes
from orchestrator.train.modes import eval_mode
from orchestrator.train.optim import should_step_schedule
from orchestrator.train.state import TrainState
from orchestrator.train.training import Training

if TYPE_CHECKING:
    from orchestrator.train.faults import Faults


OVERFLOW_LOG = "amp/overflow_log"
"""The report key holding a rank's skipped-step records (the driver merges every rank's into one artifact)."""


def all_reduce(values: list[float], device: torch.device, op=dist.ReduceOp.SUM) -> list[float]:
    """Reduce a few numbers over all ranks in one collective."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def per_rank(value: float, rank: int, world_size: int, device: torch.device) -> list[float]:
    """Every rank's `value`, in rank order (one all-reduce of a one-hot vector)."""
    values = [0.0] * world_size
    values[rank] = value
    return all_reduce(values, device)


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
        then reset."""
        elapsed = time.perf_counter() - self.started
        loss_sum, samples, norm_sum, norm_steps = all_reduce(
            [self.loss_sum.item(), float(self.samples), self.grad_norm_sum.item(), float(self.grad_norm_steps)],
            self.device)
        metrics = {"train/loss": loss_sum / max(samples, 1.0), "perf/samples_per_s": samples / max(elapsed, 1e-9)}
        if norm_steps:
            metrics["train/grad_norm"] = norm_sum / norm_steps
        self.reset()
        return metrics


def train_step(training: Training, inputs, targets, device: torch.device, step: int,
               faults: "Optional[Faults]" = None) -> tuple[torch.Tensor, StepOutcome]:
    """One optimizer step on one batch: forward, backward, step; the same decision (step or skip) on every rank."""
    return accumulated_step(training, [(inputs, targets)], device, step, faults)


def accumulated_step(training: Training, micro_batches: Sequence[tuple[Any, Any]], device: torch.device, step: int,
                     faults: "Optional[Faults]" = None) -> tuple[torch.Tensor, StepOutcome]:
    """One optimizer step over `micro_batches` (`run.accumulate_steps` of them): forward and backward of each, the
    loss divided by their number, DDP's gradient all-reduce only on the last; then one step (unscale, clip, step
    or skip) and one loss-scale update. Returns the micro-batches' mean loss."""
    model, precision = training.prepared.model, training.precision
    training.optimizer.zero_grad(set_to_none=True)
    losses = []
    for index, (inputs, targets) in enumerate(micro_batches):
        inputs, targets = training.prepared.inputs(inputs, device), targets.to(device, non_blocking=True)
        last = index == len(micro_batches) - 1
        with contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():
            with precision.forward():
                loss = training.loss(model(inputs), targets)
            if faults is not None:
                loss = faults.loss(step, loss)
            precision.backward(loss / len(micro_batches) if len(micro_batches) > 1 else loss)
        losses.append(loss.detach())
    if faults is not None:
        faults.gradients(step, precision.named_tensors)
    loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
    return loss, precision.step(training.optimizer, loss, step, training.clip_grad_norm)


def after_step(training: Training, loss: torch.Tensor, outcome: StepOutcome, batch_size: int, window: "Window",
               pending: dict[str, Any]) -> None:
    """The bookkeeping after every step: the first step's audit and memory table (into `pending`, the next
    report), compilation once audited (`perf.compile`), the LR schedule and the loss window."""
    close_audit(training, pending)
    training.prepared.compile_when(training.precision.audited)  # from the second step of a (re)built model
    table = training.precision.ledger.take_table()  # once the optimizer has stepped: memory by category and dtype
    if table is not None:
        pending.update({"memory/breakdown": table, **training.precision.ledger.metrics()})
    if training.scheduler is not None and should_step_schedule(outcome):
        training.scheduler.step()
    if not outcome.nan_loss:
        window.add(loss, batch_size)
    if outcome.grad_norm is not None:
        window.add_grad_norm(outcome.grad_norm)


def read_window(training: Training, window: Window, step: int) -> dict[str, float]:
    """The loss window, reduced over all ranks and reset; a non-finite loss there fails as configured."""
    metrics = window.read()
    training.precision.guard.check_loss_window(metrics["train/loss"], step)
    return metrics


def scale_telemetry(training: Training) -> dict[str, Any]:
    """The loss scale's `amp/*` metrics and the overflow records since the last report (taken now)."""
    guard = training.precision.guard
    return {**guard.metrics(), OVERFLOW_LOG: guard.drain_overflow_log()}


@torch.no_grad()
def evaluate(training: Training, loader, device: torch.device) -> dict[str, float]:
    """`eval/loss` and every `task.metrics` over the whole eval set: each rank scores its shard, then the sums
    are reduced over all ranks (one all-reduce), so the figures are the whole set's, not rank 0's."""
    prepared, precision = training.prepared, training.precision
    model = prepared.model
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    sums: dict[str, list[Any]] = {}  # name -> [sum, count]
    count = 0
    with eval_mode(model):  # afterwards every module is back in its own mode (a frozen BatchNorm stays frozen)
        for inputs, targets in loader:
            inputs, targets = prepared.inputs(inputs, device), targets.to(device, non_blocking=True)
            with precision.forward():
                outputs = model(inputs)
            loss_sum += training.loss(outputs, targets).double() * targets.shape[0]
            count += targets.shape[0]
            for metric in training.metrics:
                for name, (total, items) in metric(outputs.float(), targets).items():
                    entry = sums.setdefault(name, [0.0, 0.0])
                    entry[0], entry[1] = entry[0] + total, entry[1] + items
    names = sorted(sums)
    local = [loss_sum.item(), float(count)] + [float(sums[n][i]) for n in names for i in (0, 1)]
    reduced = all_reduce(local, device)
    metrics = {"eval/loss": reduced[0] / max(reduced[1], 1.0)}
    for index, name in enumerate(names):
        total, items = reduced[2 + 2 * index], reduced[3 + 2 * index]
        metrics[f"eval/{name}"] = total / max(items, 1.0)
    return metrics


def close_audit(training: Training, into: dict[str, Any]) -> None:
    """After the first forward pass under a (new) policy: what each layer really stored and computed in."""
    entries = training.precision.close_audit()
    if entries is not None:
        into["precision/audit"] = entries


def memory_peaks(rank: int, world_size: int, device: torch.device) -> dict[str, float]:
    """`memory/peak_bytes` (max over ranks) and `memory/peak_bytes/rank<r>` (and CUDA reserved)."""
    peaks = per_rank(float(peak_bytes(device)), rank, world_size, device)
    metrics = {"memory/peak_bytes": max(peaks), **{f"memory/peak_bytes/rank{r}": p for r, p in enumerate(peaks)}}
    reserved = peak_reserved_bytes(device)
    if reserved is not None:
        reserved_peaks = per_rank(float(reserved), rank, world_size, device)
        metrics.update({f"memory/peak_reserved_bytes/rank{r}": p for r, p in enumerate(reserved_peaks)})
    return metrics


def recover_from_collapse(training: Training, outcome: StepOutcome, step: int, on_collapse: str,
                          last_good: Optional[TrainState], rebuild: Callable[[TrainState], Training]
                          ) -> tuple[Training, dict[str, str]]:
    """Act on a collapsed loss scale (the same on every rank: the flags were agreed).

    Returns the training to go on with and the run tags to set; raises for `abort`.
    """
    guard = training.precision.guard
    layers = guard.overflowing_layers()
    message = f"loss scale collapsed at step {step}: {outcome.collapse}; overflowing layers: " \
              f"{', '.join(layers) or 'none identified'}"
    if on_collapse == "abort" or (on_collapse == "promote" and not layers):
        raise LossScaleCollapsed(f"{message}. Keep those layers in fp32 (precision.rules), lower optim.lr, or set "
                                 "precision.scaler.on_collapse: promote | rollback.")
    tags = {}
    now = training.capture()
    if on_collapse == "promote":  # a fresh scale: the layers that overflowed are fp32 now
        now.scaler, now.promoted = None, list(dict.fromkeys(training.promoted + layers))
        state = now
        tags["precision.promoted"] = ",".join(state.promoted)
    else:  # rollback: the last good weights, optimizer and scale; time (step, schedule) goes on
        state = last_good.detached()
        state.scheduler, state.counters, state.promoted = now.scheduler, now.counters, now.promoted
    rebuilt = rebuild(state)
    if guard.rank == 0:
        rebuilt.precision.guard.overflow_log.append({"step": step, "event": "collapse", "action": on_collapse,
                                                     "reason": outcome.collapse, "layers": layers})
    return rebuilt, tags
