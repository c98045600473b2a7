"""The training loop every Ray Train worker runs, top to bottom.

One rank of a DDP job: build data, model, optimizer and scaler from the job
config; train under autocast with GradScaler; report metrics every
`tracking.log_every_n_steps` steps and at each epoch's end (with eval and a
checkpoint). The controller-side tracking callback turns reports into MLflow.
"""

import random
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from orchestrator import checkpoint as ckpt
from orchestrator.data import build_datasets, build_loaders
from orchestrator.memory import param_bytes_by_dtype, peak_bytes
from orchestrator.models import build_model
from orchestrator.optim import build_optimizer, build_scheduler
from orchestrator import precision
from orchestrator.precision import AmpSettings, MasterWeights, autocast_context, found_inf, loss_scale_of, make_scaler


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


def train_step(model, inputs, targets, optimizer, scaler, amp: AmpSettings, device: torch.device,
               masters: Optional[MasterWeights] = None):
    """One optimizer step under autocast + GradScaler. Returns (loss, found_inf or None), both on device."""
    inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
    with autocast_context(amp, device.type):
        loss = F.cross_entropy(model(inputs).float(), targets)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()  # DDP all-reduces the (scaled) gradients during backward
    if masters:
        masters.grads_to_masters()  # the optimizer (and the unscale) works on fp32 copies
    scaler.step(optimizer)  # skipped, and the scale backed off, when gradients are inf/nan
    overflow = found_inf(scaler, optimizer)
    scaler.update()
    if masters:
        masters.masters_to_params()
    return loss, overflow


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


def _require_bf16_support(policy: precision.Policy, device: torch.device) -> None:
    uses_bf16 = torch.bfloat16 in (policy.compute_dtype, policy.param_dtype) or any(
        rule.dtype == torch.bfloat16 for rule in policy.rules)
    if uses_bf16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise RuntimeError(f"precision: bfloat16 asked, but {torch.cuda.get_device_name(device)} has no bfloat16 "
                           "support. Use preset O1 or O2 (float16 with loss scaling).")


def _check_audit(audit: precision.Audit) -> list[dict[str, Any]]:
    entries = audit.close()
    problems = precision.broken_promises(entries)
    if problems:
        raise PolicyNotHonoured("precision policy not honoured: " + "; ".join(problems))
    return entries


@dataclass
class PreparedModel:
    model: nn.Module
    """What the loop calls: DDP-wrapped when there are several workers."""
    raw: nn.Module
    """The model inside DDP (for state dicts)."""
    masters: Optional[MasterWeights]
    audit: precision.Audit
    """Records the first step's output dtypes; closed by the loop."""
    params_bytes: int
    """Bytes of the parameters as stored under the policy."""

    def optimizer_params(self) -> Iterator[torch.Tensor]:
        return self.masters.optimizer_params(self.raw) if self.masters else self.model.parameters()


@torch.no_grad()
def broadcast_from_rank0(model: nn.Module) -> None:
    """Give every rank rank 0's fp32 parameters and buffers.

    DDP broadcasts rank 0's state when it wraps the model, but by then a half-precision policy has
    cast the parameters and each rank has captured fp32 masters from its own initialisation: the
    ranks' masters would differ and the ranks drift apart. So the broadcast happens here, in fp32,
    before masters are taken.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)


def prepare_model(cfg, device: torch.device, weights: Optional[dict] = None) -> PreparedModel:
    """Build the model with fp32 `weights` (after a restart), move it to the device, take rank 0's
    fp32 state, capture fp32 masters, cast layers per the precision policy, and only then let Ray
    Train wrap it in DDP."""
    policy = precision.Policy.from_config(cfg.precision)
    _require_bf16_support(policy, device)
    model = build_model(cfg.model)
    if weights is not None:
        model.load_state_dict(weights)
    model.to(device)
    broadcast_from_rank0(model)
    plans = precision.plan(model, policy)
    masters = MasterWeights(model, plans) if policy.master_weights else None
    precision.apply(model, policy, plans, device.type)
    params_bytes = sum(param_bytes_by_dtype(model).values())
    audit = precision.Audit(model, policy, plans)
    wrapped = ray.train.torch.prepare_model(model)
    return PreparedModel(wrapped, model, masters, audit, params_bytes)


def train_loop(config: dict[str, Any]) -> None:
    cfg = OmegaConf.create(config["job"])
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    seed_everything(cfg.run.seed + rank)
    amp = AmpSettings.from_config(cfg.precision)

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

    # Model under its precision policy, wrapped in DDP; the optimizer steps on fp32 masters if any.
    state = ckpt.load_state(ray.train.get_checkpoint())
    prepared = prepare_model(cfg, device, weights=state["model"] if state is not None else None)
    model, raw_model, masters, audit = prepared.model, prepared.raw, prepared.masters, prepared.audit
    optimizer = build_optimizer(cfg.optim, prepared.optimizer_params())
    scheduler = build_scheduler(cfg.optim, optimizer, total_steps)
    scaler = make_scaler(amp, device.type)
    skipped = torch.zeros((), device=device)

    # Resume after a worker-group restart: continue from the last reported epoch.
    start_epoch, global_step = 0, 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        start_epoch, global_step = state["epoch"] + 1, state["global_step"]
        skipped += state["skipped_steps"]
    pending: dict[str, Any] = {}  # non-metric results (the audit) that ride on the next report

    def common_metrics(epoch: int) -> dict[str, Any]:
        return {
            "epoch": epoch + 1, "epochs": cfg.run.epochs, "step": global_step, "total_steps": total_steps,
            "amp/loss_scale": loss_scale_of(scaler), "amp/skipped_steps": skipped.item(),
        }

    window = Window(device)
    for epoch in range(start_epoch, cfg.run.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step_in_epoch, (inputs, targets) in enumerate(train_loader):
            if step_in_epoch >= steps_per_epoch:
                break
            loss, overflow = train_step(model, inputs, targets, optimizer, scaler, amp, device, masters)
            if overflow is not None:
                skipped += overflow
            if audit is not None:  # after the first step: what each layer really stored and computed in
                pending["precision/audit"] = _check_audit(audit)
                audit = None
            if scheduler is not None:
                scheduler.step()
            global_step += 1
            window.add(loss, targets.numel())
            if global_step % cfg.tracking.log_every_n_steps == 0:
                ray.train.report({**common_metrics(epoch), **window.read(), **pending})
                pending.clear()

        # End of epoch: the rest of the window, evaluation, memory, and a checkpoint when due.
        last_epoch = epoch + 1 == cfg.run.epochs
        metrics = {**common_metrics(epoch), **pending}
        pending.clear()
        if window.samples:
            metrics.update(window.read())
        if last_epoch or (epoch + 1) % cfg.run.eval_every_n_epochs == 0:
            metrics.update(evaluate(model, eval_loader, amp, device))
        (peak,) = all_reduce([float(peak_bytes(device))], device, op=dist.ReduceOp.MAX)
        metrics.update({"memory/peak_bytes": peak, "memory/params_bytes": float(prepared.params_bytes)})

        if rank == 0 and (last_epoch or (epoch + 1) % cfg.checkpoint.every_n_epochs == 0):
            state = {
                "model": masters.fp32_state_dict(raw_model) if masters else ckpt.fp32_state_dict(raw_model),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
                "scheduler": scheduler.state_dict() if scheduler is not None else {},
                "epoch": epoch,
                "global_step": global_step,
                "skipped_steps": skipped.item(),
            }
            with ckpt.staged_checkpoint(state) as checkpoint:
                ray.train.report(metrics, checkpoint=checkpoint)
        else:
            ray.train.report(metrics)
