"""The optimizer step, under a GradScaler or not, agreed by every rank, decided on the device, read late.

`GuardedScaler.step()` replaces `scaler.step(); scaler.update()` (and a bare `optimizer.step()`):

1. find non-finite gradients on this rank: `unscale_()` does it, with a scale of 1 (`PassThroughScaler`) when no
   loss scaling runs (fp32, bf16);
2. all-reduce one small vector holding every rank's found-inf flag and non-finite-loss flag, never read on the
   host in the step: the skip is written into GradScaler's found-inf flags, so `scaler.step()` skips (after its
   own check, the one sync a hand-written torch.amp loop makes; none with a fused optimizer, which takes the flag
   into its kernel) and `update()` backs off, identically on every rank. A non-finite loss skips without moving
   the scale (`precision.scaler.on_nan_loss: skip`; with `abort` the step is skipped too, and the run fails when
   the flags are read); without a scaler, non-finite gradients are skipped, fail the run (skipped meanwhile) or
   are only counted (`precision.on_nonfinite_grads`);
3. copy the vector (and the scale it ran at) without blocking to the host (`orchestrator.precision.step_outcome`) and
   read it late: at once where the step waited anyway, else before the next optimizer step, or at the next
   report, checkpoint or epoch end (`settle`). Reading it keeps the telemetry (`amp/*` metrics), the overflow log
   and the collapse guardrails exactly as if it were read in the step: every skipped step, whatever the reason,
   counts toward `max_consecutive_skips`.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from orchestrator.precision.amp import AmpSettings
from orchestrator.precision.step_outcome import (  # noqa: F401 (re-exported)
    HostCopy, Pending, StepOutcome, first_nonfinite)
from orchestrator.precision.scaler import PassThroughScaler, make_scaler


class LossScaleCollapsed(RuntimeError):
    """The loss scale collapsed and `precision.scaler.on_collapse` is `abort`."""


class NonFiniteLoss(RuntimeError):
    """The loss was not finite and `precision.scaler.on_nan_loss` is `abort`."""


class NonFiniteGradients(RuntimeError):
    """Without a GradScaler, a gradient was not finite and `precision.on_nonfinite_grads` is `fail`."""


class NothingTrained(RuntimeError):
    """Every optimizer step of an epoch was skipped: the run cannot end as if it had trained."""


def clip(optimizer: torch.optim.Optimizer, max_norm: Optional[float]) -> Optional[torch.Tensor]:
    """Clip the optimizer's gradients to total norm `max_norm` (None: no clipping); the norm before clipping,
    left on the device (reading it would wait for the GPU every step). Gradients whose norm is not finite are
    left as they are: such a step is skipped (decided on the device), and its overflow record reads them."""
    if max_norm is None:
        return None
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.where(torch.isfinite(norm), norm, 0.0))
    return norm.detach()


@dataclass
class Counters:
    """Cumulative over the run (restored from checkpoints)."""

    skipped_steps: int = 0
    consecutive_skips: int = 0
    growth_events: int = 0
    rank_disagreements: int = 0
    nan_loss_steps: int = 0
    nonfinite_grad_steps: int = 0
    """Steps without a scaler whose gradients were not finite on some rank (`amp/nonfinite_grad_steps`)."""
    clean_streak: int = 0
    """Clean steps since the last growth or backoff: mirrors GradScaler's growth tracker on the host."""
    epoch_steps: int = 0
    epoch_skipped: int = 0


def _ranks(flags: Sequence[float]) -> list[int]:
    return [rank for rank, flag in enumerate(flags) if flag]


@dataclass
class GuardedScaler:
    amp: AmpSettings
    guard: Any
    """The `precision.scaler` section."""
    device: torch.device
    rank: int = 0
    world_size: int = 1
    counters: Counters = field(default_factory=Counters)
    enabled: Optional[bool] = None
    """Whether a GradScaler runs (`Policy.scaler_enabled`); None: for fp16 autocast, as AmpSettings says."""
    on_nonfinite_grads: str = "skip"
    """`precision.on_nonfinite_grads`: what non-finite gradients do when no GradScaler runs."""

    def __post_init__(self) -> None:
        self.scaler = make_scaler(self.amp, self.device.type, self.enabled)
        self.dynamic = self.scaler.is_enabled() and self.amp.loss_scale == "dynamic"
        self.skipper = self.scaler if self.scaler.is_enabled() else PassThroughScaler(self.device.type)
        """What checks the gradients and skips a step on the device: the loss scaler, or a scale of 1 without one."""
        self.overflow_log: list[dict[str, Any]] = []
        """Records not yet reported (drained by `drain_overflow_log`)."""
        self.warned_steps: list[int] = []
        """Steps taken with non-finite gradients (`on_nonfinite_grads: warn`) not reported yet."""
        self.streak_layers: list[str] = []
        """Layers found overflowing during the current run of consecutive skips."""
        self.pending: list[Pending] = []
        """Steps whose flags have not been read on the host yet, oldest first."""
        self.on_settled: list[Callable[[StepOutcome], None]] = []
        """Called with each step's outcome once the host knows it, in step order (the schedule, the memory ledger)."""
        self.collapsed: Optional[tuple[int, str]] = None
        """(step, why) of the first step found collapsed that nothing has acted on yet (`take_collapse`)."""

    # -- the step -------------------------------------------------------------------------------

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def step(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor, step: int,
             named_tensors: Sequence[tuple[str, torch.Tensor]], clip_grad_norm: Optional[float] = None,
             clip_with: Callable[[torch.optim.Optimizer, Optional[float]], Optional[torch.Tensor]] = clip
             ) -> StepOutcome:
        """Step or skip, the same on every rank, decided on the device. `named_tensors`: the optimizer's tensors by
        parameter name. The outcome's `taken` is known at once; the rest once the flags are read (`settle`).

        `clip_grad_norm`: clip the optimizer's gradients (the fp32 masters' where there are masters) to this
        total norm, as torch.amp's recipe says: after unscaling. `clip_with` clips and returns the norm as a plain
        tensor (under FSDP: the norm over every rank's shards); a skipped step's update is not applied, clipped or
        not, and its norm is not reported.
        """
        self.settle()  # the step before's flags (one step late): this step's update must follow its schedule
        self.counters.epoch_steps += 1
        scaler, world = self.skipper, self.world_size
        scaler.scale_tensor(self.device)
        scaler.unscale_(optimizer)
        flags = torch.zeros(2 * world, device=self.device)
        found = scaler.found_inf_flags(optimizer)
        if found:
            flags[self.rank] = torch.stack([f.to(self.device).reshape(()) for f in found]).sum().clamp(max=1)
        flags[world + self.rank] = (~torch.isfinite(loss.detach())).any().float()
        if world > 1:
            dist.all_reduce(flags)
        nan_loss, nonfinite = flags[world:].sum() > 0, flags[:world].sum() > 0
        steps_anyway = not self.scaler.is_enabled() and self.on_nonfinite_grads == "warn"
        skip = nan_loss if steps_anyway else nan_loss | nonfinite
        scaler.skip_where(optimizer, skip.float())  # every rank skips (and backs off) alike
        # Copied now, before the optimizer step: GradScaler's own check (`step()` without a fused optimizer) then
        # waits for the copy too, and the flags are read in this step, while its gradients are there.
        copy = HostCopy(torch.cat([flags, scaler.scale_tensor(self.device).detach().float().reshape(1)]))
        saved = self.scaler.saved() if self.scaler.is_enabled() else None
        grad_norm = clip_with(optimizer, clip_grad_norm)
        prime_fused_momentum(optimizer)
        scaler.step(optimizer)
        scaler.update()
        if saved is not None:
            self.scaler.keep_where(nan_loss, saved)  # a non-finite loss is not an overflow: the scale stays
            if self.dynamic:
                self.scaler.cap(self.amp.max_scale)
        outcome = StepOutcome((~skip).float(), (~nan_loss).float(), grad_norm, self.settle)
        pending = Pending(step, outcome, copy, named_tensors)
        self.pending.append(pending)
        if copy.ready():
            self.settle()
        else:
            pending.keep_maxabs()
        return outcome

    def settle(self) -> None:
        """Read the flags of every step not read yet, in order, waiting for them: counters, the overflow log,
        warnings, the collapse guardrails, errors (`fail`, `abort`), then the `on_settled` listeners. Called
        before each optimizer step (for the step before), and by everything that reports what it keeps."""
        while self.pending:
            pending = self.pending.pop(0)
            values = pending.flags.values()
            world = self.world_size
            found_by_rank, nan_by_rank, scale = values[:world], values[world:2 * world], values[2 * world]
            self._read(pending, found_by_rank, nan_by_rank, scale)
            for listener in self.on_settled:
                listener(pending.outcome)

    def take_collapse(self) -> Optional[tuple[int, str]]:
        """(step, why) of the first collapse found since the last call, once; None when there is none."""
        collapsed, self.collapsed = self.collapsed, None
        return collapsed

    def _read(self, pending: "Pending", found_by_rank: list[float], nan_by_rank: list[float], scale: float) -> None:
        """One step's flags, on the host: what was decided on the device, counted, recorded and checked."""
        step, outcome = pending.number, pending.outcome
        if any(nan_by_rank):
            self.counters.nan_loss_steps += 1
            if self.guard.on_nan_loss == "abort":
                raise NonFiniteLoss(
                    f"the loss was not finite at step {step} on rank(s) {_ranks(nan_by_rank)}. Inspect the data and "
                    "the forward pass, keep fragile layers in fp32 with precision.rules, or set "
                    "precision.scaler.on_nan_loss: skip.")
            self._skipped()
            self._resolve(outcome, step, stepped=False, nan_loss=True,
                          collapse=self._collapse_reason(scale, "the loss not finite"))
            return

        if any(found_by_rank) and not self.scaler.is_enabled():
            if self._nonfinite_grads(pending, found_by_rank):
                return
        elif any(found_by_rank):
            if not all(found_by_rank):
                self.counters.rank_disagreements += 1
                if self.rank == 0:  # one record of the disagreement, not one per rank
                    self.overflow_log.append({"step": step, "event": "ranks_disagree",
                                             "found_inf_by_rank": [int(f) for f in found_by_rank]})
            if found_by_rank[self.rank]:
                record = pending.first_nonfinite()
                if record is not None:
                    self.streak_layers.append(record["layer"])
                    self.overflow_log.append({"step": step, "rank": self.rank, "event": "overflow",
                                              "loss_scale": scale, **record})
            self._skipped()
            self.counters.clean_streak = 0
            after = self._scale_after(scale, backoff=True)
            self._resolve(outcome, step, stepped=False, overflow=True, collapse=self._collapse_reason(after))
            return

        self._clean_step()
        self._resolve(outcome, step, stepped=True, nonfinite_grads=any(found_by_rank))

    def _resolve(self, outcome: StepOutcome, step: int, **fields: Any) -> None:
        outcome.resolve(**fields)
        if fields.get("collapse") is not None and self.collapsed is None:
            self.collapsed = (step, fields["collapse"])

    def _scale_after(self, scale: float, backoff: bool) -> float:
        """The scale `update()` left after a step skipped for an overflow, worked out on the host in float32 as
        GradScaler does on the device."""
        if not (backoff and self.dynamic):
            return scale
        return float(torch.tensor(scale, dtype=torch.float32) * self.amp.backoff_factor)

    def _nonfinite_grads(self, pending: "Pending", found_by_rank: list[float]) -> bool:
        """No scaler, and a gradient not finite on some rank: counted and recorded; then skipped (returns True:
        the outcome is resolved), failed, or (`warn`) taken (False)."""
        step, outcome = pending.number, pending.outcome
        self.counters.nonfinite_grad_steps += 1
        ranks = _ranks(found_by_rank)
        record = pending.first_nonfinite() if found_by_rank[self.rank] else None
        if record is not None:
            self.overflow_log.append({"step": step, "rank": self.rank, "event": "nonfinite_grads",
                                      "action": self.on_nonfinite_grads, **record})
        if self.on_nonfinite_grads == "fail":
            where = f" (first: {record['param']}, {record['kind']})" if record is not None else ""
            raise NonFiniteGradients(
                f"gradients were not finite at step {step} on rank(s) {ranks}{where}. Inspect the loss and the "
                "layers named, lower optim.lr or clip (optim.clip_grad_norm), or set precision.on_nonfinite_grads: "
                "skip to skip such steps.")
        if self.on_nonfinite_grads == "warn":
            self.warned_steps.append(step)
            return False
        if record is not None:
            self.streak_layers.append(record["layer"])
        self._skipped()
        self._resolve(outcome, step, stepped=False, nonfinite_grads=True,
                      collapse=self._collapse_reason(1.0, "the gradients not finite"))
        return True

    def _skipped(self) -> None:
        self.counters.skipped_steps += 1
        self.counters.epoch_skipped += 1
        self.counters.consecutive_skips += 1

    def _clean_step(self) -> None:
        self.counters.consecutive_skips = 0
        self.streak_layers.clear()
        if self.dynamic:
            self.counters.clean_streak += 1
            if self.counters.clean_streak == self.amp.growth_interval:  # the scale grew (capped on the device)
                self.counters.growth_events += 1
                self.counters.clean_streak = 0

    def _collapse_reason(self, scale: float, why: Optional[str] = None) -> Optional[str]:
        """Why the run counts as collapsed after a skipped step (`scale`: the loss scale after it; `why`: what
        skipped it, when not an overflow)."""
        limit = self.guard.max_consecutive_skips
        if limit is not None and self.counters.consecutive_skips > limit:
            last = f", the last with {why}" if why else ""
            return f"{self.counters.consecutive_skips} consecutive skipped steps{last} (max_consecutive_skips={limit})"
        if why:  # the scale did not move
            return None
        if self.guard.min_scale is not None and self.dynamic and scale < self.guard.min_scale:
            return f"loss scale {scale:g} < min_scale={self.guard.min_scale:g}"
        return None

    # -- telemetry ------------------------------------------------------------------------------

    def loss_scale(self) -> float:
        """The current scale; 1.0 when no scaler is active (the loss is used as is)."""
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0

    def metrics(self) -> dict[str, float]:
        self.settle()
        c = self.counters
        return {"amp/loss_scale": self.loss_scale(), "amp/skipped_steps": float(c.skipped_steps),
                "amp/consecutive_skips": float(c.consecutive_skips), "amp/growth_events": float(c.growth_events),
                "amp/rank_disagreements": float(c.rank_disagreements), "amp/nan_loss_steps": float(c.nan_loss_steps),
                "amp/nonfinite_grad_steps": float(c.nonfinite_grad_steps)}

    def end_epoch(self) -> dict[str, float]:
        """`amp/skip_rate`: the share of this epoch's steps that were skipped."""
        self.settle()
        c = self.counters
        rate = c.epoch_skipped / c.epoch_steps if c.epoch_steps else 0.0
        c.epoch_steps = c.epoch_skipped = 0
        return {"amp/skip_rate": rate}

    def nothing_trained(self, epoch: int) -> Optional[str]:
        """Why epoch `epoch` (from 1) trained nothing, when every one of its steps was skipped; else None. Read
        before `end_epoch` resets the epoch's counts."""
        self.settle()
        c = self.counters
        if not c.epoch_steps or c.epoch_skipped < c.epoch_steps:
            return None
        return (f"every one of the {c.epoch_steps} optimizer steps of epoch {epoch} was skipped (so far in the run: "
                f"{c.nan_loss_steps} with a non-finite loss, {c.nonfinite_grad_steps} with non-finite gradients "
                "without a scaler, the rest overflows): no weight changed. Fix the cause (the data, precision.rules, "
                "optim.lr) or lower precision.scaler.max_consecutive_skips so that such a run stops sooner.")

    def drain_warnings(self) -> list[str]:
        """One warning for the steps taken with non-finite gradients since the last call (`warn`), or none."""
        self.settle()
        steps, self.warned_steps = self.warned_steps, []
        if not steps:
            return []
        return [f"gradients were not finite in {len(steps)} step(s) since the last report (steps "
                f"{', '.join(map(str, steps[:10]))}{', ...' if len(steps) > 10 else ''}); the optimizer stepped "
                "anyway (precision.on_nonfinite_grads: warn), so the weights may no longer be finite."]

    def drain_overflow_log(self) -> list[dict[str, Any]]:
        self.settle()
        records, self.overflow_log = self.overflow_log, []
        return records

    def overflowing_layers(self) -> list[str]:
        """The layers found overflowing in the current streak, on any rank (a collective: call on every rank)."""
        self.settle()
        layers = list(dict.fromkeys(self.streak_layers))
        if self.world_size > 1:
            gathered: list[Optional[list[str]]] = [None] * self.world_size
            dist.all_gather_object(gathered, layers)
            layers = list(dict.fromkeys(name for part in gathered for name in (part or [])))
        return layers


@torch.no_grad()
def prime_fused_momentum(optimizer: torch.optim.Optimizer) -> None:
    """Give fused SGD with momentum zeroed momentum buffers before its first step (once per optimizer). It makes
    them uninitialised (`empty_like`) on its first step and fills them in its kernel, which the found-inf flag of a
    step skipped on the device skips too: a skipped first step would leave garbage that the next step turns into
    NaN weights. From zeros the first step computes what it would have (momentum x 0 + grad; with dampening d,
    (1 - d) x grad, as every later step does)."""
    if getattr(optimizer, "_ampflow_momentum_primed", False):
        return
    optimizer._ampflow_momentum_primed = True
    if not isinstance(optimizer, torch.optim.SGD):
        return
    for group in optimizer.param_groups:
        if not group.get("fused") or not group.get("momentum"):
            continue
        for param in group["params"]:
            state = optimizer.state[param]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
