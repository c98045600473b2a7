"""The names a job file may use for built-in models, datasets, losses and metrics, and the checks of those
names: a job is refused (exit 2, the key named) while it is loaded, before anything is built.

The registries that build what these names mean (`orchestrator.train.models`, `.data`, `.vision`, `.task`) are
keyed by these tuples; `tests/test_package.py` checks that they agree.
"""

import inspect
import re

from orchestrator.config.imports import is_import_path, resolve_import_path
from orchestrator.errors import BadInput

MODELS = ("simple_cnn", "resnet18", "three_conv", "transformer_lm")
"""Built-in models (`model.name`)."""

DATASETS = ("cifar10", "digits", "synthetic", "lm_text")
"""Built-in datasets with recipes of their own (`data.name`)."""

TORCHVISION_SPLIT_BY = {
    "MNIST": "train", "FashionMNIST": "train", "KMNIST": "train", "EMNIST": "train", "QMNIST": "train",
    "CIFAR10": "train", "CIFAR100": "train", "USPS": "train",
    "SVHN": "split", "STL10": "split", "Flowers102": "split", "DTD": "split", "GTSRB": "split"}
"""torchvision datasets by name, and how each picks its training or test part (`train=` or `split=`)."""
IMAGE_FOLDER = "ImageFolder"
TORCHVISION_DATASETS = (*TORCHVISION_SPLIT_BY, IMAGE_FOLDER)

CLASSIFICATION_LOSSES = ("cross_entropy",)
"""Losses whose outputs are class scores, so accuracy means something."""
NEXT_TOKEN_LOSS = "next_token"
"""A causal language model's loss: the logits at each position against the next token's label (ignoring -100)."""
LOSSES = (*CLASSIFICATION_LOSSES, "mse", "bce_with_logits", "model", NEXT_TOKEN_LOSS)
"""Built-in losses; `model`: the loss the model returns."""
CLASS_SCORE_METRICS = ("accuracy", "top5", "token_accuracy")
"""Built-in metrics of class scores against integer targets. `accuracy`, `top5`: one prediction per sample (outputs
N x classes); `token_accuracy`: one per token (outputs N x tokens x classes, targets N x tokens, `-100` ignored)."""
METRICS = (*CLASS_SCORE_METRICS, "perplexity")
"""Built-in metrics; `perplexity`: exp of the evaluation's mean loss (a token-level cross-entropy)."""


def check_model_name(name: str, where: str = "model.name") -> None:
    """A built-in model, or an import path to the user's class or factory (imported, not called)."""
    if is_import_path(name):
        resolve_import_path(name, where, kind="model")
    elif name not in MODELS:
        raise BadInput(f"{where}: unknown model '{name}'. Use one of {', '.join(MODELS)} or an import path like "
                       "'mypackage.models:MyNet'.")


def check_dataset_name(name: str) -> None:
    """A built-in dataset, or an import path to the user's factory (imported, not called)."""
    if is_import_path(name):
        resolve_import_path(name, "data.name", kind="dataset factory")
    elif name not in DATASETS and name not in TORCHVISION_DATASETS:
        raise BadInput(f"data.name: unknown dataset '{name}'. Use one of {', '.join(DATASETS)}, a torchvision dataset "
                       f"({', '.join(TORCHVISION_DATASETS)}), or an import path 'mypackage.data:make_datasets' to a "
                       "function returning (train dataset, eval dataset).")


def check_collate(name) -> None:
    """`data.collate`: an import path to the user's collate function (imported, not called)."""
    if name is not None:
        if not is_import_path(name):
            raise BadInput(f"data.collate: '{name}' is not an import path 'mypackage.data:collate' to a function "
                           "(list of samples) -> batch.")
        resolve_import_path(name, "data.collate", kind="collate function")


def check_loss_name(name: str) -> None:
    if is_import_path(name):
        resolve_import_path(name, "task.loss", kind="loss")
    elif name not in LOSSES:
        raise BadInput(f"task.loss: unknown loss '{name}'. Use one of {', '.join(LOSSES)} or an import path "
                       "'mypackage.losses:my_loss' to a function (outputs, targets) -> loss.")


def is_torchmetrics_class(target) -> bool:
    """Whether `target` (what an import path names) is a torchmetrics.Metric subclass."""
    if not inspect.isclass(target) or "torchmetrics" not in {c.__module__.split(".")[0] for c in target.__mro__}:
        return False
    from torchmetrics import Metric  # seconds to import; here only when `target` is one of its classes (so loaded)

    return issubclass(target, Metric)


def snake_case(name: str) -> str:
    """`MulticlassF1Score` -> `multiclass_f1_score`, `AUROC` -> `auroc`."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


METRIC_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-/]*")


def check_metric(spec, where: str, loss: str) -> None:
    """One `task.metrics` entry: a built-in, a function of the user's, or a torchmetrics Metric class whose
    constructor takes its kwargs (checked against its signature; nothing is called)."""
    name, kwargs = spec.name, dict(spec.kwargs)
    if not is_import_path(name):
        if name not in METRICS:
            raise BadInput(f"{where}.name: unknown metric '{name}'. Use {', '.join(METRICS)}, an import path "
                           "'mypackage.metrics:my_metric' to a function (outputs, targets) -> {name: (sum, count)}, "
                           "or a torchmetrics Metric class ('torchmetrics.classification:MulticlassF1Score').")
        if name == "perplexity" and loss in ("mse", "bce_with_logits"):
            raise BadInput(f"{where}: 'perplexity' is exp of a cross-entropy loss, but task.loss is '{loss}'. Drop "
                           "it from task.metrics.")
        if name in CLASS_SCORE_METRICS and loss == NEXT_TOKEN_LOSS:
            raise BadInput(f"{where}: '{name}' scores each sample or token against its own target, but task.loss "
                           f"'{loss}' predicts each position's next token (the targets are the input ids). Use "
                           "task.metrics: [perplexity], or a metric of your own by import path.")
        if name in CLASS_SCORE_METRICS and loss in ("mse", "bce_with_logits"):
            raise BadInput(f"{where}: '{name}' needs class scores, but task.loss is '{loss}'. Drop it from "
                           "task.metrics (e.g. task.metrics=[]) or give a metric of your own by import path.")
        target = None
    else:
        target = resolve_import_path(name, f"{where}.name", kind="metric")
    if target is not None and is_torchmetrics_class(target):
        try:
            inspect.signature(target).bind(**kwargs)
        except TypeError as exc:
            raise BadInput(f"{where}.kwargs: {name} does not take {kwargs} ({exc}). Fix the metric's kwargs.") from None
        if spec.log_as is not None and not METRIC_KEY.fullmatch(spec.log_as):
            raise BadInput(f"{where}.log_as: '{spec.log_as}' is not a metric name: use letters, digits, '_', '-', "
                           "'.' and '/'.")
        return
    if target is not None and (inspect.isclass(target) or not callable(target)):
        raise BadInput(f"{where}.name: '{name}' is neither a function (outputs, targets) -> {{name: (sum, count)}} "
                       "nor a torchmetrics.Metric class. Give one of the two.")
    for key, value in (("kwargs", kwargs or None), ("log_as", spec.log_as)):
        if value is not None:
            raise BadInput(f"{where}.{key}: only a torchmetrics Metric class takes {key}; '{name}' is a function "
                           "whose names are the keys it returns. Remove it.")


def check_task(task) -> None:
    """The loss and every metric resolve (import paths are imported, nothing is called), the built-in metrics fit
    the loss, and `task.inputs` comes with `task.target`."""
    check_loss_name(task.loss)
    for index, spec in enumerate(task.metrics):
        check_metric(spec, f"task.metrics[{index}]", task.loss)
    if task.inputs and task.target is None:
        raise BadInput(f"task.target: task.inputs names the model's inputs ({', '.join(task.inputs)}), so the batch "
                       "is not an (inputs, targets) pair: name the part the loss compares the outputs with "
                       "(e.g. task.target: labels).")
    if task.target is not None and task.target in task.inputs:
        raise BadInput(f"task.inputs: '{task.target}' is the target (task.target); it cannot be an input too.")


CALLBACK_METHODS = ("setup", "before_step", "after_backward", "after_step", "end_epoch", "collect", "on_checkpoint",
                    "state_dict", "load_state_dict", "teardown")
"""The training loop's hook methods (`orchestrator.train.hooks`): a callback has at least one of them."""


def check_callbacks(callbacks) -> None:
    """Each callback resolves to a class (or factory) of the user's, has at least one hook method, and takes its
    kwargs (checked against its signature; nothing is called)."""
    for index, spec in enumerate(callbacks):
        where = f"callbacks[{index}]"
        target = resolve_import_path(spec.name, f"{where}.name", kind="callback")
        if inspect.isclass(target) and not any(callable(getattr(target, m, None)) for m in CALLBACK_METHODS):
            raise BadInput(f"{where}.name: {spec.name} has none of the training loop's hook methods "
                           f"({', '.join(CALLBACK_METHODS)}): it would never run. Give it at least one.")
        try:
            inspect.signature(target).bind(**spec.kwargs)
        except TypeError as exc:
            raise BadInput(f"{where}.kwargs: {spec.name} does not take {dict(spec.kwargs)} ({exc}). Fix the "
                           "callback's kwargs.") from None
        except ValueError:  # no signature to check (a builtin): the call will tell
            pass
