"""The pyfunc of a model ampflow logged (shipped in the model's `code` directory; needs torch, numpy, mlflow).

`mlflow.pyfunc.load_model(uri).predict(data)` takes one array (a model of one input) or a dict of named arrays
(`{"input_ids": int64, "attention_mask": bool}`), each in the dtype of the model's signature, and returns the
model's prediction as a numpy array: its output, or of several outputs (a dict) the one the job's `task.output`
names, else `logits`. The model itself is loaded by `mlflow.pytorch.load_model`: a pt2 program, or a
pickled module only where MLflow allows unpickling.

`mlflow.pyfunc.load_model(uri).get_raw_model()` is that model, taking its inputs as its forward does:
positionally or by the forward's parameter names (`net(input_ids=..., attention_mask=...)`). The program
`mlflow.pytorch.load_model` gives takes them only as they were exported (positionally, in the signature's order):
torch checks every call of an exported program against the one call shape it was exported with
(`torch/export/_unlift.py`, `_check_inputs_match`), and nothing in the program's file can change that check.
"""

import os
from typing import Any, Optional

import mlflow.pytorch
import numpy as np
import torch


class _Model:
    def __init__(self, model: Any, names: list, positional: int, output: Optional[str] = None):
        self.model, self.names, self.positional, self.output = model, list(names), int(positional), output

    def predict(self, data: Any, params: Optional[dict] = None) -> Any:
        if isinstance(data, dict):
            missing = [name for name in self.names if name not in data]
            if missing:
                raise ValueError(f"the model takes {self.names}; missing {missing}")
            arrays = [data[name] for name in self.names]
        elif hasattr(data, "columns") and len(self.names) > 1:  # a DataFrame: one column per input
            arrays = [np.stack(data[name].to_numpy()) for name in self.names]
        else:
            arrays = [data.to_numpy() if hasattr(data, "to_numpy") else data]
        tensors = [torch.as_tensor(np.asarray(array)) for array in arrays]
        with torch.no_grad():
            outputs = self.model(*tensors[:self.positional],
                                 **dict(zip(self.names[self.positional:], tensors[self.positional:])))
        outputs = self._prediction(outputs)
        if isinstance(outputs, torch.Tensor):
            return outputs.detach().float().cpu().numpy()
        return outputs

    def get_raw_model(self) -> Any:
        """The model: its inputs positionally or by the forward's names (`accept_keywords`)."""
        return self.model

    def _prediction(self, outputs: Any) -> Any:
        if self.output is not None:
            return outputs[int(self.output)] if isinstance(outputs, (tuple, list)) else outputs[self.output]
        if isinstance(outputs, dict) and "logits" in outputs:
            return outputs["logits"]
        return outputs


def accept_keywords(program: Any) -> Any:
    """`program` (an exported program's module) called as its model's forward is: its inputs positionally or by
    the forward's parameter names (`net(input_ids=..., attention_mask=...)`), by a forward pre-hook that binds
    them to the order the program was exported with (positionally, as MLflow exports a pt2 program): torch's own
    check, which runs after it, takes them only in that call shape. Any other module is returned as it is."""
    info = getattr(getattr(getattr(program, "graph", None), "_codegen", None), "pytree_info", None)
    names = list(getattr(info, "orig_args", None) or [])
    if not names:
        return program

    def bind(module, args: tuple, kwargs: dict):
        if not kwargs:
            return None
        unknown = [name for name in kwargs if name not in names[len(args):]]
        missing = [name for name in names[len(args):] if name not in kwargs]
        if unknown or missing:
            raise TypeError(f"the model takes {', '.join(names)}"
                            f"{'; unknown: ' + ', '.join(unknown) if unknown else ''}"
                            f"{'; missing: ' + ', '.join(missing) if missing else ''}")
        return (*args, *(kwargs[name] for name in names[len(args):])), {}

    program.register_forward_pre_hook(bind, with_kwargs=True, prepend=True)
    return program


def _load_pyfunc(path: str, model_config: Optional[dict] = None) -> _Model:
    config = model_config or {}
    model = accept_keywords(mlflow.pytorch.load_model(os.path.dirname(os.path.abspath(path)), map_location="cpu"))
    return _Model(model, config.get("names", []), config.get("positional", len(config.get("names", []))),
                  config.get("output"))
