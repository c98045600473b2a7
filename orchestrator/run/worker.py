"""The training loop every Ray Train worker runs, top to bottom.

One rank of a DDP job: build data, then the model under its precision policy, optimizer and
guarded GradScaler (`orchestrator.train.training`); train under autocast (the step: `orchestrator.train.step`);
report metrics every `tracking.log_every_n_steps` steps and at each epoch's end (with eval, memory and a checkpoint).
The controller-side tracking callback turns reports into MLflow.
"""

import time
from typing import Any

import ray.train
import ray.train.torch
import torch.distributed as dist
from omegaconf import OmegaConf

from orchestrator.train import checkpoint as ckpt
from orchestrator.train import rng
from orchestrator.train.data import build_datasets, build_device_loaders, build_loaders
from orchestrator.train.faults import Faults
from orchestrator.precision import AmpSettings
from orchestrator.train.rng import seed_everything
from orchestrator.train.step import (
    Window, after_step, all_reduce, close_audit, evaluate, memory_peaks, recover_from_collapse, train_step,
)
from orchestrator.train.training import build_training, detached_copy


def train_loop(config: dict[str, Any]) -> None:
    cfg = OmegaConf.create(config["job"])
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    seed_everything(cfg.run.seed + rank)
    amp = AmpSettings.from_config(cfg.precision)
    storage = context.get_storage()  # DeveloperAPI in Ray 2.60: where the kill fault leaves its marker
    faults = Faults(cfg.faults, rank, (storage.storage_filesystem, storage.experiment_fs_path))
    on_collapse, every_n_steps = cfg.precision.scaler.on_collapse, cfg.checkpoint.every_n_steps

    # Data: every rank sees its own shard of the training set and of the eval set.
    train_set, eval_set = build_datasets(cfg.data, cfg.model.num_classes)
    shard = dict(batch_size=cfg.run.batch_size, rank=rank, world_size=world_size, seed=cfg.run.seed)
    if cfg.data.loader == "device":  # the whole dataset on the device: batches are slices, no copies per step
        train_loader, eval_loader, position = build_device_loaders(
            train_set, eval_set, augment=cfg.data.augment, device=device, **shard)
    else:
        train_loader, eval_loader, position = build_loaders(
            train_set, eval_set, loader_workers=cfg.data.loader_workers, pin_memory=device.type == "cuda", **shard)
    steps_per_epoch = len(train_loader)
    if cfg.run.max_steps_per_epoch is not None:
        steps_per_epoch = min(steps_per_epoch, cfg.run.max_steps_per_epoch)
    total_steps = steps_per_epoch * cfg.run.epochs

    # Model under its precision policy (DDP-wrapped), optimizer, schedule and guarded scaler; after a
    # restart from the newest checkpoint every rank can read (a damaged one is skipped with a warning).
    agree = lambda ok: all_reduce([float(ok)], device, op=dist.ReduceOp.MIN)[0] == 1.0  # noqa: E731
    state, warnings = ckpt.load_newest_valid(ray.train.get_checkpoint(), rank, agree)
    build = dict(rank=rank, world_size=world_size, total_steps=total_steps)
    attempt = int(all_reduce([time.time() * 1000 if rank == 0 else 0.0], device)[0])  # rank 0's clock, for all
    training = build_training(cfg, device, state=state, **build)
    window = Window(device)
    start_epoch, batches_done, global_step = 0, 0, 0
    if state is not None:  # exactly where the checkpoint left off: position, RNG, the unreported loss window
        start_epoch, batches_done, global_step = state["epoch"], state["batches_done"], state["global_step"]
        if batches_done >= steps_per_epoch:
            start_epoch, batches_done = start_epoch + 1, 0
        if state["rank"] is not None:
            rng.restore(state["rank"]["rng"])
            window.load_state(state["rank"]["window"])
        if state["precision"] != OmegaConf.to_container(cfg.precision):
            warnings.append("the job's precision section differs from the one the checkpoint was trained with.")
    # What `on_collapse: rollback` returns to: the last checkpoint (or the start), kept on the CPU.
    last_good = detached_copy(training.capture()) if on_collapse == "rollback" else None
    pending: dict[str, Any] = {}
    if state is not None:
        # The checkpoint's own report again (logged once: the driver drops steps it already has), in case
        # the driver that died had not logged it yet; and what was skipped on the way back.
        ray.train.report({**state["report"], "warnings": warnings, "tags": {"resumed_from_step": str(global_step)}}
                         if rank == 0 else {})

    def common_metrics(epoch: int) -> dict[str, Any]:
        return {"epoch": epoch + 1, "epochs": cfg.run.epochs, "step": global_step, "total_steps": total_steps,
                **training.guard.metrics(), "amp/overflow_log": training.guard.drain_overflow_log()}

    def read_window() -> dict[str, float]:
        metrics = window.read()
        training.guard.check_loss_window(metrics["train/loss"], global_step)
        return metrics

    def report(metrics: dict[str, Any], checkpoint_at: tuple[int, int] | None = None) -> None:
        """Report; with `checkpoint_at=(epoch, batches_done)` every rank also saves its part of a checkpoint."""
        nonlocal last_good
        began = time.perf_counter()
        if checkpoint_at is None:
            ray.train.report(metrics)
            window.exclude_since(began)
            return
        shared = None
        if rank == 0 or last_good is not None:  # the other ranks need it only as a rollback snapshot
            shared = {**training.capture(), "epoch": checkpoint_at[0], "batches_done": checkpoint_at[1],
                      "global_step": global_step, "precision": OmegaConf.to_container(cfg.precision),
                      "run_id": config.get("run_id"),
                      "report": {k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}}
        if last_good is not None:
            last_good = detached_copy(shared)
        own = {"rng": rng.capture(), "window": window.state()}
        with ckpt.staged_checkpoint(rank, shared if rank == 0 else None, own, global_step) as checkpoint:
            ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=ckpt.dir_name(global_step, attempt))
        window.exclude_since(began)  # perf/samples_per_s measures training steps only

    for epoch in range(start_epoch, cfg.run.epochs):
        first = batches_done if epoch == start_epoch else 0
        position.set_position(epoch, first, cfg.run.batch_size)
        for step_in_epoch, (inputs, targets) in enumerate(train_loader, start=first):
            if step_in_epoch >= steps_per_epoch:
                break
            global_step += 1
            faults.kill(global_step)
            loss, outcome = train_step(training, inputs, targets, amp, device, global_step, faults)
            if global_step == 1 and config.get("launched_at") is not None:  # a fresh run's first step (not a restart)
                pending["perf/time_to_first_step_s"] = time.time() - config["launched_at"]
            after_step(training, loss, outcome, targets.numel(), window, pending)  # audit, schedule, loss window
            if outcome.collapse is not None:
                training, tags = recover_from_collapse(training, outcome, global_step, on_collapse, last_good,
                                                       lambda new: build_training(cfg, device, state=new, **build))
                pending.setdefault("tags", {}).update(tags)

            log_due = global_step % cfg.tracking.log_every_n_steps == 0
            # Mid-epoch checkpoints only: the epoch's last step is checkpointed after its evaluation.
            checkpoint_due = every_n_steps is not None and global_step % every_n_steps == 0 \
                and step_in_epoch + 1 < steps_per_epoch
            if log_due or checkpoint_due:
                metrics = {**common_metrics(epoch), **(read_window() if log_due else {}), **pending}
                pending.clear()
                report(metrics, (epoch, step_in_epoch + 1) if checkpoint_due else None)

        # End of epoch: the rest of the window, evaluation, memory, and a checkpoint when due.
        last_epoch = epoch + 1 == cfg.run.epochs
        metrics = {**common_metrics(epoch), **training.guard.end_epoch(), **pending}
        pending.clear()
        if window.samples:
            metrics.update(read_window())
        if last_epoch or (epoch + 1) % cfg.run.eval_every_n_epochs == 0:
            metrics.update(evaluate(training.prepared, eval_loader, amp, device))
            close_audit(training, metrics)  # a policy changed on the epoch's last step shows in eval's forward
        metrics.update(memory_peaks(rank, world_size, device))
        metrics.update({"memory/params_bytes": float(training.prepared.params_bytes), **training.ledger.metrics()})
        checkpoint_due = last_epoch or (epoch + 1) % cfg.checkpoint.every_n_epochs == 0
        report(metrics, (epoch, steps_per_epoch) if checkpoint_due else None)
