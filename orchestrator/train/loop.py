"""The training loop of one rank, top to bottom, without Ray.

`TrainingLoop(cfg, session)` builds everything it uses: the data shards, the newest checkpoint every
rank can read, the model under its precision with its optimizer and schedule, the loss window and the
hooks. `run()` then trains: each epoch is steps (`train_step`), a report every
`tracking.log_every_n_steps` steps and a mid-epoch checkpoint every `checkpoint.every_n_steps`, then
`end_epoch` (evaluation, the epoch's report, a checkpoint; early stopping may end the run there).

Everything else happens in hooks (`orchestrator.train.hooks`): the precision audit, the memory ledger,
the loss-scale telemetry, collapse recovery, system metrics, the replay outbox, and the job's own
`callbacks`. What belongs to the runtime is behind `Session`: where reports and checkpoints go and which
checkpoints exist to resume from. Ray Train's worker (`orchestrator.runner.worker`) is one session;
`orchestrator.train.local` runs the same loop in plain processes (tests, benchmarks).
"""

import itertools
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Protocol, Sequence

import torch
from omegaconf import OmegaConf

from orchestrator.train import rng
from orchestrator.train.callbacks import build_callbacks
from orchestrator.train.checkpoint import Candidate, dir_name, remove_stale_staging
from orchestrator.train.collectives import all_reduce
from orchestrator.train.data import build_rank_loaders
from orchestrator.train.ddp import Wrap
from orchestrator.train.evaluate import evaluate
from orchestrator.train.hooks import Hooks
from orchestrator.train.hooks.audit import PolicyAudit
from orchestrator.train.hooks.collapse import CollapseRecovery
from orchestrator.train.hooks.memory import MemoryReport
from orchestrator.train.hooks.outbox import ReplayOutbox
from orchestrator.train.hooks.scale import LossScaleTelemetry
from orchestrator.train.hooks.system import SystemMetrics
from orchestrator.train.hooks.param_groups import ParamGroupTable
from orchestrator.train.hooks.timing import TimeToFirstStep
from orchestrator.train.report import Report
from orchestrator.train.optim import should_step_schedule
from orchestrator.train.rng import seed_everything
from orchestrator.train.state import RankState, TrainState
from orchestrator.train.step import Step, accumulated_step
from orchestrator.train.stopping import EarlyStopping
from orchestrator.train.strategy import resume
from orchestrator.train.training import Training, build_training
from orchestrator.train.window import Window


class Session(Protocol):
    """What the loop needs from the runtime it runs in."""

    rank: int
    world_size: int
    device: torch.device

    def report(self, metrics: dict[str, Any], checkpoint: Optional[Path] = None,
               checkpoint_name: Optional[str] = None) -> None:
        """Hand over a report's wire form (every rank calls it), with this rank's part of a checkpoint when
        given."""

    def checkpoints(self) -> list[Candidate]:
        """The run's checkpoints to resume from, newest first ([] for a fresh run)."""

    def logged_through(self) -> Optional[int]:
        """(Rank 0) the `seq` of the newest report the driver has logged for sure, 0 when none is known; None
        when no driver can lose reports (nothing needs keeping)."""


def in_groups(batches: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """Consecutive groups of `size` batches (the micro-batches of one optimizer step); an incomplete last group
    is dropped, as `drop_last` drops a short batch."""
    iterator = iter(batches)
    while len(group := list(itertools.islice(iterator, size))) == size:
        yield group


class TrainingLoop:
    def __init__(self, cfg, session: Session, *, run_id: Optional[str] = None, launched_at: Optional[float] = None,
                 wrap: Optional[Wrap] = None, hooks: Sequence[Any] = ()):
        """`run_id`: the MLflow run (kept in checkpoints). `launched_at`: when submit began (wall clock), for
        `perf/time_to_first_step_s`. `wrap`: how the model is wrapped under DDP (default: torch's; `scaling.strategy:
        fsdp` shards it instead).
        `hooks`: more hooks (objects with hook methods, `orchestrator.train.hooks`), run after the built-in ones
        and before the job's `callbacks`."""
        self.cfg, self.session, self.run_id, self.wrap = cfg, session, run_id, wrap
        self.rank, self.world_size, self.device = session.rank, session.world_size, session.device
        remove_stale_staging()  # what a process killed while staging a checkpoint left behind
        seed_everything(cfg.run.seed + self.rank)

        # Data: every rank sees its own shard of the training set and of the eval set; an optimizer step takes
        # `run.accumulate_steps` batches of it.
        self.train_loader, self.eval_loader, self.position = build_rank_loaders(cfg, self.rank, self.world_size,
                                                                                self.device)
        self.steps_per_epoch = len(self.train_loader) // cfg.run.accumulate_steps
        if cfg.run.max_steps_per_epoch is not None:
            self.steps_per_epoch = min(self.steps_per_epoch, cfg.run.max_steps_per_epoch)
        self.total_steps = self.steps_per_epoch * cfg.run.epochs

        # The newest checkpoint every rank can read (a damaged one is skipped with a warning), and the model under
        # its precision and strategy, the optimizer, the schedule and the loss scaler, built from it.
        self.attempt = int(all_reduce([time.time() * 1000 if self.rank == 0 else 0.0], self.device)[0])
        state, self.resume_warnings, self.training = resume(cfg, session.checkpoints(), self.rank, self.world_size,
                                                            self.device, self.build)
        self.window = Window(self.device)
        stopping = cfg.run.early_stopping
        self.stopping = EarlyStopping(stopping, state.early_stopping if state else None) if stopping else None
        self.outbox = ReplayOutbox(session, self.rank, self.device)
        self.hooks = Hooks([
            SystemMetrics(cfg.tracking.system_metrics_interval_s), TimeToFirstStep(launched_at), PolicyAudit(),
            MemoryReport(), LossScaleTelemetry(), CollapseRecovery(cfg.precision.scaler.on_collapse),
            ParamGroupTable(fresh=state is None),
            *hooks, *build_callbacks(cfg.callbacks), self.outbox,  # last: it keeps every report whole
        ], self.rank)

        self.global_step, self.seq = 0, 0
        """Optimizer steps taken (skipped ones included), and reports made, in the run so far."""
        self.sample_shape: list[int] = []
        """One training input's shape (from the first batch), kept in checkpoints for the logged model."""
        self.checkpoint_report: Optional[dict[str, Any]] = None
        self.start_epoch, self.start_batches = self.resume(state)

    # -- training -----------------------------------------------------------------------------------

    def run(self) -> Training:
        """Train the rest of the run; returns what was trained. Hooks are set up first and torn down last."""
        self.hooks.call("setup", self)
        try:
            if self.checkpoint_report is not None:  # a resumed run first sends again what may not be logged
                self.session.report(self.outbox.resent(self, self.checkpoint_report, self.resume_warnings).to_wire())
            self.train()
        finally:
            self.hooks.call("teardown", self)
        return self.training

    def train(self) -> None:
        cfg = self.cfg
        for epoch in range(self.start_epoch, cfg.run.epochs):
            first = self.start_batches if epoch == self.start_epoch else 0
            self.position.set_position(epoch, first * cfg.run.accumulate_steps, cfg.run.batch_size)
            groups = in_groups(self.train_loader, cfg.run.accumulate_steps)
            for index, batches in zip(range(first, self.steps_per_epoch), groups):
                self.global_step += 1
                self.train_step(Step(self.global_step, epoch, index, batches))
                log_due = self.global_step % cfg.tracking.log_every_n_steps == 0
                if log_due or self.checkpoint_due(index):
                    report = self.new_report(epoch)
                    if log_due:
                        report.metrics.update(self.read_window())
                    self.send(report, (epoch, index + 1) if self.checkpoint_due(index) else None)
            if self.end_epoch(epoch):  # early stopping: the run ends here, finished
                break

    def train_step(self, step: Step) -> Step:
        """One optimizer step with its hooks, the schedule, the loss window and (`perf.compile`) compilation."""
        self.hooks.call("before_step", self, step)
        accumulated_step(self.training, step, self.device, lambda s: self.hooks.call("after_backward", self, s))
        self.sample_shape = self.sample_shape or list(step.batches[0][0].shape[1:])
        if self.training.scheduler is not None and should_step_schedule(step.outcome):
            self.training.scheduler.step()
        if not step.outcome.nan_loss:
            self.window.add(step.loss, step.samples)
        if step.outcome.grad_norm is not None:
            self.window.add_grad_norm(step.outcome.grad_norm)
        self.hooks.call("after_step", self, step)  # the audit closes here; collapse recovery may rebuild
        self.training.prepared.compile_when(self.training.precision.audited)  # after the audited (eager) step
        return step

    def end_epoch(self, epoch: int) -> bool:
        """The rest of the loss window, evaluation when due, the hooks' epoch metrics, and the epoch's report
        (with a checkpoint when due). Returns whether early stopping ends the run."""
        cfg = self.cfg
        last = epoch + 1 == cfg.run.epochs
        report = self.new_report(epoch)
        if self.window.samples:
            report.metrics.update(self.read_window())
        stop = False
        if last or (epoch + 1) % cfg.run.eval_every_n_epochs == 0:
            report.metrics.update(evaluate(self.training, self.eval_loader, self.device))
            stop = not last and self.stopping is not None and self.stopping.should_stop(report.metrics)
        self.hooks.call("end_epoch", self, report)
        if stop:
            report.tags["early_stopped_at_epoch"] = str(epoch + 1)
        checkpoint_due = last or stop or (epoch + 1) % cfg.checkpoint.every_n_epochs == 0
        self.send(report, (epoch, self.steps_per_epoch) if checkpoint_due else None)
        return stop

    def checkpoint_due(self, index: int) -> bool:
        """A mid-epoch checkpoint is due after step `index` of the epoch (the epoch's last step is checkpointed
        after its evaluation, by `end_epoch`)."""
        every = self.cfg.checkpoint.every_n_steps
        return every is not None and self.global_step % every == 0 and index + 1 < self.steps_per_epoch

    def read_window(self) -> dict[str, float]:
        """The loss window, reduced over all ranks and reset; a non-finite loss there fails as configured."""
        metrics = self.window.read()
        self.training.precision.guard.check_loss_window(metrics["train/loss"], self.global_step)
        return metrics

    # -- reports and checkpoints --------------------------------------------------------------------

    def new_report(self, epoch: int) -> Report:
        return Report(step=self.global_step, epoch=epoch + 1, epochs=self.cfg.run.epochs,
                      total_steps=self.total_steps,
                      metrics={"optim/lr": float(self.training.optimizer.param_groups[0]["lr"])})

    def send(self, report: Report, checkpoint_at: Optional[tuple[int, int]] = None) -> None:
        """Number the report, let every hook add to it, and hand it over; with `checkpoint_at=(epoch,
        batches_done)` every rank also stages and hands over its part of a checkpoint. The time it takes is left
        out of `perf/samples_per_s`."""
        began = time.perf_counter()
        self.seq += 1
        report.seq = self.seq
        self.hooks.call("collect", self, report)
        if checkpoint_at is None:
            self.session.report(report.to_wire())
        else:
            own = RankState(rng.capture(), self.window.state(), self.hooks.state_dicts())
            shared = None
            if self.rank == 0:  # the shared part: weights, optimizer, schedule, scaler, position
                placed = Report(seq=report.seq, step=report.step, epoch=report.epoch, epochs=report.epochs,
                                total_steps=report.total_steps, metrics=report.metrics).to_wire()
                shared = self.training.capture().at(
                    epoch=checkpoint_at[0], batches_done=checkpoint_at[1], global_step=self.global_step,
                    precision=OmegaConf.to_container(self.cfg.precision), run_id=self.run_id, report=placed,
                    rank=own, report_seq=self.seq,
                    early_stopping=self.stopping.state() if self.stopping is not None else None,
                    sample_shape=self.sample_shape).to_files()[0]
            name = dir_name(self.global_step, self.attempt)
            with self.training.strategy.staged_checkpoint(self.training.optimizer, shared, asdict(own),
                                                          self.global_step) as directory:
                self.hooks.call("on_checkpoint", self, directory, name)
                self.session.report(report.to_wire(), directory, name)
        self.window.exclude_since(began)

    # -- building and resuming ----------------------------------------------------------------------

    def build(self, state: Optional[TrainState]) -> Training:
        """The model, optimizer, schedule and precision, from `state`'s weights when given (a resume, a rollback,
        a promotion)."""
        return build_training(self.cfg, self.device, rank=self.rank, world_size=self.world_size,
                              total_steps=self.total_steps, state=state, wrap=self.wrap)

    def resume(self, state: Optional[TrainState]) -> tuple[int, int]:
        """Exactly where the checkpoint left off (position, RNG, the unreported loss window, the hooks' states);
        (0, 0) afresh. Returns (epoch, batches done in it)."""
        if state is None:
            return 0, 0
        epoch, batches_done, self.global_step = state.epoch, state.batches_done, state.global_step
        if batches_done >= self.steps_per_epoch:
            epoch, batches_done = epoch + 1, 0
        if state.rank is not None:
            rng.restore(state.rank.rng)
            self.window.load_state(state.rank.window)
            self.hooks.load_state_dicts(state.rank.hooks)
        if state.precision != OmegaConf.to_container(self.cfg.precision):
            self.resume_warnings.append("the job's precision section differs from the one the checkpoint was "
                                        "trained with.")
        self.seq, self.sample_shape = state.report_seq, list(state.sample_shape)
        self.checkpoint_report = state.report
        return epoch, batches_done
