"""What a finished run leaves in MLflow besides its metrics: the chosen checkpoint's model (fp32, eval mode),
its registered version, the run's plots and the half-precision export."""

import math
import sys
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig

from orchestrator.errors import EXIT_FAILED, EXIT_OK
from orchestrator.precision.finite import NonFiniteModel, model_nonfinite
from orchestrator.runner.export import ExportRefused, export
from orchestrator.tracking.logged_model import ModelInputs
from orchestrator.tracking.run_model import register_model
from orchestrator.train import models
from orchestrator.common.report import Report
from orchestrator.train.strategy import load_trained_weights


def log_outputs(cfg: DictConfig, result, tracker, module_sources: Sequence[Path] = ()) -> tuple[Optional[str], int]:
    """Log the model of the chosen checkpoint (and register it), the plots, and the export when asked for;
    returns the logged model's URI (None when none was logged) and the exit code (the export can fail it)."""
    model_uri = None
    final_checkpoint = chosen_checkpoint(cfg, result, tracker)
    if cfg.tracking.log_model and final_checkpoint is not None:
        model_uri = log_trained_model(cfg, final_checkpoint, tracker, module_sources)
    if model_uri is not None and cfg.tracking.register_model:
        register_model(tracker, model_uri, cfg.tracking.register_model,
                       {"preset": cfg.precision.preset or "custom", "run_id": tracker.run_id,
                        **{key: f"{value:.6g}" for key, value in tracker.latest_metrics().items()
                           if key.startswith(("eval/", "train/loss"))}})
    tracker.log_plots(cfg.precision.preset)
    exit_code = EXIT_OK
    if cfg.export.dtype is not None and final_checkpoint is not None:
        exit_code = _export_after_training(cfg, final_checkpoint, tracker)
    return model_uri, exit_code


def log_trained_model(cfg: DictConfig, checkpoint, tracker, module_sources: Sequence[Path] = ()) -> Optional[str]:
    """Log the checkpoint's model (fp32, eval mode) to the run, taking the inputs it trained on (names, dtypes
    and an example from its first batch); returns its URI, or None with a warning when it cannot be logged (the
    trained run stands either way)."""
    try:
        model, state = _trained_model(cfg, checkpoint)
        if state.input_example:
            inputs = ModelInputs.from_example(model, state.input_example)
        elif state.sample_shape:  # a checkpoint written before the example was kept
            inputs = ModelInputs.from_shape(state.sample_shape)
        else:
            raise ValueError("its checkpoint does not record the inputs (written by an older version)")
        inputs.output = cfg.task.output
        model_format = tracker.log_model(model, inputs, code_paths=[str(source) for source in module_sources] or None)
        tracker.set_tag("model_format", model_format)
    except Exception as exc:
        print(f"warning: could not log the model to MLflow: {exc}", file=sys.stderr)
        return None
    try:
        best = tracker.tags().get("best_checkpoint_step")
        tracker.describe_model("model", int(best) if best else None, model_tags(cfg, model_format))
    except Exception as exc:  # the model is logged; only its page says less
        print(f"warning: could not link the run's metrics and datasets to its logged model: {exc}", file=sys.stderr)
    return f"runs:/{tracker.run_id}/model"


MODEL_DESCRIPTION = "mlflow.note.content"
"""The tag MLflow's UI shows as a logged model's (or a run's) description."""


def model_tags(cfg: DictConfig, model_format: str) -> dict[str, str]:
    """What the logged model is, on its page: the job's model, its fp32 weights, the policy it trained under, and
    the same in words as the page's description (MLflow's `mlflow.note.content`, shown first)."""
    rules = ", ".join(f"{rule.match}={rule.dtype}" for rule in cfg.precision.rules)
    policy = cfg.precision.preset or f"custom (compute {cfg.precision.compute_dtype}{'; ' + rules if rules else ''})"
    return {"model": str(cfg.model.name), "weights": "float32, eval mode", "trained_with": policy,
            "format": model_format,
            MODEL_DESCRIPTION: f"{cfg.model.name} as trained, its weights in float32 and in eval mode "
                               f"({model_format}); trained with the precision policy {policy}."}


def chosen_checkpoint(cfg: DictConfig, result, tracker):
    """The checkpoint whose model is logged (and exported): with `checkpoint.score_metric`, the best of those
    kept by it, tagged `best_checkpoint_step`; else the final one."""
    metric = cfg.checkpoint.score_metric
    if metric is None:
        return result.checkpoint
    reports = [(c, Report.from_wire(m)) for c, m in (result.best_checkpoints or [])]
    scored = [(c, r) for c, r in reports if isinstance(r.metrics.get(metric), (int, float))
              and not math.isnan(r.metrics[metric])]
    if not scored:
        print(f"warning: no checkpoint reported {metric} (checkpoint.score_metric); the final one is logged.",
              file=sys.stderr)
        return result.checkpoint
    pick = max if cfg.checkpoint.score_mode == "max" else min
    checkpoint, report = pick(scored, key=lambda pair: pair[1].metrics[metric])
    tracker.set_tags({"best_checkpoint_step": str(report.step), "best_checkpoint_score": str(report.metrics[metric])})
    return checkpoint


def _trained_model(cfg: DictConfig, checkpoint) -> tuple:
    """The job's model with the checkpoint's fp32 weights, in eval mode (what is logged and exported predicts:
    batch statistics never leak into a prediction), and the checkpoint's train state. NonFiniteModel when the
    weights are not finite. Under FSDP the weights are read whole from the checkpoint's shards here, on the
    driver."""
    model = models.build_model(cfg.model)
    state = load_trained_weights(checkpoint, model)
    problem = model_nonfinite(model)
    if problem:  # never logged nor exported
        raise NonFiniteModel(f"its weights are not finite ({problem})")
    return model.eval(), state


def _export_after_training(cfg: DictConfig, checkpoint, tracker) -> int:
    try:
        result = export(_trained_model(cfg, checkpoint)[0], cfg, cfg.export.dtype, tracker, cfg.export.max_accuracy_drop)
    except (ExportRefused, NonFiniteModel) as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(f"Exported as {result.describe()}")
    return EXIT_OK
