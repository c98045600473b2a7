"""A batch as everything after the loader sees it: the model's inputs (positional and named), the targets, the
number of samples.

Loaders yield whatever the dataset and its collate function make: an `(inputs, targets)` pair, a dict, a
tuple, a dataclass. `BatchLayout.from_task(task)` reads which parts are which (`task.inputs`, `task.target`) and
`layout.batch(raw)` turns one loader batch into a `Batch`; `Batches` does it for a whole loader. The step, the
evaluation, pre-flight, the memory ledger and the logged model's example read only `Batch`, so no module guesses
a batch's structure. Tensors keep their dtype everywhere: token ids stay int64, masks stay bool.
"""

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from orchestrator.errors import BadInput

MODEL_LOSS = "model"
"""`task.loss: model`: the loss is the one the model returns (its outputs' `loss`), given the targets."""


def map_tensors(function: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """`value` with `function` applied to every tensor in it (nested dicts, lists, tuples, named tuples,
    dataclasses); anything else kept as it is."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # before Mapping: a Hugging Face ModelOutput
        return dataclasses.replace(value, **{f.name: map_tensors(function, getattr(value, f.name))
                                            for f in dataclasses.fields(value) if f.init})
    if isinstance(value, Mapping):
        items = {key: map_tensors(function, item) for key, item in value.items()}
        return items if type(value) is dict else type(value)(items)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(map_tensors(function, item) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(function, item) for item in value)
    return value


PLAIN_SCALARS = (bool, int, float, str)


def _kept(item: Any) -> bool:
    """Whether a part of a model's outputs is kept by `plain`: tensors, containers and scalars are; None and objects
    of other types (a Hugging Face `DynamicCache` of past keys and values, which a prediction has no use for and
    no loader knows) are not."""
    return isinstance(item, (torch.Tensor, Mapping, list, tuple, *PLAIN_SCALARS)) or \
        (dataclasses.is_dataclass(item) and not isinstance(item, type))


def plain(value: Any) -> Any:
    """`value` in types any loader knows: a mapping or a dataclass (a Hugging Face `ModelOutput`) as a dict of its
    parts that are tensors, containers or scalars (None and other objects, a cache of past keys and values, left
    out), a named tuple as a tuple, nested; tensors as they are. What the logged and exported models return, so
    that loading them needs no third-party import."""
    if isinstance(value, torch.Tensor):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and not isinstance(value, Mapping):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items() if _kept(item)}
    if isinstance(value, (list, tuple)):
        items = [plain(item) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def move(value: Any, device: torch.device, memory_format: torch.memory_format = torch.contiguous_format) -> Any:
    """`value` with every tensor in it on `device`, dtypes kept; 4-D floating tensors in `memory_format`."""

    def place(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(device, non_blocking=True)
        if tensor.dim() == 4 and tensor.is_floating_point() and memory_format != torch.contiguous_format:
            tensor = tensor.contiguous(memory_format=memory_format)
        return tensor

    return map_tensors(place, value)


def tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in `value` (nested dicts, lists, tuples, dataclasses), in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from tensors(getattr(value, f.name))


def describe(value: Any) -> str:
    """`int64 2x17`: a tensor's dtype and shape, or the type of anything else."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} {'x'.join(map(str, value.shape)) or 'scalar'}"
    return type(value).__name__


@dataclass
class Batch:
    """One batch: `model(*args, **kwargs)` computes its outputs, compared with `targets` by the loss."""

    args: tuple = ()
    """Positional inputs."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Named inputs (`task.inputs` by name), passed as keyword arguments."""
    targets: Any = None
    """What the loss and the metrics compare the outputs with."""
    size: int = 0
    """Samples in the batch."""
    labels: Optional[str] = None
    """The keyword the targets are given to the model under as well (`task.loss: model`: the model computes its
    own loss, as Hugging Face models do from `labels`); None: the model never sees them."""

    @classmethod
    def pair(cls, inputs: Any, targets: Any) -> "Batch":
        """An `(inputs, targets)` batch: inputs a tensor (one positional input), a tuple or list (positional
        inputs) or a dict (keyword inputs)."""
        if isinstance(inputs, Mapping):
            args, kwargs = (), dict(inputs)
        elif isinstance(inputs, (tuple, list)) and not hasattr(inputs, "_fields"):
            args, kwargs = tuple(inputs), {}
        else:
            args, kwargs = (inputs,), {}
        return cls(args, kwargs, targets, _size(targets, args, kwargs))

    def to(self, device: torch.device, memory_format: torch.memory_format = torch.contiguous_format) -> "Batch":
        return Batch(move(self.args, device, memory_format), move(self.kwargs, device, memory_format),
                     move(self.targets, device), self.size, self.labels)

    def forward(self, model: Any) -> Any:
        if self.labels is not None:
            return model(*self.args, **self.kwargs, **{self.labels: self.targets})
        return model(*self.args, **self.kwargs)

    def inputs(self) -> list[tuple[Optional[str], Any]]:
        """Each input as (name, value): positional ones have no name."""
        return [(None, value) for value in self.args] + list(self.kwargs.items())

    def describe_inputs(self) -> str:
        """`input_ids int64 2x17, attention_mask bool 2x17` (positional inputs as `#0`, `#1`, ...)."""
        return ", ".join(f"{name if name is not None else f'#{index}'} {describe(value)}"
                         for index, (name, value) in enumerate(self.inputs()))


def _size(targets: Any, args: tuple, kwargs: dict) -> int:
    for value in (targets, args, kwargs):
        for tensor in tensors(value):
            if tensor.dim() > 0:
                return int(tensor.shape[0])
    return len(targets) if hasattr(targets, "__len__") else 1


def _parts(raw: Any) -> list[str]:
    """The names of a batch's parts: keys, fields, or indices."""
    if isinstance(raw, Mapping):
        return [str(key) for key in raw]
    if hasattr(raw, "_fields"):
        return list(raw._fields)
    if dataclasses.is_dataclass(raw) and not isinstance(raw, type):
        return [f.name for f in dataclasses.fields(raw)]
    if isinstance(raw, (tuple, list)):
        return [str(index) for index in range(len(raw))]
    return []


def part(raw: Any, name: str, key: str, what: str = "the batch") -> Any:
    """The part `name` of a batch or of a model's outputs (`what`): a key, an attribute, or an index; BadInput
    naming `key` when it has none."""
    if isinstance(raw, Mapping):
        if name in raw:
            return raw[name]
    elif name.isdigit() and isinstance(raw, (tuple, list)):
        if int(name) < len(raw):
            return raw[int(name)]
    elif hasattr(raw, name) and not callable(getattr(raw, name)):
        return getattr(raw, name)
    parts = _parts(raw)
    raise BadInput(f"{key}: {what} has no part '{name}'; its parts are "
                   f"{', '.join(parts) if parts else 'none (it is a ' + type(raw).__name__ + ')'}. Name one of them "
                   "(a dict's key, a dataclass's field, a tuple's index).")


@dataclass(frozen=True)
class BatchLayout:
    """Which parts of a loader's batch are the model's inputs and which is the target (`task.inputs`,
    `task.target`); both empty: batches are `(inputs, targets)` pairs."""

    inputs: tuple[str, ...] = ()
    target: Optional[str] = None
    labels: Optional[str] = None
    """The keyword the model is given the targets under as well (`Batch.labels`)."""

    @classmethod
    def from_task(cls, task, inference: bool = False) -> "BatchLayout":
        """The job's layout; with `task.loss: model` the model is given the targets too (as `task.target` names
        them, `labels` for a pair), except for `inference` (export, predict), which needs no loss."""
        target = None if task.target is None else str(task.target)
        labels = None
        if getattr(task, "loss", None) == MODEL_LOSS and not inference:
            labels = "labels" if target is None or target.isdigit() else target
        return cls(tuple(str(name) for name in task.inputs), target, labels)

    def batch(self, raw: Any) -> Batch:
        """The `Batch` a loader's batch is; BadInput naming `task.inputs`/`task.target` when it does not fit."""
        if self.target is None:
            if isinstance(raw, (tuple, list)) and len(raw) == 2:
                return dataclasses.replace(Batch.pair(raw[0], raw[1]), labels=self.labels)
            parts = _parts(raw)
            raise BadInput(f"task.target: a batch here is {type(raw).__name__}"
                           f"{' with parts ' + ', '.join(parts) if parts else ''}, not an (inputs, targets) pair: "
                           "name its parts with task.inputs and task.target (e.g. task.inputs: [input_ids, "
                           "attention_mask], task.target: labels).")
        targets = part(raw, self.target, "task.target")
        names = self.inputs or tuple(name for name in _parts(raw) if name != self.target)
        args, kwargs = [], {}
        for name in names:
            if name == self.labels:
                continue  # given as the targets
            value = part(raw, name, "task.inputs")
            if name.isdigit():
                args.append(value)
            else:
                kwargs[name] = value
        return Batch(tuple(args), kwargs, targets, _size(targets, tuple(args), kwargs), self.labels)


class Batches:
    """A loader whose batches come out as `Batch`es (its length is the loader's)."""

    def __init__(self, loader: Iterable[Any], layout: BatchLayout):
        self.loader, self.layout = loader, layout

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def sampler(self) -> Any:
        """The loader's sampler: what it walks (`sampler.dataset`, the split) and where."""
        return self.loader.sampler

    def __iter__(self) -> Iterator[Batch]:
        batches = iter(self.loader)
        while True:
            try:
                raw = next(batches)
            except StopIteration:
                return
            except Exception as exc:
                raise loader_failure(exc, getattr(self.loader, "num_workers", 0)) from None
            yield self.layout.batch(raw)


class LoaderFailed(RuntimeError):
    """The data loader failed: one of its worker processes died, or reading a sample raised in one. The attempt
    ends (Ray Train restarts it under `failure.max_failures`); the message says which and what to do."""


def loader_failure(exc: Exception, loader_workers: int = 0) -> Exception:
    """`exc` as the loader raised it, or, from its worker processes, as a LoaderFailed in one line: PyTorch
    reports a dead worker as a RuntimeError (or, when the worker died while handing over a batch, as the
    connection error of that hand-over), and re-raises a worker's own error with its traceback as the text."""
    text = str(exc)
    died = "DataLoader worker" in text and ("exited unexpectedly" in text or "killed by signal" in text)
    if loader_workers > 0 and isinstance(exc, (ConnectionError, EOFError)):
        died, text = True, f"a DataLoader worker's connection failed ({type(exc).__name__}: {text})"
    if died:
        return LoaderFailed(f"the data loader failed: {text.strip()} (data.loader_workers: a worker process died, "
                            "killed by a signal or out of memory). With failure.max_failures the run restarts from "
                            "its newest checkpoint; give the workers more memory, or set data.loader_workers: 0 to "
                            "read in the training process.")
    if "in DataLoader worker process" in text:  # "Caught X in DataLoader worker process N.\nOriginal Traceback..."
        cause = [line for line in text.splitlines() if line.strip()][-1].strip()
        return LoaderFailed(f"the data loader failed in a worker process: {cause}")
    return exc


EXAMPLE_SAMPLES = 2
"""Samples of the first batch kept as the logged model's input example (2: the exported batch dim stays
dynamic)."""


class InputExample:
    """The inputs of the first training batch (its first samples, on the CPU) and which of their dims changed size
    from batch to batch (a padded sequence length): what the logged model's signature and input example are made
    of. Kept in checkpoints (`state()`: tensors, lists and strings only)."""

    def __init__(self, state: Optional[dict[str, Any]] = None):
        state = state or {}
        self.positional: list[torch.Tensor] = list(state.get("positional", []))
        self.named: dict[str, torch.Tensor] = dict(state.get("named", {}))
        self.variable: dict[str, list[int]] = {k: list(v) for k, v in state.get("variable", {}).items()}
        """Input key (`0`, `1`, ... for positional ones, else the name) -> dims other than the batch's that changed."""

    def __bool__(self) -> bool:
        return bool(self.positional or self.named)

    def observe(self, batch: Batch) -> None:
        """Take the first batch's inputs; for later ones, note the dims whose size differs from the first's."""
        if not self:
            if all(isinstance(value, torch.Tensor) for _, value in batch.inputs()):  # else there is no example
                cut = lambda t: (t[:EXAMPLE_SAMPLES] if t.dim() > 0 and t.shape[0] == batch.size else t)  # noqa: E731
                self.positional = [cut(t).detach().cpu().clone() for t in batch.args]
                self.named = {k: cut(t).detach().cpu().clone() for k, t in batch.kwargs.items()}
            return
        for key, first, value in self._pairs(batch):
            if isinstance(value, torch.Tensor) and value.dim() == first.dim():
                changed = [d for d in range(1, first.dim()) if value.shape[d] != first.shape[d]]
                if changed and not set(changed) <= set(self.variable.get(key, [])):
                    self.variable[key] = sorted(set(self.variable.get(key, [])) | set(changed))

    def _pairs(self, batch: Batch) -> Iterator[tuple[str, torch.Tensor, Any]]:
        for index, (first, value) in enumerate(zip(self.positional, batch.args)):
            yield str(index), first, value
        for name, first in self.named.items():
            yield name, first, batch.kwargs.get(name)

    def state(self) -> dict[str, Any]:
        return {"positional": self.positional, "named": self.named, "variable": self.variable}

    def sample_shape(self) -> list[int]:
        """The first input's shape without the batch dim ([] when there is none)."""
        first = next(iter([*self.positional, *self.named.values()]), None)
        return list(first.shape[1:]) if first is not None else []
