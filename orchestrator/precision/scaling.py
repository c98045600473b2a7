"""The optimizer step, under a GradScaler or not, agreed by every rank, watched, and guarded.

`GuardedScaler.step()` replaces `scaler.step(); scaler.update()` (and a bare `optimizer.step()`):

1. find non-finite gradients on this rank: with a GradScaler, `unscale_()` does it; without one (fp32,
   bf16), GradScaler's own kernel with a scale of 1 (`scaler.nonfinite_flag`);
2. all-reduce one small vector holding every rank's found-inf flag and non-finite-loss flag, and read it
   on the host once: the single sync GradScaler's own `step()` does anyway. Every rank then takes the
   same decision, and ranks that disagree are seen;
3. step, skip for an overflow (the scale backs off), skip for a non-finite loss (the scale is left
   alone, `precision.scaler.on_nan_loss: skip`) or abort; without a scaler, non-finite gradients are
   skipped, fail the run or are only counted (`precision.on_nonfinite_grads`);
4. keep the telemetry (`amp/*` metrics), the overflow log, and check the collapse guardrails: every
   skipped step, whatever the reason, counts toward `max_consecutive_skips`.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from orchestrator.precision.amp import AmpSettings
from orchestrator.precision.scaler import make_scaler, nonfinite_flag


class LossScaleCollapsed(RuntimeError):
    """The loss scale collapsed and `precision.scaler.on_collapse` is `abort`."""


class NonFiniteLoss(RuntimeError):
    """The loss was not finite and `precision.scaler.on_nan_loss` is `abort`."""


class NonFiniteGradients(RuntimeError):
    """Without a GradScaler, a gradient was not finite and `precision.on_nonfinite_grads` is `fail`."""


class NothingTrained(RuntimeError):
    """Every optimizer step of an epoch was skipped: the run cannot end as if it had trained."""


@dataclass(frozen=True)
class StepOutcome:
    stepped: bool
    """The optimizer stepped."""
    overflow: bool = False
    """Skipped: inf/nan gradients on some rank; the scale backed off."""
    nan_loss: bool = False
    """Skipped: the loss itself was not finite on some rank; the scale was left alone."""
    nonfinite_grads: bool = False
    """Without a scaler: a gradient was not finite on some rank (skipped, or stepped with
    `on_nonfinite_grads: warn`)."""
    collapse: Optional[str] = None
    """Why the loss scale counts as collapsed after this step (a guardrail tripped), if it does."""
    grad_norm: Optional[torch.Tensor] = None
    """With clipping: the total gradient norm before clipping, on unscaled gradients (only for a step taken)."""


def clip(optimizer: torch.optim.Optimizer, max_norm: Optional[float]) -> Optional[torch.Tensor]:
    """Clip the optimizer's gradients to total norm `max_norm` (None: no clipping); the norm before clipping,
    left on the device (reading it would wait for the GPU every step)."""
    if max_norm is None:
        return None
    grads = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(grads, max_norm).detach()


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


def _layer_of(param_name: str) -> str:
    return param_name.rpartition(".")[0] or param_name


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
        self.overflow_log: list[dict[str, Any]] = []
        """Records not yet reported (drained by `drain_overflow_log`)."""
        self.warned_steps: list[int] = []
        """Steps taken with non-finite gradients (`on_nonfinite_grads: warn`) not reported yet."""
        self.streak_layers: list[str] = []
        """Layers found overflowing during the current run of consecutive skips."""

    # -- the step -------------------------------------------------------------------------------

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def step(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor, step: int,
             named_tensors: Sequence[tuple[str, torch.Tensor]], clip_grad_norm: Optional[float] = None,
             clip_with: Callable[[torch.optim.Optimizer, Optional[float]], Optional[torch.Tensor]] = clip
             ) -> StepOutcome:
        """Step or skip, the same on every rank. `named_tensors`: the optimizer's tensors by parameter name.

        `clip_grad_norm`: clip the optimizer's gradients (the fp32 masters' where there are masters) to this
        total norm, as torch.amp's recipe says: after unscaling, and only on a step that is taken. `clip_with`
        clips and returns the norm as a plain tensor (under FSDP: the norm over every rank's shards).
        """
        self.counters.epoch_steps += 1
        if self.scaler.is_enabled():
            self.scaler.unscale_(optimizer)
        found_by_rank, nan_by_rank = self._agree(optimizer, loss)

        if any(nan_by_rank):
            self.counters.nan_loss_steps += 1
            if self.guard.on_nan_loss == "abort":
                raise NonFiniteLoss(
                    f"the loss was not finite at step {step} on rank(s) {_ranks(nan_by_rank)}. Inspect the data and "
                    "the forward pass, keep fragile layers in fp32 with precision.rules, or set "
                    "precision.scaler.on_nan_loss: skip.")
            if self.scaler.is_enabled():  # clear this step's inf checks without backing off the scale
                self.scaler.update(float(self.scaler.get_scale()))
            self._skipped()
            return StepOutcome(stepped=False, nan_loss=True, collapse=self._collapse_reason("the loss not finite"))

        if any(found_by_rank) and not self.scaler.is_enabled():
            outcome = self._nonfinite_grads(found_by_rank, step, named_tensors)
            if outcome is not None:
                return outcome
        elif any(found_by_rank):
            if not all(found_by_rank):
                self.counters.rank_disagreements += 1
                if self.rank == 0:  # one record of the disagreement, not one per rank
                    self.overflow_log.append({"step": step, "event": "ranks_disagree",
                                             "found_inf_by_rank": [int(f) for f in found_by_rank]})
            if found_by_rank[self.rank]:
                record = first_nonfinite(named_tensors)
                if record is not None:
                    self.streak_layers.append(record["layer"])
                    self.overflow_log.append({"step": step, "rank": self.rank, "event": "overflow",
                                              "loss_scale": float(self.scaler.get_scale()), **record})
            self._mark_found_inf(optimizer)
            self.scaler.update()  # backs off, identically on every rank
            self._skipped()
            self.counters.clean_streak = 0
            return StepOutcome(stepped=False, overflow=True, collapse=self._collapse_reason())

        grad_norm = clip_with(optimizer, clip_grad_norm)  # unscaled above, and finite on every rank
        optimizer.step()
        if self.scaler.is_enabled():
            self.scaler.update()
        self._clean_step()
        return StepOutcome(stepped=True, grad_norm=grad_norm, nonfinite_grads=any(found_by_rank))

    def _nonfinite_grads(self, found_by_rank: list[float], step: int,
                         named_tensors: Sequence[tuple[str, torch.Tensor]]) -> Optional[StepOutcome]:
        """No scaler, and a gradient not finite on some rank: counted and recorded, then skipped (the outcome),
        failed, or (`warn`) None: the step is taken."""
        self.counters.nonfinite_grad_steps += 1
        ranks = _ranks(found_by_rank)
        record = first_nonfinite(named_tensors) if found_by_rank[self.rank] else None
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
            return None
        if record is not None:
            self.streak_layers.append(record["layer"])
        self._skipped()
        return StepOutcome(stepped=False, nonfinite_grads=True,
                           collapse=self._collapse_reason("the gradients not finite"))

    def _agree(self, optimizer, loss: torch.Tensor) -> tuple[list[float], list[float]]:
        """Every rank's (found_inf, loss_not_finite), in one all-reduce and one host read."""
        flags = torch.zeros(2 * self.world_size, device=self.device)
        if self.scaler.is_enabled():
            found = self.scaler.found_inf_flags(optimizer)
            flags[self.rank] = torch.stack([f.to(self.device).reshape(()) for f in found]).sum().clamp(max=1)
        else:
            flags[self.rank] = nonfinite_flag([p.grad for group in optimizer.param_groups for p in group["params"]
                                               if p.grad is not None], self.device)
        flags[self.world_size + self.rank] = (~torch.isfinite(loss.detach())).float()
        if self.world_size > 1:
            dist.all_reduce(flags)
        host = flags.tolist()
        return host[: self.world_size], host[self.world_size:]

    def _mark_found_inf(self, optimizer) -> None:
        """Make this rank's update() back off even when only another rank found inf."""
        for flag in self.scaler.found_inf_flags(optimizer):
            flag.fill_(1.0)

    def _skipped(self) -> None:
        self.counters.skipped_steps += 1
        self.counters.epoch_skipped += 1
        self.counters.consecutive_skips += 1

    def _clean_step(self) -> None:
        self.counters.consecutive_skips = 0
        self.streak_layers.clear()
        if self.dynamic:
            self.counters.clean_streak += 1
            if self.counters.clean_streak == self.amp.growth_interval:
                self.counters.growth_events += 1
                self.counters.clean_streak = 0
                # The scale just grew (the host mirrors GradScaler's growth tracker): cap it, on the device,
                # without a sync.
                self.scaler.cap(self.amp.max_scale)

    def _collapse_reason(self, why: Optional[str] = None) -> Optional[str]:
        """Why the run counts as collapsed after a skipped step (`why`: what skipped it, when not an overflow)."""
        limit = self.guard.max_consecutive_skips
        if limit is not None and self.counters.consecutive_skips > limit:
            last = f", the last with {why}" if why else ""
            return f"{self.counters.consecutive_skips} consecutive skipped steps{last} (max_consecutive_skips={limit})"
        if why:  # the scale did not move
            return None
        scale = float(self.scaler.get_scale())  # read only on skipped steps: the scale only falls there
        if self.guard.min_scale is not None and self.dynamic and scale < self.guard.min_scale:
            return f"loss scale {scale:g} < min_scale={self.guard.min_scale:g}"
        return None

    # -- telemetry ------------------------------------------------------------------------------

    def loss_scale(self) -> float:
        """The current scale; 1.0 when no scaler is active (the loss is used as is)."""
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0

    def metrics(self) -> dict[str, float]:
        c = self.counters
        return {"amp/loss_scale": self.loss_scale(), "amp/skipped_steps": float(c.skipped_steps),
                "amp/consecutive_skips": float(c.consecutive_skips), "amp/growth_events": float(c.growth_events),
                "amp/rank_disagreements": float(c.rank_disagreements), "amp/nan_loss_steps": float(c.nan_loss_steps),
                "amp/nonfinite_grad_steps": float(c.nonfinite_grad_steps)}

    def end_epoch(self) -> dict[str, float]:
        """`amp/skip_rate`: the share of this epoch's steps that were skipped."""
        c = self.counters
        rate = c.epoch_skipped / c.epoch_steps if c.epoch_steps else 0.0
        c.epoch_steps = c.epoch_skipped = 0
        return {"amp/skip_rate": rate}

    def nothing_trained(self, epoch: int) -> Optional[str]:
        """Why epoch `epoch` (from 1) trained nothing, when every one of its steps was skipped; else None. Read
        before `end_epoch` resets the epoch's counts."""
        c = self.counters
        if not c.epoch_steps or c.epoch_skipped < c.epoch_steps:
            return None
        return (f"every one of the {c.epoch_steps} optimizer steps of epoch {epoch} was skipped (so far in the run: "
                f"{c.nan_loss_steps} with a non-finite loss, {c.nonfinite_grad_steps} with non-finite gradients "
                "without a scaler, the rest overflows): no weight changed. Fix the cause (the data, precision.rules, "
                "optim.lr) or lower precision.scaler.max_consecutive_skips so that such a run stops sooner.")

    def drain_warnings(self) -> list[str]:
        """One warning for the steps taken with non-finite gradients since the last call (`warn`), or none."""
        steps, self.warned_steps = self.warned_steps, []
        if not steps:
            return []
        return [f"gradients were not finite in {len(steps)} step(s) since the last report (steps "
                f"{', '.join(map(str, steps[:10]))}{', ...' if len(steps) > 10 else ''}); the optimizer stepped "
                "anyway (precision.on_nonfinite_grads: warn), so the weights may no longer be finite."]

    def drain_overflow_log(self) -> list[dict[str, Any]]:
        records, self.overflow_log = self.overflow_log, []
        return records

    def overflowing_layers(self) -> list[str]:
        """The layers found overflowing in the current streak, on any rank (a collective: call on every rank)."""
        layers = list(dict.fromkeys(self.streak_layers))
        if self.world_size > 1:
            gathered: list[Optional[list[str]]] = [None] * self.world_size
            dist.all_gather_object(gathered, layers)
            layers = list(dict.fromkeys(name for part in gathered for name in (part or [])))
        return layers

@torch.no_grad()
def first_nonfinite(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> Optional[dict[str, Any]]:
    """The first gradient, in backward order (output side first), holding inf or nan.

    An overflow starts at one layer and spreads toward the input as backward goes on, so the
    layer nearest the output is where it began. `max_abs_grad`: the largest finite |gradient|
    of that parameter, unscaled.
    """
    grads = [(name, tensor.grad) for name, tensor in reversed(named_tensors) if tensor.grad is not None]
    if not grads:
        return None
    finite = torch.stack([torch.isfinite(grad).all() for _, grad in grads]).tolist()
    for (name, grad), ok in zip(grads, finite):
        if ok:
            continue
        good = torch.isfinite(grad)
        finite_values = grad[good]
        return {
            "layer": _layer_of(name), "param": name,
            "kind": "nan" if bool(torch.isnan(grad).any()) else "inf",
            "max_abs_grad": float(finite_values.abs().max()) if finite_values.numel() else None,
            "nonfinite_count": int((~good).sum()),
        }
    return None
