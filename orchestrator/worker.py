"""The training loop every Ray Train worker runs, top to bottom.

One rank of a DDP job: build data, then the model under its precision policy, optimizer and
guarded GradScaler (`orchestrator.training`); train under autocast; report metrics every
`tracking.log_every_n_steps` steps and at each epoch's end (with eval, memory and a checkpoint).
The controller-side tracking callback turns reports into MLflow.
"""

import random
import time
from contextlib import nullcontext
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf

from orchestrator import checkpoint as ckpt
from orchestrator import precision
from orchestrator.data import build_datasets, build_loaders
from orchestrator.faults import Faults
from orchestrator.memory import peak_bytes, peak_reserved_bytes
from orchestrator.precision import AmpSettings, LossScaleCollapsed, StepOutcome, autocast_context
from orchestrator.training import Training, build_training, detached_copy


class PolicyNotHonoured(RuntimeError):
    """A layer did not store or compute in the dtype its precision rule promised."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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
        self.started = time.perf_counter()

    def add(self, loss: torch.Tensor, batch_size: int) -> None:
        self.loss_sum += loss.detach().double() * batch_size
        self.samples += batch_size

    def read(self) -> dict[str, float]:
        """Global mean loss and samples/s over all ranks (one all-reduce), then reset."""
        elapsed = time.perf_counter() - self.started
        loss_sum, samples = all_reduce([self.loss_sum.item(), float(self.samples)], self.device)
        metrics = {"train/loss": loss_sum / max(samples, 1.0), "perf/samples_per_s": samples / max(elapsed, 1e-9)}
        self.reset()
        return metrics


def train_step(training: Training, inputs, targets, amp: AmpSettings, device: torch.device, step: int,
               faults: Faults | None = None) -> tuple[torch.Tensor, StepOutcome]:
    """One optimizer step under autocast; the guarded scaler steps or skips it the same on every rank."""
    model, masters, ledger = training.prepared.model, training.prepared.masters, training.ledger
    inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
    recording = ledger.probe.recording() if ledger.probe is not None else nullcontext()  # first step only
    with autocast_context(amp, device.type), recording:
        loss = F.cross_entropy(model(inputs).float(), targets)
    if faults is not None:
        loss = faults.loss(step, loss)
    training.optimizer.zero_grad(set_to_none=True)
    training.guard.scale(loss).backward()  # DDP all-reduces the (scaled) gradients during backward
    ledger.record_backward()
    if masters:
        masters.grads_to_masters()  # the optimizer (and the unscale) works on fp32 copies
    if faults is not None:
        faults.gradients(step, training.named_tensors)
    outcome = training.guard.step(training.optimizer, loss, step, training.named_tensors)
    if outcome.stepped:
        if masters:
            masters.masters_to_params()
        if not ledger.complete:
            ledger.record_state(training.optimizer, masters)
    return loss, outcome


@torch.no_grad()
def evaluate(model, loader, amp: AmpSettings, device: torch.device) -> dict[str, float]:
    """Loss and accuracy over the whole eval set: each rank scores its shard, then sums are reduced."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    count = 0
    for inputs, targets in loader:
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with autocast_context(amp, device.type):
            logits = model(inputs)
        loss_sum += F.cross_entropy(logits.float(), targets, reduction="sum").double()
        correct += (logits.argmax(dim=1) == targets).sum()
        count += targets.numel()
    model.train()
    total_loss, total_correct, total = all_reduce([loss_sum.item(), float(correct.item()), float(count)], device)
    return {"eval/loss": total_loss / max(total, 1.0), "eval/accuracy": total_correct / max(total, 1.0)}


def close_audit(training: Training, into: dict[str, Any]) -> None:
    """After the first forward pass under a (new) policy: what each layer really stored and computed in."""
    audit = training.prepared.audit
    if audit is None or not audit.outputs:
        return
    entries = audit.close()
    training.prepared.audit = None
    problems = precision.broken_promises(entries)
    if problems:
        raise PolicyNotHonoured("precision policy not honoured: " + "; ".join(problems))
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


def train_loop(config: dict[str, Any]) -> None:
    cfg = OmegaConf.create(config["job"])
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    seed_everything(cfg.run.seed + rank)
    amp = AmpSettings.from_config(cfg.precision)
    faults = Faults(cfg.faults, rank)
    on_collapse = cfg.precision.scaler.on_collapse

    # Data: every rank sees its own shard of the training set and of the eval set.
    train_set, eval_set = build_datasets(cfg.data, cfg.model.num_classes)
    train_loader, eval_loader, train_sampler = build_loaders(
        train_set, eval_set, batch_size=cfg.run.batch_size, rank=rank, world_size=world_size,
        seed=cfg.run.seed, loader_workers=cfg.data.loader_workers, pin_memory=device.type == "cuda",
    )
    steps_per_epoch = len(train_loader)
    if cfg.run.max_steps_per_epoch is not None:
        steps_per_epoch = min(steps_per_epoch, cfg.run.max_steps_per_epoch)
    total_steps = steps_per_epoch * cfg.run.epochs

    # Model under its precision policy (DDP-wrapped), optimizer, schedule and guarded scaler,
    # from the last checkpoint after a restart.
    state = ckpt.load_state(ray.train.get_checkpoint())
    build = dict(rank=rank, world_size=world_size, total_steps=total_steps)
    training = build_training(cfg, device, state=state, **build)
    start_epoch, global_step = (state["epoch"] + 1, state["global_step"]) if state is not None else (0, 0)
    # What `on_collapse: rollback` returns to: the last checkpoint (or the start), kept on the CPU.
    last_good = detached_copy(training.capture()) if on_collapse == "rollback" else None
    pending: dict[str, Any] = {}  # non-metric results (audit, memory table, tags) that ride on the next report

    def common_metrics(epoch: int) -> dict[str, Any]:
        return {"epoch": epoch + 1, "epochs": cfg.run.epochs, "step": global_step, "total_steps": total_steps,
                **training.guard.metrics(), "amp/overflow_log": training.guard.drain_overflow_log()}

    def read_window() -> dict[str, float]:
        metrics = window.read()
        training.guard.check_loss_window(metrics["train/loss"], global_step)
        return metrics

    window = Window(device)
    for epoch in range(start_epoch, cfg.run.epochs):
        train_sampler.set_epoch(epoch)
        for step_in_epoch, (inputs, targets) in enumerate(train_loader):
            if step_in_epoch >= steps_per_epoch:
                break
            global_step += 1
            loss, outcome = train_step(training, inputs, targets, amp, device, global_step, faults)
            close_audit(training, pending)
            table = training.ledger.take_table()  # once the optimizer has stepped: memory by category and dtype
            if table is not None:
                pending.update({"memory/breakdown": table, **training.ledger.metrics()})
            if training.scheduler is not None:
                training.scheduler.step()
            if not outcome.nan_loss:
                window.add(loss, targets.numel())

            if outcome.collapse is not None:  # the same decision on every rank: the flags were agreed
                layers = training.guard.overflowing_layers()
                message = (f"loss scale collapsed at step {global_step}: {outcome.collapse}; overflowing layers: "
                           f"{', '.join(layers) or 'none identified'}")
                if on_collapse == "abort" or (on_collapse == "promote" and not layers):
                    raise LossScaleCollapsed(
                        f"{message}. Keep those layers in fp32 (precision.rules), lower optim.lr, or set "
                        "precision.scaler.on_collapse: promote | rollback.")
                if on_collapse == "promote":
                    state = training.capture()
                    state.pop("scaler")  # a fresh scale: the layers that overflowed are fp32 now
                    state["promoted"] = list(dict.fromkeys(training.promoted + layers))
                    pending["tags"] = {"precision.promoted": ",".join(state["promoted"])}
                else:  # rollback: the last good weights, optimizer and scale; time (step, schedule) goes on
                    now = training.capture()
                    state = {**last_good, **{key: now[key] for key in ("scheduler", "counters", "promoted")}}
                training = build_training(cfg, device, state=state, **build)
                if rank == 0:
                    training.guard.overflow_log.append({"step": global_step, "event": "collapse", "action": on_collapse,
                                                        "reason": outcome.collapse, "layers": layers})

            if global_step % cfg.tracking.log_every_n_steps == 0:
                ray.train.report({**common_metrics(epoch), **read_window(), **pending})
                pending.clear()

        # End of epoch: the rest of the window, evaluation, memory, and a checkpoint when due.
        last_epoch = epoch + 1 == cfg.run.epochs
        metrics = {**common_metrics(epoch), **training.guard.end_epoch(), **pending}
        pending.clear()
        if window.samples:
            metrics.update(read_window())
        if last_epoch or (epoch + 1) % cfg.run.eval_every_n_epochs == 0:
            metrics.update(evaluate(training.prepared.model, eval_loader, amp, device))
            close_audit(training, metrics)  # a policy changed on the epoch's last step shows in eval's forward
        metrics.update(memory_peaks(rank, world_size, device))
        metrics.update({"memory/params_bytes": float(training.prepared.params_bytes), **training.ledger.metrics()})

        checkpoint_due = last_epoch or (epoch + 1) % cfg.checkpoint.every_n_epochs == 0
        if checkpoint_due:
            state = {**training.capture(), "epoch": epoch, "global_step": global_step}
            if last_good is not None:
                last_good = detached_copy(state)
        with ckpt.staged_checkpoint(state) if checkpoint_due and rank == 0 else nullcontext() as checkpoint:
            ray.train.report(metrics, checkpoint=checkpoint)
