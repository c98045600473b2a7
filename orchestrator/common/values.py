"""Values as models take and give them: tensors nested in dicts, lists, tuples, named tuples and dataclasses (a Hugging
Face `ModelOutput`). Mapped, moved, listed and described without guessing their structure (`map_tensors`, `move`,
`tensors`, `describe`), made plain for a logged model (`plain`), a part named by a key (`part`), and a model's
prediction among its outputs (`prediction`). The training loop (`orchestrator.train.batch`, `orchestrator.train.task`),
the logged model (`orchestrator.tracking.logged_model`) and the driver's checks all read values through these."""

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Optional

import torch

from orchestrator.errors import BadInput


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


def part_names(raw: Any) -> list[str]:
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
    parts = part_names(raw)
    raise BadInput(f"{key}: {what} has no part '{name}'; its parts are "
                   f"{', '.join(parts) if parts else 'none (it is a ' + type(raw).__name__ + ')'}. Name one of them "
                   "(a dict's key, a dataclass's field, a tuple's index).")


def prediction(outputs: Any, output: Optional[str] = None) -> Any:
    """The part of a model's outputs that is its prediction: the key, attribute or index `output` names (BadInput
    naming `task.output` where there is none), else `logits` where the outputs have it, else the outputs."""
    if output is not None:
        return part(outputs, str(output), "task.output", "the model's output")
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        return outputs["logits"] if "logits" in outputs else outputs
    logits = getattr(outputs, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else outputs
