"""What a logged model takes: its MLflow signature, input example and pyfunc, from a real training batch.

`ModelInputs` holds the model's inputs in the order it is called with them (the forward's parameter order, named
inputs bound to their parameters), each an example tensor of the dtype it was trained on (int64 token ids, bool
masks, float32 images) and the dims that varied between batches (a padded sequence length), which the signature
marks -1 with the batch dim. `save_model` is the flavor `RunTracker.log_model` hands to MLflow: the pytorch flavor
(a pt2 program, else the pickled module) with that signature and example, and a pyfunc (`ampflow_pyfunc`, shipped
in the model's code) that takes one array or a dict of named arrays and calls the model with them in order.
`LoggedInputs` reads that back from a logged model (its signature and the pyfunc's names), to tell a caller's
inputs that the model does not take before it runs.
"""

import contextlib
import inspect
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator, Mapping, Optional, Sequence

import numpy as np
import torch

from orchestrator.common.modes import eval_mode
from orchestrator.common.values import plain, prediction

logger = logging.getLogger("ampflow.tracking")

PYFUNC_LOADER = Path(__file__).with_name("ampflow_pyfunc.py")
"""The pyfunc loader module, copied into every logged model's code directory."""


@dataclass
class ModelInputs:
    names: list[str]
    """Every input's name, in call order (a positional input without a parameter name is `input_<i>`)."""
    tensors: list[torch.Tensor]
    """An example of each (a few samples, on the CPU, in the dtype training gave it)."""
    variable: list[list[int]]
    """Each input's dims, besides the batch dim, whose size changed between batches."""
    positional: int
    """How many of them (the first) are passed positionally; the rest by keyword (a model taking **kwargs)."""
    output: Optional[str] = None
    """The part of the model's outputs the pyfunc returns (`task.output`); None: `logits` where the outputs have it,
    else the outputs."""

    @classmethod
    def from_example(cls, model: torch.nn.Module, example: dict[str, Any]) -> "ModelInputs":
        """From an `orchestrator.train.batch.InputExample` state: named inputs bound to the forward's parameters by
        name, in its order; those that fill its first parameters are called positionally, the rest by keyword."""
        positional, named = list(example.get("positional", [])), dict(example.get("named", {}))
        variable = example.get("variable", {})
        if not positional and not named:
            raise ValueError("no input example was recorded (an input that is not a tensor, or no step trained)")
        dims = {**{str(i): variable.get(str(i), []) for i in range(len(positional))},
                **{name: variable.get(name, []) for name in named}}
        try:
            parameters = list(inspect.signature(model.forward).parameters.values())
            bound = inspect.signature(model.forward).bind(*positional, **named)
        except (TypeError, ValueError):
            bound = None
        varying = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        if bound is not None and not any(p.kind in varying and p.name in bound.arguments for p in parameters):
            # Every input bound to a parameter by its name, in the forward's order; the leading ones that fill its
            # first parameters are passed positionally, the rest by keyword: GPT-2's forward is (input_ids, cache,
            # attention_mask, ...), so attention_mask goes by name, never into `cache`.
            names = list(bound.arguments)
            keys = {name: str(i) if i < len(positional) else name for i, name in enumerate(names)}
            leading = 0
            for parameter, name in zip(parameters, names):
                if parameter.name != name or parameter.kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                                                    inspect.Parameter.POSITIONAL_OR_KEYWORD):
                    break
                leading += 1
            return cls(names, list(bound.arguments.values()), [list(dims[keys[n]]) for n in names], leading)
        names = [f"input_{i}" for i in range(len(positional))] + list(named)
        keys = [str(i) for i in range(len(positional))] + list(named)
        return cls(names, positional + list(named.values()), [list(dims[k]) for k in keys], len(positional))

    @classmethod
    def from_shape(cls, shape: Sequence[int]) -> "ModelInputs":
        """One float32 input of `shape` (checkpoints that kept only the first input's shape)."""
        return cls(["input_0"], [torch.zeros(2, *shape)], [[]], 1)

    @property
    def single(self) -> bool:
        """One positional input: the signature is one unnamed tensor and the example one array."""
        return len(self.names) == 1 and self.positional == 1

    def signature(self, model: Optional[torch.nn.Module] = None):
        """The inputs' schema; with `model`, also its prediction's (`output`, else `logits`, else its output when
        that is one tensor), from a forward pass on the example (none where that fails)."""
        # mlflow: seconds to import; runner.export imports this module with the driver, whose bad input exits first
        from mlflow.models import ModelSignature
        from mlflow.types import Schema, TensorSpec

        specs = []
        for name, tensor, variable in zip(self.names, self.tensors, self.variable):
            shape = tuple(-1 if d == 0 or d in variable else size for d, size in enumerate(tensor.shape))
            specs.append(TensorSpec(_numpy(tensor).dtype, shape, None if self.single else name))
        predicted = self._prediction(model) if model is not None else None
        outputs = None
        if isinstance(predicted, torch.Tensor) and predicted.dim() > 0:
            variable = self._variable_output_dims(model, predicted)
            shape = tuple(-1 if d == 0 or d in variable else size for d, size in enumerate(predicted.shape))
            outputs = Schema([TensorSpec(_numpy(predicted[:1]).dtype, shape)])
        return ModelSignature(inputs=Schema(specs), outputs=outputs)

    def _prediction(self, model: torch.nn.Module, tensors: Optional[list[torch.Tensor]] = None) -> Any:
        tensors = self.tensors if tensors is None else tensors
        try:
            with torch.no_grad(), eval_mode(model):  # the model's own modes are kept; no statistic moves
                outputs = model(*tensors[:self.positional],
                                **dict(zip(self.names[self.positional:], tensors[self.positional:])))
            return prediction(plain(outputs), self.output)
        except Exception:  # a signature without outputs: the model is logged all the same
            return None

    def _variable_output_dims(self, model: torch.nn.Module, predicted: torch.Tensor) -> set[int]:
        """The prediction's dims (besides the batch's) that follow the inputs' varying ones (a tagger's per-token
        scores follow the padded sequence length): found by calling the model again with each varying input dim
        one shorter and seeing which of the prediction's dims change."""
        if not any(self.variable):
            return set()
        shorter = [_shorten(tensor, dims) for tensor, dims in zip(self.tensors, self.variable)]
        again = self._prediction(model, shorter)
        if not isinstance(again, torch.Tensor) or again.dim() != predicted.dim():
            return set()
        return {d for d in range(1, predicted.dim()) if again.shape[d] != predicted.shape[d]}

    def example(self):
        """The input example as MLflow keeps it: one array, or a dict of named arrays."""
        arrays = [_numpy(tensor) for tensor in self.tensors]
        return arrays[0] if self.single else dict(zip(self.names, arrays))

    def describe(self) -> str:
        return ", ".join(f"{name} {str(t.dtype).removeprefix('torch.')}" for name, t in zip(self.names, self.tensors))


def _shorten(tensor: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """`tensor` with each of `dims` one shorter (those longer than 1)."""
    for d in dims:
        if tensor.shape[d] > 1:
            tensor = tensor.narrow(d, 0, tensor.shape[d] - 1)
    return tensor


@dataclass(frozen=True)
class TakenInput:
    """One input of a logged model, as its signature gives it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    """Its size in each dim; -1: any (the batch dim, and a dim whose size varied in training)."""

    def describe(self) -> str:
        """`float32 [N, 3, 32, 32]` (N: the batch; `*`: any size)."""
        dims = ["N" if d == 0 and size == -1 else "*" if size == -1 else str(size) for d, size in enumerate(self.shape)]
        return f"{_dtype_name(self.dtype)} [{', '.join(dims)}]"

    def problem(self, value: Any) -> Optional[str]:
        """What `value` is, as this input, and what to do, in words; None when it fits."""
        if not isinstance(value, torch.Tensor):
            return f"a {type(value).__name__}, not a tensor"
        got, dtype = f"{_dtype_name(value.dtype)} {list(value.shape)}", _dtype_name(self.dtype)
        if value.dtype != self.dtype:
            return f"{got}, not {dtype}: convert it (tensor.to(torch.{dtype}), array.astype('{dtype}'))"
        if value.dim() != len(self.shape):
            return f"{got} ({value.dim()} dims, not {len(self.shape)})"
        wrong = [d for d, size in enumerate(self.shape) if size != -1 and value.shape[d] != size]
        if wrong:
            return f"{got} (dim {wrong[0]} is {value.shape[wrong[0]]}, not {self.shape[wrong[0]]})"
        return None


@dataclass(frozen=True)
class LoggedInputs:
    """What a logged model takes, read back from its MLflow model: the signature's tensors (dtype and shape) under
    the names the pyfunc calls the model with (the forward's parameter names, `input_<i>` where it has none)."""

    inputs: tuple[TakenInput, ...]

    @classmethod
    def of(cls, info) -> Optional["LoggedInputs"]:
        """From an `mlflow.models.ModelInfo`; None for a model without a tensor signature (not logged by ampflow),
        whose inputs are left to the model."""
        schema = info.signature.inputs if info.signature is not None else None
        if schema is None or not schema.is_tensor_spec():
            return None
        config = (info.flavors.get("python_function") or {}).get("config") or {}
        specs = schema.inputs
        names = [str(name) for name in config.get("names") or []]
        if len(names) != len(specs):
            names = [spec.name or f"input_{index}" for index, spec in enumerate(specs)]
        try:
            dtypes = [torch.from_numpy(np.zeros(0, dtype=spec.type)).dtype for spec in specs]
        except TypeError:  # a dtype torch has no tensor of (strings): left to the model
            return None
        return cls(tuple(TakenInput(name, dtype, tuple(spec.shape))
                         for name, dtype, spec in zip(names, dtypes, specs)))

    def describe(self) -> str:
        """`x float32 [N, 3, 32, 32]`, or every input of several, named."""
        return ", ".join(f"{taken.name} {taken.describe()}" for taken in self.inputs)

    def problem(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Optional[str]:
        """Why the model does not take `model(*args, **kwargs)`, in one sentence; None when it does. Positional
        inputs are the first ones in order; named ones by their names."""
        names = [taken.name for taken in self.inputs]
        takes = (f"the model takes one tensor, {self.describe()}" if len(names) == 1 else
                 f"the model takes {len(names)} inputs, by name: {self.describe()}")
        if len(args) > len(names):
            return f"{takes}; it was given {len(args)} tensors"
        unknown = [key for key in kwargs if key not in names[len(args):]]
        if unknown:
            fix = ("give the tensor itself" if len(names) == 1 else "give a dict of those") + \
                (f" (or a dict with the key '{names[0]}')" if len(names) == 1 and not _unnamed(names[0]) else "")
            return f"{takes}; the data has {', '.join(repr(key) for key in unknown)}, which it does not take: {fix}"
        given = dict(zip(names, args), **kwargs)
        missing = [name for name in names if name not in given]
        if missing:
            return f"{takes}; the data has no {', '.join(repr(name) for name in missing)}: give a dict of them all"
        for taken in self.inputs:
            problem = taken.problem(given[taken.name])
            if problem:
                return f"{takes}; {'the data' if len(names) == 1 else repr(taken.name)} is {problem}"
        return None


def _unnamed(name: str) -> bool:
    """A name `ModelInputs` made up for a positional input whose parameter it could not bind."""
    return name.startswith("input_") and name.removeprefix("input_").isdigit()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.float()
    return tensor.detach().cpu().numpy()


@contextlib.contextmanager
def called_in_order(model: torch.nn.Module, inputs: ModelInputs) -> Iterator[None]:
    """While it lasts, `model` takes all of `inputs` positionally, in their order (what MLflow exports a pt2 program
    with), and hands them to its own forward as `inputs` says: the leading ones positionally, the rest by their
    names. The program's parameters are then named after the inputs (`input_ids, attention_mask`), so it takes them
    by keyword too (`ampflow_pyfunc.accept_keywords`)."""
    if inputs.positional == len(inputs.names):
        yield
        return
    own = model.forward

    def forward(*tensors: torch.Tensor) -> Any:
        return own(*tensors[:inputs.positional], **dict(zip(inputs.names[inputs.positional:],
                                                            tensors[inputs.positional:])))

    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in inputs.names])
    model.forward = forward  # the instance's, over its class's
    try:
        yield
    finally:
        del model.forward


def save_model(path: str, mlflow_model, pytorch_model: torch.nn.Module, inputs: ModelInputs,
               code_paths: Optional[list[str]] = None, pip_requirements: Optional[list[str]] = None,
               chosen: Optional[list[str]] = None) -> None:
    """The flavor's `save_model` (`mlflow.models.Model.log` calls it): a pt2 program taking the inputs in their
    order (`called_in_order`) when the model exports, else the pickled module; then the example and ampflow's
    pyfunc. Appends the format used to `chosen`."""
    # mlflow: seconds to import; runner.export imports this module with the driver, whose bad input exits first
    import mlflow.pyfunc
    import mlflow.pytorch
    from mlflow.models.utils import _save_example

    common = dict(mlflow_model=mlflow_model, signature=inputs.signature(pytorch_model),
                  pip_requirements=pip_requirements,
                  code_paths=[*(code_paths or []), str(PYFUNC_LOADER)])
    try:
        # The program returns plain tensors and dicts (a Hugging Face ModelOutput as a dict), so loading it needs
        # no third-party import.
        handle = pytorch_model.register_forward_hook(lambda module, args, output: plain(output))
        try:
            with called_in_order(pytorch_model, inputs):
                mlflow.pytorch.save_model(pytorch_model, path, serialization_format="pt2",
                                          input_example=tuple(inputs.tensors), **common)
        finally:
            handle.remove()
        used = "pt2"
    except Exception as exc:
        logger.warning("ampflow: model does not export to pt2 (%s); logging it pickled.", exc)
        shutil.rmtree(path, ignore_errors=True)
        mlflow.pytorch.save_model(pytorch_model, path, serialization_format="pickle", **common)
        used = "pickle"
    _save_example(mlflow_model, inputs.example(), path)
    mlflow_model.flavors.pop(mlflow.pyfunc.FLAVOR_NAME, None)
    mlflow.pyfunc.add_to_model(mlflow_model, loader_module=PYFUNC_LOADER.stem, data="data", code="code",
                               conda_env="conda.yaml", python_env="python_env.yaml",
                               model_config={"names": inputs.names, "positional": inputs.positional,
                                             "output": inputs.output})
    mlflow_model.save(os.path.join(path, "MLmodel"))
    if chosen is not None:
        chosen.append(used)


def log_model(model: torch.nn.Module, inputs: ModelInputs, name: str, code_paths: Optional[list[str]],
              pip_requirements: list[str]) -> tuple[str, str]:
    """Log `model` under the active run as MLflow model `name`; returns the format used (`pt2` or `pickle`) and
    the logged model's id."""
    from mlflow.models import Model  # mlflow: seconds to import (see `save_model`)

    chosen: list[str] = []
    info = Model.log(artifact_path=None, name=name, flavor=SimpleNamespace(save_model=save_model),
                     flavor_name="pytorch", pytorch_model=model, inputs=inputs, code_paths=code_paths,
                     pip_requirements=pip_requirements, chosen=chosen)
    return chosen[0], info.model_id
