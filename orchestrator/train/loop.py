"""The training loop of one rank, top to bottom, without Ray.

`TrainingLoop(cfg, session)` builds everything it uses: the data shards, the newest checkpoint every
rank can read, the model under its precision with its optimizer and schedule, the loss window and the
hooks. `run()` then trains: each epoch is steps (`train_step`), a report every
`tracking.log_every_n_steps` steps, an evaluation every `run.eval_every_n_steps` and a mid-epoch checkpoint
every `checkpoint.every_n_steps` (each in that step's report), then `end_epoch` (evaluation, the epoch's
report, a checkpoint; early stopping may end the run there). A checkpoint is staged only once every rank found
its state finite, and an epoch whose every step was skipped ends the run failed.

Everything else happens in hooks (`orchestrator.train.hooks`): the precision audit, the memory ledger,
the loss-scale telemetry, collapse recovery, system metrics, the replay outbox, and the job's own
`callbacks`. What belongs to the runtime is behind `Session`: where reports and checkpoints go and which
checkpoints exist to resume from. Ray Train's worker (`orchestrator.runner.worker`) is one session;
`orchestrator.train.local` runs the same loop in plain processes (tests, benchmarks).
"""

import itertools
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Protocol, Sequence

import torch
from omegaconf import OmegaConf

from orchestrator.precision import NothingTrained
from orchestrator.train import rng
from orchestrator.train.batch import InputExample
from orchestrator.train.callbacks import build_callbacks
from orchestrator.train.clock import WindowClock
from orchestrator.checkpoint.checkpointer import Checkpointer, Saved
from orchestrator.checkpoint.files import Candidate, NonFiniteState, remove_stale_staging
from orchestrator.train.collectives import all_agree, all_gather, all_reduce
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
from orchestrator.train.hooks.throughput import Throughput
from orchestrator.train.hooks.timing import TimeToFirstStep
from orchestrator.train.hooks.watchdog import Watchdog
from orchestrator.common.report import Report, checkpoint_score
from orchestrator.train.preemption import Preempted, PreemptionCheck
from orchestrator.config.job import Job
from orchestrator.checkpoint.resume import CheckpointFacts, Resumed, check_resume
from orchestrator.train.rng import seed_everything
from orchestrator.checkpoint.state import RankState, TrainState
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

    def write_diagnostic(self, relative_path: str, text: str) -> None:
        """Write a text file at `relative_path` in the run's storage, where the driver collects it (the
        watchdog's stacks); called from another thread while the training thread may be stuck."""


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
        # Both loaders walk a DistributedSampler over the training set (an elastic run: `ElasticSampler`).
        self.layout = Job.of(cfg).layout(len(self.position.dataset), self.world_size)
        self.steps_per_epoch = self.layout.steps_per_epoch

        # The newest checkpoint every rank can read (a damaged one is skipped with a warning), where it goes on
        # under this job (or IncompatibleResume), and the model under its precision and strategy, the optimizer,
        # the schedule and the loss scaler, built from it (`build_resumed`).
        self.total_steps, self.resumed = self.layout.total_steps, None
        self.attempt = int(all_reduce([time.time() * 1000 if self.rank == 0 else 0.0], self.device)[0])
        self.checkpointer = Checkpointer(session.checkpoints, self.attempt)
        state, self.resume_warnings, self.training = self.checkpointer.load(
            lambda candidates: resume(cfg, candidates, self.rank, self.world_size, self.device, self.build_resumed))
        self.window = Window(self.device)
        self.clock = WindowClock(self.device)
        stopping = cfg.run.early_stopping
        self.stopping = EarlyStopping(stopping, state.early_stopping if state else None) if stopping else None
        self.outbox = ReplayOutbox(session, self.rank, self.device)
        self.hooks = Hooks([
            Watchdog(cfg.failure.step_timeout_s),  # first: it is set up first and stopped first
            *([PreemptionCheck()] if cfg.failure.preemption_grace_s is not None else []),
            Throughput(cfg.perf.peak_tflops),  # early: its FLOP counter wraps no other hook's work of step 1
            SystemMetrics(cfg.tracking.system_metrics_interval_s), TimeToFirstStep(launched_at), PolicyAudit(),
            MemoryReport(), LossScaleTelemetry(), CollapseRecovery(cfg.precision.scaler.on_collapse),
            ParamGroupTable(fresh=state is None),
            *hooks, *build_callbacks(cfg.callbacks), self.outbox,  # last: it keeps every report whole
        ], self.rank)

        self.global_step, self.seq = 0, 0
        """Optimizer steps taken (skipped ones included), and reports made, in the run so far."""
        self.preempted = False
        """A rank got a preemption notice (`orchestrator.train.preemption`): checkpoint at this step boundary and
        end the attempt."""
        self.input_example = InputExample()
        """The first batch's inputs and the dims that vary between batches, kept in checkpoints for the logged
        model's signature and example."""
        self.checkpoint_report: Optional[dict[str, Any]] = None
        self.start_epoch, self.start_batches = self.resume(state, self.resumed)

    # -- training -----------------------------------------------------------------------------------

    def run(self) -> Training:
        """Train the rest of the run; returns what was trained. Hooks are set up first and torn down last."""
        self.hooks.call("setup", self)
        try:
            if self.checkpoint_report is not None:  # a resumed run first sends again what may not be logged
                self.session.report(self.outbox.resent(self, self.checkpoint_report, self.resume_warnings).to_wire())
            self.train()
        except BaseException:
            self.hooks.call_every("teardown", self)  # every hook's; the error that ended training is raised
            raise
        self.hooks.call("teardown", self)
        return self.training

    def train(self) -> None:
        cfg = self.cfg
        self.clock.reset()  # the first window's time starts with training
        for epoch in range(self.start_epoch, cfg.run.epochs):
            first = self.start_batches if epoch == self.start_epoch else 0
            micro_batches = self.layout.micro_batches  # run.accumulate_steps; elastic: as the world size has it
            self.position.set_position(epoch, first * micro_batches, cfg.run.batch_size)
            groups = self.clock.batches(in_groups(self.train_loader, micro_batches))
            for index, batches in zip(range(first, self.steps_per_epoch), groups):
                self.global_step += 1
                log_due = self.global_step % cfg.tracking.log_every_n_steps == 0
                eval_due = self.due_mid_epoch(cfg.run.eval_every_n_steps, index)
                mid_epoch = index + 1 < self.steps_per_epoch
                checkpoint_due = self.due_mid_epoch(cfg.checkpoint.every_n_steps, index)
                self.train_step(Step(self.global_step, epoch, index, batches, self.loss_weights(batches)),
                                settle=log_due or eval_due or checkpoint_due or not mid_epoch)
                if self.preempted and mid_epoch:  # a notice reached a rank: checkpoint at this step boundary
                    self.training.precision.settle()
                    checkpoint_due = True
                if log_due or eval_due or checkpoint_due:
                    report = self.new_report(epoch)
                    if log_due:
                        report.metrics.update(self.read_window())
                    if eval_due:
                        report.metrics.update(self.evaluation())
                    self.send(report, (epoch, index + 1) if checkpoint_due else None)
                if self.preempted and mid_epoch:
                    raise self.preemption()
            if self.end_epoch(epoch):  # early stopping: the run ends here, finished
                break
            if self.preempted and epoch + 1 < cfg.run.epochs:  # the epoch's end checkpointed (end_epoch)
                raise self.preemption()

    def loss_weights(self, batches: list) -> Optional[list[float]]:
        """An elastic run's micro-batches of unequal sizes: each one's share of the global batch, times the world
        size (DDP and FSDP average over the ranks); None when every rank's are all equal (each loss is divided by
        their number)."""
        global_batch = self.layout.global_batch
        if global_batch is None or global_batch % (self.world_size * self.layout.micro_batches) == 0:
            return None
        return [batch.size * self.world_size / global_batch for batch in batches]

    def preemption(self) -> Preempted:
        return Preempted(f"a preemption notice (SIGTERM) reached a rank: checkpointed at step {self.global_step}; "
                         "the attempt ends so that Ray Train restarts it from there (failure.max_failures)")

    def train_step(self, step: Step, settle: bool = False) -> Step:
        """One optimizer step with its hooks, the loss window and (`perf.compile`) compilation. The step's flags are
        read on the host when they have arrived (on the CPU at once), or before the next step's update; `settle`:
        now, waiting for them (a report or the epoch's end follows). The schedule steps as they are read."""
        self.hooks.call("before_step", self, step)
        with self.clock.step():
            accumulated_step(self.training, step, self.device, lambda s: self.hooks.call("after_backward", self, s))
        for batch in step.batches:
            self.input_example.observe(batch)
        outcome = step.outcome
        self.window.add(step.loss, step.samples, counted=outcome.loss_counted)  # not a loss that was not finite
        if outcome.norm is not None:
            self.window.add_grad_norm(outcome.norm, taken=outcome.taken)  # only a taken step's
        if settle:
            self.training.precision.settle()
        self.hooks.call("after_step", self, step)  # the audit closes here; collapse recovery may rebuild
        self.training.prepared.compile_when(self.training.precision.audited)  # after the audited (eager) step
        return step

    def end_epoch(self, epoch: int) -> bool:
        """The rest of the loss window, evaluation when due, the hooks' epoch metrics, and the epoch's report
        (with a checkpoint when due). Returns whether early stopping ends the run."""
        cfg = self.cfg
        last = epoch + 1 == cfg.run.epochs
        self.training.precision.settle()
        report = self.new_report(epoch)
        if self.window.samples:
            report.metrics.update(self.read_window(only_counted=True))
        stop = False
        every_n_steps = cfg.run.eval_every_n_steps
        if (last or (epoch + 1) % cfg.run.eval_every_n_epochs == 0
                or (every_n_steps is not None and self.global_step % every_n_steps == 0)):
            report.metrics.update(self.evaluation())
            stop = not last and self.stopping is not None and self.stopping.should_stop(report.metrics)
        nothing_trained = self.training.precision.guard.nothing_trained(epoch + 1)  # before the hooks reset it
        if stop:
            report.tags["early_stopped_at_epoch"] = str(epoch + 1)
        self.hooks.call("end_epoch", self, report)  # the run's last report: the last epoch's, or tagged as above
        if nothing_trained is not None:  # the epoch's report goes out; the run cannot end as if it had trained
            self.send(report)
            raise NothingTrained(nothing_trained)
        checkpoint_due = last or stop or self.preempted or (epoch + 1) % cfg.checkpoint.every_n_epochs == 0
        self.send(report, (epoch, self.steps_per_epoch) if checkpoint_due else None)
        return stop

    def due_mid_epoch(self, every: Optional[int], index: int) -> bool:
        """Whether something done `every` N steps (a checkpoint, an evaluation) is due after step `index` of the
        epoch; never after its last step: `end_epoch` does it there."""
        return every is not None and self.global_step % every == 0 and index + 1 < self.steps_per_epoch

    def evaluation(self) -> dict[str, float]:
        """`eval/*` over every rank's shard of the eval set; its time is left out of `perf/samples_per_s`."""
        began = time.perf_counter()
        with self.clock.part("eval"):
            metrics = evaluate(self.training, self.eval_loader, self.device)
        self.window.exclude_since(began)
        return metrics

    def read_window(self, only_counted: bool = False) -> dict[str, float]:
        """The loss window, reduced over all ranks and reset (each step's loss was checked at its step), and where
        its wall time went (`time/*`, `orchestrator.train.clock`); `only_counted`: no loss and no throughput when no
        step since the last read had a finite loss."""
        with self.clock.part("comm"):
            metrics = self.window.read(only_counted)
        times = self.clock.read()
        if "perf/samples_per_s" in metrics:  # every second of the window counted, checkpoints and evaluation too
            metrics["perf/samples_per_s_wall"] = self.window.read_samples / max(sum(times.values()), 1e-9)
        return {**metrics, **times}

    # -- reports and checkpoints --------------------------------------------------------------------

    def new_report(self, epoch: int) -> Report:
        """A report made now (`at`: where its window's time ends, for the driver's goodput)."""
        return Report(step=self.global_step, epoch=epoch + 1, epochs=self.cfg.run.epochs, at=time.time(),
                      total_steps=self.total_steps,
                      metrics={"optim/lr": float(self.training.optimizer.param_groups[0]["lr"]),
                               "system/world_size": float(self.world_size)})

    def send(self, report: Report, checkpoint_at: Optional[tuple[int, int]] = None) -> None:
        """`hand_over`, its time counted as the checkpoint's when there is one, else as the report's exchange."""
        with self.clock.part("checkpoint" if checkpoint_at is not None else "comm"):
            self.hand_over(report, checkpoint_at)

    def hand_over(self, report: Report, checkpoint_at: Optional[tuple[int, int]] = None) -> None:
        """Number the report, let every hook add to it, and hand it over; with `checkpoint_at=(epoch,
        batches_done)` every rank also stages and hands over its part of a checkpoint, once every rank found its
        state finite: else the report goes alone and NonFiniteState is raised on every rank. The time it takes
        is left out of `perf/samples_per_s`."""
        began = time.perf_counter()
        not_finite = self.nonfinite_state() if checkpoint_at is not None else None
        self.seq += 1
        report.seq = self.seq
        self.hooks.call("collect", self, report)
        score = self.cfg.checkpoint.score_metric
        if checkpoint_at is not None and score is not None:
            report.checkpoint_score = checkpoint_score(report.metrics, score, self.cfg.checkpoint.score_mode)
        if checkpoint_at is None or not_finite is not None:
            self.session.report(report.to_wire())
        else:
            self.checkpointer.save(self.global_step, self.saved_state(report, checkpoint_at),
                                   self.training.strategy.checkpoint_format(self.training.optimizer),
                                   lambda directory, name: self.publish(report, directory, name))
        self.window.exclude_since(began)
        if not_finite is not None:
            raise NonFiniteState(
                f"the train state is not finite at step {self.global_step} ({not_finite}), so no checkpoint was "
                "written: the newest checkpoint is still the newest finite one. Look at amp/overflow_log.json for "
                "the steps before; set precision.on_nonfinite_grads: skip (the default), lower optim.lr, clip "
                "(optim.clip_grad_norm) or keep the layer named in fp32 (precision.rules).")

    def saved_state(self, report: Report, checkpoint_at: tuple[int, int]) -> Saved:
        """This rank's part of the checkpoint made with `report` at `checkpoint_at=(epoch, batches_done)`: its RNG,
        loss window and hooks' states; on rank 0 also the shared train state (weights, optimizer, schedule, scaler,
        position, layout) and its facts."""
        own = RankState(rng.capture(), self.window.state(), self.hooks.state_dicts())
        if self.rank != 0:
            return Saved.of(own)
        state = self.training.capture().at(
            epoch=checkpoint_at[0], batches_done=checkpoint_at[1], global_step=self.global_step,
            precision=OmegaConf.to_container(self.cfg.precision), run_id=self.run_id, report=report.metrics_only(),
            rank=own, report_seq=self.seq, early_stopping=self.stopping.state() if self.stopping is not None else None,
            sample_shape=self.input_example.sample_shape(), input_example=self.input_example.state(),
            layout=self.layout.to_dict())
        return Saved.of(own, state, self.training.model_shapes())

    def publish(self, report: Report, directory: Path, name: str) -> None:
        """Hand a staged checkpoint over with its report (the hooks see it first)."""
        self.hooks.call("on_checkpoint", self, directory, name)
        self.session.report(report.to_wire(), directory, name)

    def nonfinite_state(self) -> Optional[str]:
        """What is not finite where, on any rank, in what a checkpoint would hold (weights, masters, optimizer
        state); None when every rank's is finite. A collective: every rank calls it at the same point."""
        problem = self.training.first_nonfinite()
        if all_agree(problem is None, self.device):
            return None
        return "; ".join(f"rank {rank}: {what}" for rank, what in enumerate(all_gather(problem, self.world_size))
                         if what)

    # -- building and resuming ----------------------------------------------------------------------

    def build(self, state: Optional[TrainState]) -> Training:
        """The model, optimizer, schedule and precision, from `state`'s weights when given (a resume, a rollback,
        a promotion)."""
        return build_training(self.cfg, self.device, rank=self.rank, world_size=self.world_size,
                              total_steps=self.total_steps, state=state, wrap=self.wrap)

    def build_resumed(self, state: Optional[TrainState]) -> Training:
        """`build` for the run's start: first where `state` (the checkpoint resumed, None afresh) goes on under this
        job, or IncompatibleResume; that decides the run's total steps, which the schedule is built for."""
        job = Job.of(self.cfg).layout(self.layout.train_samples, self.world_size)
        self.resumed = check_resume(CheckpointFacts.of_state(state), job, f"the checkpoint of step "
                                    f"{state.global_step}") if state is not None else None
        self.total_steps = self.resumed.total_steps if self.resumed is not None else job.total_steps
        self.layout = replace(job, total_steps=self.total_steps)
        return self.build(state)

    def resume(self, state: Optional[TrainState], resumed: Optional[Resumed]) -> tuple[int, int]:
        """Exactly where the checkpoint left off (position as `check_resume` placed it under this job, RNG, the
        unreported loss window, the hooks' states); (0, 0) afresh. Returns (epoch, batches done in it)."""
        if state is None or resumed is None:
            return 0, 0
        epoch, batches_done, self.global_step = resumed.epoch, resumed.batches_done, state.global_step
        if state.rank is not None:
            rng.restore(state.rank.rng)
            self.window.load_state(state.rank.window)
            self.hooks.load_state_dicts(state.rank.hooks)
        if state.precision != OmegaConf.to_container(self.cfg.precision):
            self.resume_warnings.append("the job's precision section differs from the one the checkpoint was "
                                        "trained with.")
        self.seq, self.input_example = state.report_seq, InputExample(state.input_example)
        self.checkpoint_report = state.report
        return epoch, batches_done
