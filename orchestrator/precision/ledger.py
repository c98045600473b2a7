"""Memory as it really is: bytes by dtype per category, measured on live tensors.

Categories (the `memory/<category>_<dtype>_bytes` metrics and the summary CLI's `bytes`):
- `params`: the model's parameters as stored under the precision policy;
- `grads`: the gradients backward produced for them (in the parameter's dtype, what DDP reduces);
- `optimizer`: per-element optimizer state (momentum, Adam moments; scalar step counters are left out);
- `master`: fp32 master copies of half parameters, and the fp32 gradients the optimizer reads on them;
- `activations`: tensors autograd saved for backward in one real forward pass, except parameters
  (counted above) and autocast's weight casts (below);
- `weight_casts`: the half copies of fp32 weights that autocast made and autograd kept for backward
  (O1, bf16-mixed): real memory, but it scales with the model, not with the batch.
Tensors that share storage are counted once, by their storage's full size. Under FSDP a parameter, its gradient
and its optimizer state are DTensors: this rank's shard of each is what is counted (the bytes this rank holds).
"""

from collections import Counter
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional

import torch
from torch import nn
from orchestrator.precision.shards import is_dtensor

from orchestrator.precision.dtypes import dtype_name

CATEGORIES = ("params", "grads", "optimizer", "master", "activations", "weight_casts")


def _held(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `tensor`: its shard of a DTensor, else the tensor itself; the plain tensor inside a
    wrapper subclass (torchao's float8 weights under FSDP2)."""
    held = tensor.to_local() if is_dtensor(tensor) else tensor
    while type(held) not in (torch.Tensor, torch.nn.Parameter) and hasattr(held, "__tensor_flatten__"):
        names, _ = held.__tensor_flatten__()
        held = getattr(held, names[0])
    return held


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    storage = _held(tensor).untyped_storage()
    return str(tensor.device), storage.data_ptr()


def bytes_by_dtype(tensors: Iterable[Optional[torch.Tensor]], exclude: frozenset = frozenset()) -> dict[str, int]:
    """Bytes per dtype of the storages behind `tensors`, each storage once; `exclude` holds storage keys."""
    totals: Counter[str] = Counter()
    seen = set(exclude)
    for tensor in tensors:
        if tensor is None or tensor.device.type == "meta":
            continue
        tensor = _held(tensor)
        key = _storage_key(tensor)
        if key in seen:
            continue
        seen.add(key)
        totals[dtype_name(tensor.dtype)] += tensor.untyped_storage().nbytes()
    return dict(totals)


def param_bytes_by_dtype(model: nn.Module) -> dict[str, int]:
    """Bytes of the parameters as stored, per dtype (shared parameters counted once)."""
    return bytes_by_dtype(model.parameters())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                yield value


class ActivationProbe:
    """Counts what autograd saves for backward while `recording()` is active (saved-tensor hooks)."""

    def __init__(self, model: nn.Module):
        params = list(model.parameters())
        self._param_storages = frozenset(_storage_key(p) for p in params)
        self._param_ids = frozenset(id(p) for p in params)
        self._saved: list[torch.Tensor] = []
        self._casts: list[torch.Tensor] = []

    @contextmanager
    def recording(self) -> Iterator[None]:
        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if not self._is_param(tensor):
                (self._casts if self._is_weight_cast(tensor) else self._saved).append(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield

    def _is_weight_cast(self, tensor: torch.Tensor) -> bool:
        """A copy of a parameter in another dtype (or a view of one, e.g. a Linear's transposed weight). Under FSDP
        the parameter cast is the gathered one, a Parameter of FSDP's own rather than one of the model's."""
        base = tensor._base if tensor._base is not None else tensor
        node = base.grad_fn
        if node is None or type(node).__name__ != "ToCopyBackward0":
            return False
        source = getattr(node.next_functions[0][0], "variable", None)
        return id(source) in self._param_ids or isinstance(source, nn.Parameter)

    @staticmethod
    def _is_param(tensor: torch.Tensor) -> bool:
        """A parameter (or a view of one) saved as it is: counted with the parameters, not as an activation. Under
        FSDP it is the gathered parameter (a Parameter of FSDP's own), which lives only around its unit's passes."""
        return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)

    def activations(self) -> dict[str, int]:
        return bytes_by_dtype(self._saved, exclude=self._param_storages)

    def weight_casts(self) -> dict[str, int]:
        return bytes_by_dtype(self._casts)

    def release(self) -> None:
        """Drop the references to saved tensors so their memory can be freed."""
        self._saved.clear()
        self._casts.clear()


class MemoryLedger:
    """Bytes by category and dtype for one training set-up, filled in during its first steps.

    The training loop records activations and gradients during the first step, and the
    optimizer/master state once the optimizer has really stepped (a skipped first step under
    fp16 leaves Adam's moments unallocated).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.probe: Optional[ActivationProbe] = ActivationProbe(model)
        self.bytes: dict[str, dict[str, int]] = {"params": param_bytes_by_dtype(model)}
        self.complete = False
        self._table_taken = False

    def record_backward(self) -> None:
        """After the first backward: the saved activations and the gradients as produced."""
        if self.probe is None:
            return
        self.bytes["activations"] = self.probe.activations()
        self.bytes["weight_casts"] = self.probe.weight_casts()
        self.probe.release()
        self.probe = None
        self.bytes["grads"] = bytes_by_dtype(p.grad for p in self.model.parameters())

    def record_state(self, optimizer: torch.optim.Optimizer, masters=None) -> None:
        """After the first step the optimizer really took: its state, and the fp32 masters; and the gradients if
        the first backward left none where the optimizer reads them (FSDP accumulating: they are reduce-scattered
        into this rank's shards by the step's last backward)."""
        if not self.bytes.get("grads"):
            self.bytes["grads"] = bytes_by_dtype(p.grad for p in self.model.parameters())
        self.bytes["optimizer"] = bytes_by_dtype(optimizer_state_tensors(optimizer))
        pairs = masters.pairs if masters else []
        self.bytes["master"] = bytes_by_dtype([m for _, m in pairs] + [m.grad for _, m in pairs])
        self.complete = True

    def metrics(self) -> dict[str, float]:
        """`memory/<category>_<dtype>_bytes` (`memory/params_float16_bytes`) for every category measured so far: the
        metric's last segment, which MLflow titles its chart with, says what it is."""
        return {f"memory/{category}_{dtype}_bytes": float(size)
                for category, per_dtype in self.bytes.items() for dtype, size in per_dtype.items()}

    def take_table(self) -> Optional[list[dict[str, object]]]:
        """The table once, as soon as every category is measured; None before and after."""
        if not self.complete or self._table_taken:
            return None
        self._table_taken = True
        return self.table()

    def table(self) -> list[dict[str, object]]:
        """Rows for the `memory/breakdown.json` artifact: one per category and dtype."""
        return [{"category": category, "dtype": dtype, "bytes": size, "MiB": round(size / 2**20, 3)}
                for category in CATEGORIES for dtype, size in sorted(self.bytes.get(category, {}).items())]
