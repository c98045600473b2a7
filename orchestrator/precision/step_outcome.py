"""A step's outcome, decided on the device and read on the host late: when its flags have arrived.

The step decides on the device whether its update is applied (`StepOutcome.taken`), as GradScaler decides with
its found-inf flag; the host learns why (an overflow, a non-finite loss, non-finite gradients) from a small vector
copied without blocking into pinned memory (`HostCopy`). The guard reads it once the copy is complete: at once
where the step waited anyway (on the CPU, or after GradScaler's own check), else one step later, before the next
optimizer step, or at the next report, checkpoint or epoch end, whichever comes first. `Pending` is a step not
read yet, with what its overflow record needs (`first_nonfinite`: the record's fields from the gradients).
"""

import math
import weakref
from typing import Any, Callable, Optional, Sequence

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


class Pending:
    """A step whose flags are on their way to the host, with what its overflow record needs."""

    def __init__(self, number: int, outcome: StepOutcome, flags: HostCopy,
                 named_tensors: Sequence[tuple[str, torch.Tensor]]):
        self.number, self.outcome, self.flags, self.named_tensors = number, outcome, flags, named_tensors
        first = next(((tensor, tensor.grad) for _, tensor in named_tensors if tensor.grad is not None), None)
        self._first = (_grad_owner(first[0]), weakref.ref(_grad_owner_grad(first[0]))) if first else None
        self.maxabs: Optional[HostCopy] = None

    def gradients_there(self) -> bool:
        """Whether this step's gradients are still the tensors' (no later step has replaced them)."""
        if self._first is None:
            return False
        owner, grad = self._first
        return grad() is not None and owner.grad is grad()

    @torch.no_grad()
    def keep_maxabs(self) -> None:
        """For a step read after its gradients may be gone: each gradient's largest |value| (inf or nan where it
        holds one), on the device in one pass per device and dtype, copied to the host without blocking."""
        named = [(position, name, tensor.grad) for position, (name, tensor) in enumerate(self.named_tensors)
                 if tensor.grad is not None]
        if not named:
            return
        groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, str, torch.Tensor]]] = {}
        for entry in named:
            groups.setdefault((entry[2].device, entry[2].dtype), []).append(entry)
        where, parts, self.maxabs_names = named[0][2].device, [], []
        for members in groups.values():  # no host-to-device copy (an index tensor would be one): order kept here
            norms = torch._foreach_norm([grad for _, _, grad in members], float("inf"))
            parts.append(torch.stack(norms).float().to(where))
            self.maxabs_names += [(position, name) for position, name, _ in members]
        self.maxabs = HostCopy(torch.cat(parts))

    def first_nonfinite(self) -> Optional[dict[str, Any]]:
        """The overflow record's fields: from the gradients while they are there; else from `keep_maxabs` (the
        layer, the parameter and the kind; `max_abs_grad` and `nonfinite_count` null)."""
        if self.gradients_there() or self.maxabs is None:
            return first_nonfinite(self.named_tensors) if self.gradients_there() else None
        for (_, name), value in sorted(zip(self.maxabs_names, self.maxabs.values()), reverse=True):
            if not math.isfinite(value):
                return {"layer": _layer_of(name), "param": name, "kind": "nan" if math.isnan(value) else "inf",
                        "max_abs_grad": None, "nonfinite_count": None}
        return None


def _grad_owner(tensor: Any) -> Any:
    """The tensor whose `.grad` is replaced each step (a parameter; under FSDP the sharded one behind its view)."""
    return getattr(tensor, "param", tensor)


def _grad_owner_grad(tensor: Any) -> torch.Tensor:
    return _grad_owner(tensor).grad


def _layer_of(param_name: str) -> str:
    return param_name.rpartition(".")[0] or param_name


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
