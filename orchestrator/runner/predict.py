"""Predictions of a logged model: `orchestrator.predict(run_id or model_uri, data)` (and `ampflow predict`).

The model is one a run logged (`orchestrator.runner.outputs`): a run id means its fp32 model `model` (its best
or final checkpoint's weights); a model URI names any (`runs:/RUN_ID/model_bfloat16` for an export,
`models:/NAME/VERSION` for a registered version). It is loaded without unpickling anything: its pt2 program
only (`orchestrator.tracking.model_files`); a model logged pickled, because it did not export to pt2, is
refused, as export refuses it.

It runs in the precision it was trained or exported in, and returns the model's prediction: of several outputs (a
dict, a Hugging Face `ModelOutput`) the one the run's `task.output` names, else `logits`.
- the fp32 `model` as trained: the job's model (the run's `config/job.yaml`) given the logged weights, cast by
  the run's precision policy (per-layer dtypes, the layers promoted at run time) and run under its autocast, in
  eval mode, as the run's evaluation ran it;
- an export (`model_float16`, `model_bfloat16`) as exported: its dtypes are in the program.

`data`: one batch (a tensor, or a dict of tensors given to the model as keyword arguments), or a dataset: the
run's own eval split (`"eval"`, built from its `data` section and batched as its evaluation was: `data.collate`,
`task.inputs`), a map-style dataset (batched the same way: the run's `data.collate`, else the dataset's own
`collate_fn`), or an iterable of batches; a dataset's `(inputs, target)` items give their inputs. Inputs the
model does not take (a name it has no input of, a dtype or a fixed size other than its signature's) are refused
(BadInput) before it runs. The outputs come back on the CPU, in the dtype the
model computed them in, a dataset's concatenated in its order; outputs whose size past the first dim varies
between batches (per-token logits of text padded batch by batch) are padded at the end to the longest with
`PAD_VALUE`, as Hugging Face's `Trainer.predict` pads them.
"""

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping, Optional

import mlflow
import torch
from mlflow import MlflowClient
from torch.utils.data import DataLoader

from orchestrator.errors import BadInput
from orchestrator.precision import Policy, apply, autocast_context, plan
from orchestrator.precision.precision import bf16_unsupported
from orchestrator.runner.export import eval_batches, logged_model_problem, run_job
from orchestrator.tracking.logged_model import LoggedInputs
from orchestrator.tracking.model_files import load_pt2_model
from orchestrator.tracking.secrets import redact
from orchestrator.tracking.tracker import RunTracker, resolve_uri
from orchestrator.train.batch import Batch, BatchLayout, plain
from orchestrator.train.data import build_datasets, collate_fn
from orchestrator.train.models import build_model
from orchestrator.train.task import prediction

TRAINED_MODEL = "model"
"""The name a run logs its fp32 model under; an export is `model_<dtype>`."""
EVAL_SPLIT = "eval"
PAD_VALUE = -100
"""What fills a dataset's outputs past the end of a shorter batch's (the places no input had): Hugging Face's
`Trainer.predict` pads across batches with it, and it is the ignore index of torch's and Hugging Face's token
losses. Outputs that cannot hold it (bool, unsigned) are filled with 0 (False)."""


@dataclass
class Predictor:
    """A logged model, loaded, that predicts in the precision it was trained or exported in."""

    model: torch.nn.Module
    device: torch.device
    autocast: Callable[[], ContextManager]
    """The forward pass's autocast context (a no-op for an export, or a run without autocast)."""
    cfg: Any
    """The run's job (its `data` section gives the `"eval"` dataset)."""
    describe: str
    """What runs, in words: the model and its precision."""
    takes: Optional[LoggedInputs] = None
    """What the model takes (its signature); None: no signature, the inputs are left to the model."""

    @property
    def output(self) -> Optional[str]:
        """The part of the outputs that is the prediction (the run's `task.output`; None: `logits` or all)."""
        return self.cfg.task.get("output") if self.cfg is not None else None

    @torch.no_grad()
    def __call__(self, inputs: Any) -> Any:
        """The model's prediction for one batch of inputs (a tensor, or a dict of named inputs), on the CPU."""
        return self._predict(_batch_of(inputs), check=True)

    @torch.no_grad()
    def _predict(self, batch: Batch, check: bool = False) -> Any:
        """`check`: refuse inputs the model does not take (the caller's; the run's own eval split fits)."""
        problem = self.takes.problem(batch.args, batch.kwargs) if check and self.takes is not None else None
        if problem:
            raise BadInput(f"data: {problem}.")
        batch = batch.to(self.device)
        with self.autocast():
            outputs = batch.forward(self.model)
        return _to(prediction(plain(outputs), self.output), torch.device("cpu"))

    def over(self, data: Any, batch_size: int = 256) -> Any:
        """The outputs for `data`: one batch, or every batch of a dataset concatenated in order."""
        if isinstance(data, str):
            if data != EVAL_SPLIT:
                raise BadInput(f"data: '{data}' is not a dataset; give '{EVAL_SPLIT}' (the run's eval split), a "
                               "dataset, or a batch (a tensor, or a dict of tensors).")
            if self.cfg is None:
                raise BadInput("data: 'eval' is the run's eval split, and this model comes from no run of ampflow; "
                               "give a dataset or a batch.")
            dataset = build_datasets(self.cfg.data, self.cfg.model.num_classes)[1]
            # batched, collated and read as the run's evaluation read them (data.collate, task.inputs)
            outputs = [self._predict(batch) for batch in eval_batches(self.cfg, dataset, batch_size)]
            if not outputs:
                raise BadInput("data: the run's eval split is empty.")
            return _concat(outputs)
        if isinstance(data, (torch.Tensor, Mapping)):
            return self(data)
        if isinstance(data, (tuple, list)) and any(isinstance(item, torch.Tensor) for item in data):
            raise BadInput("data: a tuple or list of tensors is ambiguous (inputs and targets? several inputs?): give "
                           "the inputs tensor (one batch), a dict of tensors, or a dataset.")
        map_style = hasattr(data, "__getitem__") and hasattr(data, "__len__")
        if not (map_style or hasattr(data, "__iter__")):
            raise BadInput(f"data: a {type(data).__name__} is neither a batch (a tensor, a dict of tensors) nor a "
                           "dataset.")
        if map_style:  # batched as the run's evaluation batches: its data.collate (variable-length samples padded)
            loader = DataLoader(data, batch_size=batch_size, collate_fn=collate_fn(self.cfg.data, data)
                                if self.cfg is not None else getattr(data, "collate_fn", None))
            outputs = [self._predict(self._inputs(raw), check=True) for raw in loader]
        else:
            outputs = [self(_inputs_of(batch)) for batch in data]
        if not outputs:
            raise BadInput("data: the dataset is empty.")
        return _concat(outputs)

    def _inputs(self, raw: Any) -> Batch:
        """A map-style dataset's batch as the model's inputs: parted as the run's batches are (`task.inputs`,
        `task.target`; the target, which predicting needs none of, may be absent), else an `(inputs, target)`
        pair's inputs, or the batch."""
        layout = BatchLayout.from_task(self.cfg.task, inference=True) if self.cfg is not None else BatchLayout()
        if layout.target is None:
            pair = isinstance(raw, (tuple, list)) and len(raw) == 2
            return layout.batch(raw) if pair else _batch_of(_inputs_of(raw))
        if isinstance(raw, Mapping) and layout.target not in raw:
            raw = {**raw, layout.target: None}
        return layout.batch(raw)


def inference_device(device: Optional[str]) -> torch.device:
    """Where a model run as trained runs: `device` (cpu, cuda, cuda:1), default the GPU when there is one;
    BadInput when this machine has no such device."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        target = torch.device(device)
    except (RuntimeError, ValueError):
        raise BadInput(f"--device {device}: not a device; give cpu, cuda or cuda:N.") from None
    if target.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise BadInput(f"--device {device}: this machine has no GPU that torch can use "
                           f"(torch.cuda.is_available() is False); leave --device out, or give cpu.")
        if target.index is not None and target.index >= count:
            raise BadInput(f"--device {device}: this machine has {count} GPU{'s' if count > 1 else ''}, "
                           f"cuda:0 to cuda:{count - 1}.")
    elif target.type != "cpu":
        try:
            torch.empty(0, device=target)
        except (RuntimeError, AssertionError) as exc:
            raise BadInput(f"--device {device}: torch cannot use it here ({exc}); give cpu or cuda.") from None
    return target


def load(model: str, tracking_uri: Optional[str] = None, device: Optional[str] = None) -> Predictor:
    """The logged model `model` names (a run id, or a model URI), ready to predict; BadInput when there is none
    there, or it cannot be loaded without unpickling, or `device` is not on this machine."""
    target = inference_device(device)
    uri = resolve_uri(tracking_uri, Path.cwd())
    mlflow.set_tracking_uri(uri)  # runs:/ and models:/ URIs resolve through it
    model_uri = model if ":/" in model else f"runs:/{model}/{TRAINED_MODEL}"
    try:
        info = mlflow.models.get_model_info(model_uri)
    except Exception as exc:  # MlflowException, OSError: nothing logged there
        problem = _run_problem(uri, model) if ":/" not in model else None
        raise BadInput(problem or f"{model}: no logged model at {model_uri} in {redact(uri)} ({type(exc).__name__}: "
                       f"{redact(str(exc))[:300]}). Give a run id whose run logged its model (tracking.log_model), "
                       "or a model URI; --tracking-uri or MLFLOW_TRACKING_URI for another store.") from None
    program = load_pt2_model(info.model_uri, model_uri)
    takes = LoggedInputs.of(info)
    run = MlflowClient(tracking_uri=uri).get_run(info.run_id) if info.run_id else None
    cfg = _run_job(RunTracker(uri, run.info.experiment_id, info.run_id)) if run is not None else None
    if info.name != TRAINED_MODEL or cfg is None:  # an export: its dtypes (and eval mode) are in the program
        how = "as exported" if info.name != TRAINED_MODEL else "as logged"
        return Predictor(program, torch.device("cpu"), contextlib.nullcontext, cfg, f"{model_uri} {how}", takes)
    promoted = [name for name in run.data.tags.get("precision.promoted", "").split(",") if name]
    return _as_trained(program, cfg, promoted, model_uri, target, takes)


def _run_problem(uri: str, run_id: str) -> Optional[str]:
    """Why the run `run_id` has no model to predict with (not ampflow's; FAILED, KILLED or RUNNING; trained with
    tracking.log_model false); None when there is no such run, or no reason is found."""
    try:
        tracker = RunTracker.open(uri, run_id)
    except BadInput:  # no such run: the caller says where it looked
        return None
    try:
        return logged_model_problem(tracker, run_job(tracker, "predict"))
    except BadInput as exc:  # not ampflow's
        return str(exc)


def _run_job(tracker) -> Optional[Any]:
    """The run's job config, or None for a run not made by ampflow."""
    try:
        return run_job(tracker)
    except BadInput:
        return None


def _as_trained(program: torch.nn.Module, cfg: Any, promoted: list[str], model_uri: str, target: torch.device,
                takes: Optional[LoggedInputs]) -> Predictor:
    """The job's model with the program's weights, cast and run as the run's precision policy says."""
    where = f"{model_uri} as trained"
    try:
        model = build_model(cfg.model)
    except BadInput as exc:
        raise BadInput(f"{where}: the run's model is rebuilt to run in its precision, and it cannot be here: {exc} "
                       "Run predict from the directory the job was submitted from, or predict with an export "
                       "(runs:/RUN_ID/model_<dtype>), which needs no code.") from None
    try:
        model.load_state_dict(program.state_dict())
    except RuntimeError as exc:
        raise BadInput(f"{where}: the logged weights do not fit model.name={cfg.model.name}: {exc}") from None
    policy = Policy.from_config(cfg.precision).with_promoted(promoted)
    problem = bf16_unsupported(policy, target)
    if problem:
        raise BadInput(f"{where}: {problem}")
    model.to(target)
    apply(model, policy, plan(model, policy), target.type)
    precision = cfg.precision.preset or "the run's precision section"
    return Predictor(model.eval(), target, lambda: autocast_context(policy.amp, target.type), cfg,
                     f"{model_uri} as trained ({precision}) on {target}", takes)


def _batch_of(inputs: Any) -> Batch:
    """One batch of inputs: a dict of tensors by name, else one positional input."""
    return Batch(kwargs=dict(inputs)) if isinstance(inputs, Mapping) else Batch(args=(inputs,))


def _inputs_of(batch: Any) -> Any:
    """A batch's inputs: the first part of an `(inputs, targets)` batch, else the batch."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, Mapping):
        return {key: _to(item, device) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to(item, device) for item in value)
    return value


def _concat(outputs: list) -> Any:
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return _padded_cat(outputs)
    if isinstance(first, Mapping):
        return {key: _concat([output[key] for output in outputs]) for key in first}
    if isinstance(first, (tuple, list)):
        return type(first)(_concat(list(parts)) for parts in zip(*outputs))
    return outputs


def _padded_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The batches' outputs one after the other (along the first dim); a dim past the first whose size varies
    between batches is padded at the end to the longest, with `PAD_VALUE`."""
    if len({tensor.shape[1:] for tensor in tensors}) == 1:
        return torch.cat(tensors)
    first = tensors[0]
    if first.dim() == 0 or any(tensor.dim() != first.dim() for tensor in tensors):
        shapes = sorted({tuple(tensor.shape) for tensor in tensors})
        raise BadInput(f"the model's outputs cannot be joined batch after batch: their shapes {shapes[:4]} "
                       "differ in their number of dims. Predict batch by batch (a tensor or a dict of tensors) "
                       "instead.")
    sizes = [max(tensor.shape[dim] for tensor in tensors) for dim in range(1, first.dim())]
    holds_pad = first.dtype.is_floating_point or first.dtype.is_complex or first.dtype.is_signed
    joined = first.new_full((sum(len(tensor) for tensor in tensors), *sizes), PAD_VALUE if holds_pad else 0)
    row = 0
    for tensor in tensors:
        joined[(slice(row, row + len(tensor)), *(slice(0, size) for size in tensor.shape[1:]))] = tensor
        row += len(tensor)
    return joined


def predict(model: str, data: Any, *, batch_size: int = 256, device: Optional[str] = None,
            tracking_uri: Optional[str] = None) -> Any:
    """Run the logged model `model` (a run id or a model URI) over `data` (a batch or a dataset) in the precision
    it was trained or exported in; returns its outputs on the CPU (a dataset's concatenated in order, padded with
    `PAD_VALUE` to the longest batch where their length varies, as per-token outputs of padded text do).

    `device`: where a model run as trained runs (default: the GPU when there is one); an export runs on the CPU
    it was saved on. `tracking_uri`: the MLflow store (default: $MLFLOW_TRACKING_URI, else ./mlflow.db)."""
    return load(model, tracking_uri, device).over(data, batch_size)
