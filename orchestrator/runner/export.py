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
from orchestrator.common.modes import eval_mode
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


JOB_ARTIFACT = "config/job.yaml"
"""Where every run ampflow makes keeps its job (`RunTracker.start`): a run without it is not ampflow's."""


def run_job(tracker, command: str = "export"):
    """The job the run was made from (its `config/job.yaml`); BadInput when it has none: a run ampflow did not
    make, which `ampflow {command}` cannot take."""
    text = tracker.find_text(JOB_ARTIFACT)
    if text is None:
        raise BadInput(f"run {tracker.run_id} is not an ampflow run: it has no {JOB_ARTIFACT} artifact (every run "
                       f"ampflow makes keeps its job there), so `ampflow {command}` cannot take it. Give the id of a "
                       "run that ampflow trained.")
    return OmegaConf.create(text)


def logged_model_problem(tracker, cfg) -> Optional[str]:
    """Why the run (made from the job `cfg`) has no fp32 model `model` to load, in one line; None when it has one.
    A run logs it when it finishes: one that FAILED, was KILLED or is still RUNNING has none for that reason; a
    FINISHED one for `tracking.log_model: false`, or because logging it failed."""
    if tracker.has_logged_model("model"):
        return None
    status = tracker.status()
    if status == "FINISHED":
        if not cfg.tracking.get("log_model", True):
            return (f"run {tracker.run_id} has no model: it trained with tracking.log_model: false. Train the job "
                    "again with tracking.log_model: true.")
        return (f"run {tracker.run_id} FINISHED without a logged model 'model' although tracking.log_model is true: "
                "logging it failed, or the run left no checkpoint to log it from (its submit's output says which). "
                "Train the job again.")
    why = {"FAILED": "FAILED", "KILLED": "was KILLED", "RUNNING": "is still RUNNING"}.get(status, f"is {status}")
    todo = "Wait for it to finish." if status not in ("FAILED", "KILLED") else \
        "Resume it (`ampflow submit JOB --resume`) or train the job again."
    return (f"run {tracker.run_id} {why}, so it has no model: a run logs its model 'model' only when it finishes "
            f"training. {todo}")


def export_logged_run(tracker, dtype_text: str, max_drop: Optional[float] = None) -> ExportResult:
    """Export the run's logged fp32 model (`tracker`: its `RunTracker`) to `dtype_text`, within `max_drop`
    (default: the run's `export.max_accuracy_drop`). BadInput: the run cannot be exported (not ampflow's, no
    model, weights that do not fit its model); ExportRefused: it lost too much accuracy."""
    cfg = run_job(tracker)
    problem = logged_model_problem(tracker, cfg)
    if problem:
        raise BadInput(problem)
    model = trainable_copy(tracker.load_model(), cfg)
    return export(model, cfg, dtype_text, tracker, cfg.export.max_accuracy_drop if max_drop is None else max_drop)
