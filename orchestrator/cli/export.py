"""Half-precision export for deployment, checked against the fp32 model's accuracy.

`python -m orchestrator.export RUN_ID --dtype float16|bfloat16` exports a finished
run's model; `export.dtype` in a job does the same at the end of training. The model
is cast per the run's policy (its rules hold; normalisation layers stay fp32), both
versions are scored on the eval set, `export/accuracy_delta` (exported - fp32) is
logged, and past `export.max_accuracy_drop` the export is refused: nothing is logged
as a model.
"""

import argparse
import copy
import sys
from pathlib import Path
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader

from orchestrator.train.data import build_datasets
from orchestrator.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, BadInput
from orchestrator.train.modes import eval_mode
from orchestrator.precision import Policy, apply, dtype_name, parse_dtype, plan
from orchestrator.precision.finite import model_nonfinite

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


@torch.no_grad()
def accuracy(model: nn.Module, dataset, device: torch.device, batch_size: int = 256) -> float:
    """Top-1 accuracy in eval mode; the model's own modes are restored afterwards."""
    correct = total = 0
    with eval_mode(model.to(device)):
        for inputs, targets in DataLoader(dataset, batch_size=batch_size):
            logits = model(inputs.to(device))
            correct += int((logits.float().argmax(dim=1) == targets.to(device)).sum())
            total += targets.numel()
    return correct / max(total, 1)


def export(model: nn.Module, cfg, dtype_text: str, tracker, max_drop: float) -> ExportResult:
    """Score fp32 vs exported on the eval set, log the metrics, and log the model unless refused."""
    dtype = parse_dtype(dtype_text, "export.dtype")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _, eval_set = build_datasets(cfg.data, cfg.model.num_classes)
    exported = cast_for_inference(model, cfg.precision, dtype)
    result = ExportResult(dtype_name(dtype), accuracy(model, eval_set, device), accuracy(exported, eval_set, device))
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
    example = np.zeros((2, *eval_set[0][0].shape), dtype=np.float32)  # batch 2: export keeps the batch dim dynamic
    tracker.log_model(exported.cpu(), example, name=f"model_{result.dtype}")
    tracker.set_tag("export_status", "logged")
    return result


def _trainable_copy(logged: nn.Module, cfg) -> nn.Module:
    """The job's model class with the logged fp32 weights: pt2 programs cannot be re-cast, modules can."""
    from orchestrator.train.models import build_model

    model = build_model(cfg.model)
    try:
        model.load_state_dict(logged.state_dict())
    except RuntimeError as exc:
        raise BadInput(f"the logged model's weights do not fit model.name={cfg.model.name}: {exc}") from None
    return model


def main(argv: Optional[Sequence[str]] = None) -> int:
    from orchestrator.tracking.secrets import install_console_redaction, redact
    from orchestrator.tracking.tracker import RunTracker, quick_http_failures, resolve_uri

    install_console_redaction()  # before anything can print the tracking URI's password (MLflow's lines included)
    quick_http_failures()

    parser = argparse.ArgumentParser(prog="python -m orchestrator.export",
                                     description="Export a finished run's model in half precision.")
    parser.add_argument("run_id")
    parser.add_argument("--dtype", required=True, choices=EXPORT_DTYPES)
    parser.add_argument("--max-accuracy-drop", type=float, default=None,
                        help="default: the run's export.max_accuracy_drop")
    parser.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI, else ./mlflow.db")
    args = parser.parse_args(argv)
    uri = resolve_uri(args.tracking_uri, Path.cwd())
    try:
        tracker = RunTracker.open(uri, args.run_id)
        cfg = OmegaConf.create(tracker.load_text("config/job.yaml"))
        model = _trainable_copy(tracker.load_model(), cfg)
        max_drop = args.max_accuracy_drop if args.max_accuracy_drop is not None else cfg.export.max_accuracy_drop
        result = export(model, cfg, args.dtype, tracker, max_drop)
    except BadInput as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ExportRefused as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    print(f"exported {args.run_id} as {result.describe()}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
