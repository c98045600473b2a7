"""The GradScalers ampflow runs, and the one place that touches GradScaler's private attributes.

`torch.amp.GradScaler` keeps what ampflow needs beyond its public API in private attributes:
the per-device found-inf flags `unscale_()` computed (`_per_optimizer_states`), the scale tensor and its
growth tracker (`_scale`, `_growth_tracker`: to cap the scale, and to keep it through a non-finite loss, on the
device without a host sync), the unscale routine (`_unscale_grads_`, to unscale fp16
gradients in place) and the initial scale (`_init_scale`). They have not changed since torch 1.6;
`tests/test_amp.py::test_the_grad_scaler_internals_ampflow_reads_are_where_it_reads_them` fails the
day they do. Without a scaler, gradients are checked and a step is skipped by a `PassThroughScaler`: GradScaler's
own kernel and skip with a scale of 1 that never moves (`nonfinite_flag` is the same check on its own).
"""

from collections import defaultdict
from typing import Optional, Sequence

import torch

from orchestrator.precision.amp import AmpSettings


class Scaler(torch.amp.GradScaler):
    """A GradScaler that also unscales float16 gradients in place: fp16 parameters without fp32 masters
    (O3-like policies) have nothing else to unscale. torch refuses by default because the unscaled
    values may underflow; the lint says so."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)

    def found_inf_flags(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The per-device found-inf flags `unscale_(optimizer)` left (reading them saves another sync)."""
        return list(self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())

    def cap(self, max_scale: float) -> None:
        """Clamp the scale to `max_scale` on its device, without a host sync."""
        self._scale.clamp_(max=max_scale)

    def scale_tensor(self, device: torch.device) -> torch.Tensor:
        """The scale as a 0-d float32 tensor on its device (created at `init_scale` when no loss was scaled yet)."""
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(device)
        return self._scale

    def saved(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the scale and its growth tracker, on the device (`keep_where` puts them back)."""
        return self._scale.clone(), self._growth_tracker.clone()

    def keep_where(self, condition: torch.Tensor, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Where `condition` (a 0-d bool tensor) holds, put back the scale and growth tracker `saved` before
        `update()`: on the device, without a host sync."""
        scale, tracker = saved
        self._scale.copy_(torch.where(condition, scale, self._scale))
        self._growth_tracker.copy_(torch.where(condition, tracker, self._growth_tracker))

    def skip_where(self, optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
        """Make `step(optimizer)` skip, and `update()` back off, exactly where `skip` (a 0-d tensor) is set,
        whatever this rank's own gradients held: every rank then does the same."""
        for flag in self.found_inf_flags(optimizer):
            flag.copy_(skip)


class FixedScaler(Scaler):
    """A static loss scale: steps with inf/nan gradients are still skipped, the scale never moves."""

    def update(self, new_scale: Optional[float | torch.Tensor] = None) -> None:
        super().update(self._init_scale if new_scale is None else new_scale)


class PassThroughScaler(Scaler):
    """For steps without loss scaling (fp32, bf16, `loss_scale: none`): a scale of 1 that never moves, so that a
    step with non-finite gradients (or a non-finite loss) is skipped on the device as GradScaler skips one: by its
    found-inf flag, without a host read when the optimizer is fused. `unscale_()` is the non-finite check."""

    def __init__(self, device: str):
        super().__init__(device, init_scale=1.0, enabled=True)

    def scale(self, outputs):  # the loss is used as is
        return outputs

    def update(self, new_scale: Optional[float | torch.Tensor] = None) -> None:
        super().update(1.0)


def make_scaler(settings: AmpSettings, device_type: str, enabled: Optional[bool] = None) -> Scaler:
    """A GradScaler, enabled when `enabled` says (default: fp16 autocast with scaling on)."""
    kwargs = dict(
        device=device_type,
        enabled=settings.scaler_enabled if enabled is None else enabled,
        growth_factor=settings.growth_factor,
        backoff_factor=settings.backoff_factor,
        growth_interval=settings.growth_interval,
    )
    if isinstance(settings.loss_scale, float):
        return FixedScaler(init_scale=settings.loss_scale, **kwargs)
    return Scaler(init_scale=settings.init_scale, **kwargs)


@torch.no_grad()
def nonfinite_flag(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1.0 on `device` when any of `grads` holds inf or nan, else 0.0, without a host sync: GradScaler's own
    check (`torch._amp_foreach_non_finite_check_and_unscale_`, one kernel per device and dtype) with a scale
    of 1, which leaves the gradients as they are."""
    found = torch.zeros((), device=device)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        if grad.is_sparse:
            grad = grad.coalesce().values()
        groups[(grad.device, grad.dtype)].append(grad)
    for (where, _), group in groups.items():
        flag, one = torch.zeros(1, device=where), torch.ones(1, device=where)
        torch._amp_foreach_non_finite_check_and_unscale_(group, flag, one)
        found += flag.to(device).reshape(())
    return found.clamp(max=1)
