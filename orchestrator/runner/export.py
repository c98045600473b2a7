"""Half-precision export for deployment, checked against the fp32 model's accuracy.

`export.dtype` in a job exports at the end of training (`orchestrator.runner.outputs`);
`python -m orchestrator.export RUN_ID --dtype float16|bfloat16` (`orchestrator.cli.export`) exports a
finished run's logged model (`export_logged_run`). The model is cast per the run's policy (its rules
hold; normalisation layers stay fp32), both versions are scored on the eval set,
`export/accuracy_delta` (exported - fp32) is logged, and past `export.max_accuracy_drop` the export
is refused: nothing is logged as a model.
"""

import copy
from dataclasses import dataclass, replace
from typing import Optional

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader

from orchestrator.errors import BadInput
from orchestrator.precision import Policy, apply, dtype_name, parse_dtype, plan
from orchestrator.precision.finite import model_nonfinite
from orchestrator.tracking.logged_model import ModelInputs
from orchestrator.train.batch import Batches, BatchLayout, InputExample
from orchestrator.train.data import build_datasets, collate_fn
from orchestrator.train.models import build_model
from orchestrator.train.modes import eval_mode
from orchestrator.train.task import SummedMetric, TorchMetric, build_metrics, fp32

EXPORT_DTYPES = ("float16", "bfloat16")


class ExportRefused(Exception):
    """The exported model lost more accuracy than `export.max_accuracy_drop` allows."""


@dataclass(frozen=True)
class ExportResult:
    dtype: str
    fp32_accuracy: float
    accuracy: float

    @property
    def accuracy_delta(self) -> float:
        return self.accuracy - self.fp32_accuracy

    def describe(self) -> str:
        """One line for the console: the accuracies and the MLflow model's name."""
        return (f"{self.dtype}: accuracy {self.accuracy:.4f} (fp32 {self.fp32_accuracy:.4f}, delta "
                f"{self.accuracy_delta:+.4f}), MLflow model 'model_{self.dtype}'")

    def metrics(self) -> dict[str, float]:
        return {"export/accuracy_delta": self.accuracy_delta, "export/accuracy": self.accuracy,
                "export/fp32_accuracy": self.fp32_accuracy}


def cast_for_inference(model: nn.Module, precision_cfg, dtype: torch.dtype) -> nn.Module:
    """A copy of `model` stored in `dtype` except where the run's rules say otherwise; norms stay fp32."""
    run_policy = Policy.from_config(precision_cfg)
    policy = replace(run_policy, amp=replace(run_policy.amp, compute_dtype=torch.float32), param_dtype=dtype,
                     master_weights=False, keep_norm_fp32=True)
    exported = copy.deepcopy(model).eval()
    return apply(exported, policy, plan(exported, policy), device_type=None)


def eval_batches(cfg, dataset, batch_size: int = 256) -> Batches:
    """The eval set in `Batch`es, collated and read as training reads them (`data.collate`, `task.inputs`); the
    model is not given the targets (an inference needs no loss)."""
    return Batches(DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn(cfg.data, dataset)),
                   BatchLayout.from_task(cfg.task, inference=True))


def input_example(cfg, dataset, batches: int = 16) -> InputExample:
    """The exported model's input example and the dims that vary, from the first samples of `dataset` in batches
    of two (a padded length varies between small batches; all of the eval set in one batch would hide it)."""
    example = InputExample()
    for _, batch in zip(range(batches), eval_batches(cfg, dataset, batch_size=2)):
        example.observe(batch)
    return example


@torch.no_grad()
def accuracy(model: nn.Module, batches, device: torch.device, task) -> float:
    """The job's own metric that checks the export (`accuracy` when the job evaluates it, else its first metric's
    first value) over `batches`, in eval mode, every input in its own dtype; the model's own modes are restored
    afterwards."""
    metrics = build_metrics(task)
    for metric in metrics:
        metric.reset(device)
    with eval_mode(model.to(device)):
        for batch in batches:
            batch = batch.to(device)
            outputs = fp32(batch.forward(model))
            for metric in metrics:
                metric.update(outputs, batch.targets)
    values: dict[str, float] = {}
    for metric in metrics:
        if isinstance(metric, SummedMetric):
            values.update({name: float(total) / max(float(count), 1.0)
                           for name, (total, count) in sorted(metric.sums.items())})
        elif isinstance(metric, TorchMetric):
            values.update(metric.compute())
    if not values:
        raise BadInput("export: the job's task.metrics give no value to check the export by; add 'accuracy'.")
    return values.get("accuracy", next(iter(values.values())))


def export(model: nn.Module, cfg, dtype_text: str, tracker, max_drop: float) -> ExportResult:
    """Score fp32 vs exported on the eval set, log the metrics, and log the model unless refused."""
    dtype = parse_dtype(dtype_text, "export.dtype")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _, eval_set = build_datasets(cfg.data, cfg.model.num_classes)
    exported = cast_for_inference(model, cfg.precision, dtype)
    result = ExportResult(dtype_name(dtype), accuracy(model, eval_batches(cfg, eval_set), device, cfg.task),
                          accuracy(exported, eval_batches(cfg, eval_set), device, cfg.task))
    tracker.log_metrics(result.metrics())
    drop = -result.accuracy_delta
    if drop > max_drop:
        tracker.set_tag("export_status", "refused")
        raise ExportRefused(
            f"export to {result.dtype} refused: eval accuracy {result.accuracy:.4f} vs fp32 "
            f"{result.fp32_accuracy:.4f}, a drop of {drop:.4f} > export.max_accuracy_drop={max_drop}. "
            "Keep more layers in fp32 with precision.rules, export to bfloat16, or raise the limit.")
    problem = model_nonfinite(exported)  # a NaN in the source, or a weight beyond what the dtype holds
    if problem:
        tracker.set_tag("export_status", "refused")
        raise ExportRefused(f"export to {result.dtype} refused: the exported weights are not finite ({problem}). "
                            "A weight beyond float16's range (65504) overflows: export to bfloat16 or keep that layer "
                            "in fp32 (precision.rules); a NaN was in the trained model already.")
    exported = exported.cpu()  # takes the inputs training gave the model, in their dtypes (float ones cast inside)
    inputs = replace(ModelInputs.from_example(exported, input_example(cfg, eval_set).state()),
                     output=cfg.task.get("output"))  # a run logged before task.output has none
    tracker.log_model(exported, inputs, name=f"model_{result.dtype}")
    tracker.set_tag("export_status", "logged")
    return result


def trainable_copy(logged: nn.Module, cfg) -> nn.Module:
    """The job's model class with the logged fp32 weights: pt2 programs cannot be re-cast, modules can."""
    model = build_model(cfg.model)
    try:
        model.load_state_dict(logged.state_dict())
    except RuntimeError as exc:
        raise BadInput(f"the logged model's weights do not fit model.name={cfg.model.name}: {exc}") from None
    return model


def export_logged_run(tracker, dtype_text: str, max_drop: Optional[float] = None) -> ExportResult:
    """Export the run's logged fp32 model (`tracker`: its `RunTracker`) to `dtype_text`, within `max_drop`
    (default: the run's `export.max_accuracy_drop`). BadInput: the run cannot be exported (no model, weights
    that do not fit its model); ExportRefused: it lost too much accuracy."""
    cfg = OmegaConf.create(tracker.load_text("config/job.yaml"))
    model = trainable_copy(tracker.load_model(), cfg)
    return export(model, cfg, dtype_text, tracker, cfg.export.max_accuracy_drop if max_drop is None else max_drop)
