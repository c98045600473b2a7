"""The training loop of one rank, top to bottom, without Ray.

Build the data, restore the newest checkpoint every rank can read, build the model under its
precision, then for each epoch: steps (`accumulated_step` + `after_step`, each over
`run.accumulate_steps` batches), a report every `tracking.log_every_n_steps` steps, a mid-epoch
checkpoint every `checkpoint.every_n_steps`, and at the epoch's end evaluation, memory peaks and a
checkpoint; early stopping ends the run after an evaluation that did not improve for its patience.
A collapsed loss scale is acted on as `precision.scaler.on_collapse` says.

What belongs to the runtime is behind `Session`: where reports and checkpoints go, which checkpoints
exist to resume from, where faults leave their markers. Ray Train's worker (`orchestrator.runner.worker`)
is one session; `orchestrator.train.local` runs the same loop in plain processes (tests, benchmarks).
"""

import itertools
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Protocol

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from orchestrator.train import rng
from orchestrator.train.checkpoint import (
    Candidate, dir_name, load_newest_valid, remove_stale_staging, staged_checkpoint,
)
from orchestrator.train.data import build_rank_loaders
from orchestrator.train.faults import Faults
from orchestrator.train.rng import seed_everything
from orchestrator.train.state import RankState, TrainState
from orchestrator.train.step import (
    OVERFLOW_LOG, Window, accumulated_step, after_step, all_reduce, close_audit, evaluate, memory_peaks,
    read_window, recover_from_collapse, scale_telemetry,
)
from orchestrator.train.stopping import EarlyStopping
from orchestrator.train.system import SYSTEM_SAMPLES, start_sampler
from orchestrator.train.training import Training, Wrap, build_training


class Session(Protocol):
    """What the loop needs from the runtime it runs in."""

    rank: int
    world_size: int
    device: torch.device

    def report(self, metrics: dict[str, Any], checkpoint: Optional[Path] = None,
               checkpoint_name: Optional[str] = None) -> None:
        """Hand over a report (every rank calls it), with this rank's part of a checkpoint when given."""

    def checkpoints(self) -> list[Candidate]:
        """The run's checkpoints to resume from, newest first ([] for a fresh run)."""

    def fault_marker_dir(self) -> Optional[tuple[Any, str]]:
        """(pyarrow filesystem, directory) where `faults.once` leaves its marker; None: no marker."""

    def logged_through(self) -> Optional[int]:
        """(Rank 0) the `seq` of the newest report the driver has logged for sure, 0 when none is known; None
        when no driver can lose reports (nothing needs keeping)."""


MAX_UNLOGGED = 1000
"""Most reports a rank keeps for a resumed run to send again (a driver cut off from MLflow for that long loses
the oldest of them if it dies too)."""


def in_groups(batches: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """Consecutive groups of `size` batches (the micro-batches of one optimizer step); an incomplete last group
    is dropped, as `drop_last` drops a short batch."""
    iterator = iter(batches)
    while len(group := list(itertools.islice(iterator, size))) == size:
        yield group


def scalars(metrics: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in metrics.items() if isinstance(value, (int, float, str))}


def kept_for_replay(metrics: dict[str, Any], rank: int) -> Optional[dict[str, Any]]:
    """What of a report a rank keeps until the driver has logged it: rank 0 its report (the one the driver
    logs), every rank its overflow records and system samples (the driver merges all ranks'); warnings are not
    repeated."""
    if rank == 0:
        kept = {key: value for key, value in metrics.items() if key != "warnings"}
    elif metrics.get(OVERFLOW_LOG) or metrics.get(SYSTEM_SAMPLES):
        kept = {key: metrics[key] for key in ("seq", OVERFLOW_LOG, SYSTEM_SAMPLES) if metrics.get(key)}
    else:
        return None
    # Plain numbers, strings, lists and dicts only: the checkpoint loads with torch.load(weights_only=True).
    return json.loads(json.dumps(kept, default=float))


class TrainingLoop:
    def __init__(self, cfg, session: Session, *, run_id: Optional[str] = None, launched_at: Optional[float] = None,
                 wrap: Optional[Wrap] = None):
        """`run_id`: the MLflow run (kept in checkpoints). `launched_at`: when submit began (wall clock), for
        `perf/time_to_first_step_s`. `wrap`: how the model is wrapped for data parallelism (default: DDP)."""
        self.cfg, self.session, self.run_id, self.launched_at, self.wrap = cfg, session, run_id, launched_at, wrap
        self.rank, self.world_size, self.device = session.rank, session.world_size, session.device
        self.pending: dict[str, Any] = {}
        """Metrics, tables and tags for the next report."""
        self.global_step = 0
        self.sample_shape: list[int] = []
        """One training input's shape (from the first batch), kept in checkpoints for the logged model."""
        self.seq = 0
        """Reports made so far in the run (every rank counts them alike; resumed from the checkpoint)."""
        self.unlogged: list[dict[str, Any]] = []
        """This rank's reports the driver may not have logged yet (`kept_for_replay`), oldest first."""

    def run(self) -> Training:
        self.sampler = start_sampler(self.rank, self.device, self.cfg.tracking.system_metrics_interval_s)
        try:
            return self.train()
        finally:
            if self.sampler is not None:
                self.sampler.stop()

    def train(self) -> Training:
        cfg, rank, device = self.cfg, self.rank, self.device
        remove_stale_staging()  # what a process killed while staging a checkpoint left behind
        seed_everything(cfg.run.seed + rank)
        faults = Faults(cfg.faults, rank, self.session.fault_marker_dir())
        on_collapse, every_n_steps = cfg.precision.scaler.on_collapse, cfg.checkpoint.every_n_steps

        # Data: every rank sees its own shard of the training set and of the eval set; an optimizer step takes
        # `run.accumulate_steps` batches of it.
        train_loader, eval_loader, position = build_rank_loaders(cfg, rank, self.world_size, device)
        accumulate = cfg.run.accumulate_steps
        self.steps_per_epoch = len(train_loader) // accumulate
        if cfg.run.max_steps_per_epoch is not None:
            self.steps_per_epoch = min(self.steps_per_epoch, cfg.run.max_steps_per_epoch)
        self.total_steps = self.steps_per_epoch * cfg.run.epochs

        # The newest checkpoint every rank can read (a damaged one is skipped with a warning), then the model
        # under its precision, the optimizer, the schedule and the loss scaler, built from it.
        agree = lambda ok: all_reduce([float(ok)], device, op=dist.ReduceOp.MIN)[0] == 1.0  # noqa: E731
        state, warnings = load_newest_valid(self.session.checkpoints(), rank, agree)
        self.attempt = int(all_reduce([time.time() * 1000 if rank == 0 else 0.0], device)[0])  # rank 0's clock
        self.training = self.build(state)
        self.window = Window(device)
        start_epoch, batches_done = self.resume_position(state, warnings)
        stopping = cfg.run.early_stopping
        self.stopping = EarlyStopping(stopping, state.early_stopping if state else None) if stopping else None
        # What `on_collapse: rollback` returns to: the last checkpoint (or the start), kept on the CPU.
        self.last_good = self.training.capture().detached() if on_collapse == "rollback" else None

        for epoch in range(start_epoch, cfg.run.epochs):
            first = batches_done if epoch == start_epoch else 0
            position.set_position(epoch, first * accumulate, cfg.run.batch_size)
            for step_in_epoch, micro_batches in enumerate(in_groups(train_loader, accumulate), start=first):
                if step_in_epoch >= self.steps_per_epoch:
                    break
                self.global_step += 1
                if self.sampler is not None:
                    self.sampler.step = self.global_step
                faults.kill(self.global_step)
                loss, outcome = accumulated_step(self.training, micro_batches, device, self.global_step, faults)
                if self.global_step == 1 and self.launched_at is not None:  # a fresh run's first step
                    self.pending["perf/time_to_first_step_s"] = time.time() - self.launched_at
                samples = sum(targets.shape[0] for _, targets in micro_batches)
                self.sample_shape = self.sample_shape or list(micro_batches[0][0].shape[1:])
                after_step(self.training, loss, outcome, samples, self.window, self.pending)
                if outcome.collapse is not None:
                    self.training, tags = recover_from_collapse(self.training, outcome, self.global_step, on_collapse,
                                                                self.last_good, self.build)
                    self.pending.setdefault("tags", {}).update(tags)

                log_due = self.global_step % cfg.tracking.log_every_n_steps == 0
                # Mid-epoch checkpoints only: the epoch's last step is checkpointed after its evaluation.
                checkpoint_due = every_n_steps is not None and self.global_step % every_n_steps == 0 \
                    and step_in_epoch + 1 < self.steps_per_epoch
                if log_due or checkpoint_due:
                    metrics = {**self.progress(epoch),
                               **(read_window(self.training, self.window, self.global_step) if log_due else {})}
                    self.report(metrics, (epoch, step_in_epoch + 1) if checkpoint_due else None)

            # End of epoch: the rest of the window, evaluation, memory, and a checkpoint when due.
            last_epoch = epoch + 1 == cfg.run.epochs
            metrics = {**self.progress(epoch), **self.training.precision.guard.end_epoch()}
            if self.window.samples:
                metrics.update(read_window(self.training, self.window, self.global_step))
            stop = False
            if last_epoch or (epoch + 1) % cfg.run.eval_every_n_epochs == 0:
                metrics.update(evaluate(self.training, eval_loader, device))
                close_audit(self.training, metrics)  # a policy changed on the epoch's last step shows in eval
                stop = not last_epoch and self.stopping is not None and self.stopping.should_stop(metrics)
            metrics.update(memory_peaks(rank, self.world_size, device))
            metrics.update({"memory/params_bytes": float(self.training.prepared.params_bytes),
                            **self.training.precision.ledger.metrics()})
            if stop:
                metrics["tags"] = {**metrics.get("tags", {}), "early_stopped_at_epoch": str(epoch + 1)}
            checkpoint_due = last_epoch or stop or (epoch + 1) % cfg.checkpoint.every_n_epochs == 0
            self.report(metrics, (epoch, self.steps_per_epoch) if checkpoint_due else None)
            if stop:  # the metric stopped improving: the run ends here, finished
                break
        return self.training

    # -- building and resuming ----------------------------------------------------------------------

    def build(self, state: Optional[TrainState]) -> Training:
        return build_training(self.cfg, self.device, rank=self.rank, world_size=self.world_size,
                              total_steps=self.total_steps, state=state, wrap=self.wrap)

    def resume_position(self, state: Optional[TrainState], warnings: list[str]) -> tuple[int, int]:
        """Exactly where the checkpoint left off (position, RNG, the unreported loss window); (0, 0) afresh.

        The checkpoint's own report is sent again (logged once: the driver drops steps it already has), in
        case the driver that died had not logged it yet; and what was skipped on the way back.
        """
        if state is None:
            return 0, 0
        epoch, batches_done, self.global_step = state.epoch, state.batches_done, state.global_step
        if batches_done >= self.steps_per_epoch:
            epoch, batches_done = epoch + 1, 0
        if state.rank is not None:
            rng.restore(state.rank.rng)
            self.window.load_state(state.rank.window)
        if state.precision != OmegaConf.to_container(self.cfg.precision):
            warnings.append("the job's precision section differs from the one the checkpoint was trained with.")
        # The reports the driver may not have logged before it died, in order, then the checkpoint's own.
        self.seq, self.sample_shape = state.report_seq, list(state.sample_shape)
        self.unlogged = list(state.rank.unlogged) if state.rank is not None else []
        resent = {}
        for key in (OVERFLOW_LOG, SYSTEM_SAMPLES):  # every rank's: the relay callback gathers them
            if records := [record for kept in self.unlogged for record in kept.get(key, [])]:
                resent[key] = records
        if self.rank == 0:
            replay = [{k: v for k, v in kept.items() if k not in (OVERFLOW_LOG, SYSTEM_SAMPLES)}
                      for kept in self.unlogged]
            resent.update({**state.report, "replay": replay, "warnings": warnings,
                           "tags": {"resumed_from_step": str(self.global_step)}})
        self.session.report(resent)
        return epoch, batches_done

    # -- reports ------------------------------------------------------------------------------------

    def progress(self, epoch: int) -> dict[str, Any]:
        """Where the run is, the loss-scale telemetry, and whatever is pending (taken now)."""
        metrics = {"epoch": epoch + 1, "epochs": self.cfg.run.epochs, "step": self.global_step,
                   "total_steps": self.total_steps, "optim/lr": float(self.training.optimizer.param_groups[0]["lr"]),
                   **scale_telemetry(self.training), **self.pending}
        self.pending = {}
        return metrics

    def report(self, metrics: dict[str, Any], checkpoint_at: Optional[tuple[int, int]] = None) -> None:
        """Report; with `checkpoint_at=(epoch, batches_done)` every rank also saves its part of a checkpoint.
        The time it takes is left out of `perf/samples_per_s`."""
        began = time.perf_counter()
        self.seq += 1
        metrics = {**metrics, "seq": self.seq}
        if self.sampler is not None and (samples := self.sampler.take()):
            metrics[SYSTEM_SAMPLES] = samples
        kept = kept_for_replay(metrics, self.rank)
        if kept is not None:
            self.unlogged = [*self.unlogged, kept][-MAX_UNLOGGED:]
        if checkpoint_at is None:
            self.session.report(metrics)
        else:
            self.forget_logged()
            own = RankState(rng.capture(), self.window.state(), self.unlogged)
            state = None
            if self.rank == 0 or self.last_good is not None:  # other ranks need it only as a rollback snapshot
                state = self.training.capture().at(
                    epoch=checkpoint_at[0], batches_done=checkpoint_at[1], global_step=self.global_step,
                    precision=OmegaConf.to_container(self.cfg.precision), run_id=self.run_id,
                    report=scalars(metrics), rank=own, report_seq=self.seq,
                    early_stopping=self.stopping.state() if self.stopping is not None else None,
                    sample_shape=self.sample_shape)
            if self.last_good is not None:
                self.last_good = state.detached()
            shared = state.to_files()[0] if self.rank == 0 else None
            with staged_checkpoint(self.rank, shared, asdict(own), self.global_step) as directory:
                self.session.report(metrics, directory, dir_name(self.global_step, self.attempt))
        self.window.exclude_since(began)

    def forget_logged(self) -> None:
        """Drop the kept reports the driver has logged (rank 0 asks, every rank hears the same answer)."""
        logged = self.session.logged_through() if self.rank == 0 else 0
        logged = all_reduce([-1.0 if logged is None else float(logged)], self.device)[0]
        self.unlogged = [] if logged < 0 else [kept for kept in self.unlogged if kept["seq"] > logged]
