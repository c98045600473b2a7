"""A step's outcome, decided on the device and read on the host late: when its flags have arrived.

The step decides on the device whether its update is applied (`StepOutcome.taken`), as GradScaler decides with
its found-inf flag; the host learns why (an overflow, a non-finite loss, non-finite gradients) from a small vector
copied without blocking into pinned memory (`HostCopy`). The guard reads it once the copy is complete: at once
where the step waited anyway (on the CPU, or after GradScaler's own check), else one step later, before the next
optimizer step, or at the next report, checkpoint or epoch end, whichever comes first.
"""

from typing import Any, Callable, Optional

import torch


class HostCopy:
    """A device tensor copied to the host without blocking: `ready()` says whether the copy is complete (never
    waits), `values()` reads it (waiting for the copy only when it is not complete)."""

    def __init__(self, tensor: torch.Tensor):
        tensor = tensor.detach()
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event: Optional[torch.cuda.Event] = torch.cuda.Event()
            self.event.record()
        else:  # other devices: a plain copy (on the CPU, the tensor itself)
            self.host, self.event = tensor.to("cpu"), None

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def values(self) -> list[Any]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class StepOutcome:
    """Stepped or skipped, and why. `taken` (1.0 or 0.0, on the device) is known at once and is what the step
    did; the other fields are read on the host once the step's flags arrive (`known`). Reading one of them before
    waits for them: the built-in hooks never do, a callback that does makes the host wait for the device."""

    def __init__(self, taken: torch.Tensor, loss_counted: torch.Tensor, grad_norm: Optional[torch.Tensor],
                 settle: Callable[[], None]):
        self.taken = taken
        """1.0 where the update was applied, 0.0 where it was skipped (a 0-d tensor on the device)."""
        self.loss_counted = loss_counted
        """1.0 where the loss was finite on every rank (a 0-d tensor on the device): what `train/loss` counts."""
        self.norm = grad_norm
        """With clipping: the total gradient norm before clipping (a 0-d tensor on the device), whatever the step
        did; `grad_norm` is the same for a step taken."""
        self._settle = settle
        self._fields: Optional[dict[str, Any]] = None

    def resolve(self, stepped: bool, overflow: bool = False, nan_loss: bool = False, nonfinite_grads: bool = False,
                collapse: Optional[str] = None) -> "StepOutcome":
        """Fill in what the host learnt (the guard calls it)."""
        self._fields = dict(stepped=stepped, overflow=overflow, nan_loss=nan_loss, nonfinite_grads=nonfinite_grads,
                            collapse=collapse)
        return self

    @property
    def known(self) -> bool:
        """Whether the fields below can be read without waiting for the device."""
        return self._fields is not None

    def _field(self, name: str) -> Any:
        if self._fields is None:
            self._settle()
        return self._fields[name]

    @property
    def stepped(self) -> bool:
        """The optimizer stepped."""
        return self._field("stepped")

    @property
    def overflow(self) -> bool:
        """Skipped: inf/nan gradients on some rank; the scale backed off."""
        return self._field("overflow")

    @property
    def nan_loss(self) -> bool:
        """Skipped: the loss itself was not finite on some rank; the scale was left alone."""
        return self._field("nan_loss")

    @property
    def nonfinite_grads(self) -> bool:
        """Without a scaler: a gradient was not finite on some rank (skipped, or stepped with
        `on_nonfinite_grads: warn`)."""
        return self._field("nonfinite_grads")

    @property
    def collapse(self) -> Optional[str]:
        """Why the loss scale counts as collapsed after this step (a guardrail tripped), if it does."""
        return self._field("collapse")

    @property
    def grad_norm(self) -> Optional[torch.Tensor]:
        """With clipping: the total gradient norm before clipping, on unscaled gradients (only for a step taken)."""
        if self.norm is None:
            return None
        return self.norm if self.stepped else None

    def __repr__(self) -> str:
        return f"StepOutcome({self._fields if self._fields is not None else 'not known yet'})"
