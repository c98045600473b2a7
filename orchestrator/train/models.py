"""Models by registry name or by import path `package.module:Name`.

Import paths are resolved against the directory `submit` runs in; `launch`
ships that module to the workers (Ray runtime_env `py_modules`).
"""

import inspect
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from orchestrator.config.imports import import_module_from_cwd, is_import_path, is_installed, resolve_import_path
from orchestrator.config.names import check_model_name
from orchestrator.errors import BadInput
from orchestrator.train.transformer_lm import TransformerLM


class SimpleCNN(nn.Module):
    """Two conv+pool blocks and two linear layers, for in_channels x 32 x 32 inputs (`image_size` for others)."""

    def __init__(self, num_classes: int = 10, width: int = 16, in_channels: int = 3, image_size: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * width * (image_size // 4) ** 2, 128),
            nn.ReLU(inplace=True),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def resnet18(num_classes: int = 10, in_channels: int = 3) -> nn.Module:
    """torchvision's ResNet-18 adapted to small inputs (CIFAR's 32x32, MNIST's 28x28): 3x3 stem, stride 1, no
    max-pool; any size and `in_channels` (model.kwargs) channels, since it pools adaptively."""
    from torchvision.models import resnet18 as tv_resnet18  # torchvision: seconds to import, for this model only

    model = tv_resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


class ThreeConv(nn.Module):
    """The toy model of the "still 35 MB after fp16" question: three 3x3 convs (3->300->500->1000,
    no padding) and one linear layer, for 3x64x64 inputs; 9,223,901 parameters with one output."""

    def __init__(self, num_classes: int = 1, input_size: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 300, 3)
        self.conv2 = nn.Conv2d(300, 500, 3)
        self.conv3 = nn.Conv2d(500, 1000, 3)
        side = input_size - 6
        self.fc = nn.Linear(1000 * side * side, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = torch.relu(self.conv3(x))
        return self.fc(torch.flatten(x, 1))


REGISTRY: dict[str, Callable[..., nn.Module]] = {
    "simple_cnn": SimpleCNN,
    "resnet18": resnet18,
    "three_conv": ThreeConv,
    "transformer_lm": TransformerLM,
}


def resolve_factory(name: str, where: str = "model.name") -> Callable[..., nn.Module]:
    check_model_name(name, where)
    if not is_import_path(name):
        return REGISTRY[name]
    # Refuses the standard library and builtins before anything is called (`os:system` runs a shell).
    return resolve_import_path(name, where, kind="model")


def _from_config(model_class: type, config: type, **kwargs: Any) -> nn.Module:
    """A Hugging Face model built from its configuration (its own initialisation; no weights downloaded)."""
    return model_class(config(**kwargs))


def _accepts(factory: Callable, arg: str) -> bool:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == arg or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def config_class(factory: Callable) -> Optional[type]:
    """The configuration class of a Hugging Face model class (`BertForSequenceClassification` -> `BertConfig`),
    which is built from one; None for anything else."""
    config = getattr(factory, "config_class", None) if inspect.isclass(factory) else None
    return config if inspect.isclass(config) and hasattr(factory, "from_pretrained") else None


def build_model(model_cfg) -> nn.Module:
    factory = resolve_factory(model_cfg.name)
    kwargs = dict(model_cfg.kwargs)
    config = config_class(factory)
    if config is not None:  # a Hugging Face class: model.kwargs are its config's, num_classes its num_labels
        if model_cfg.num_classes is not None:
            kwargs.setdefault("num_labels", model_cfg.num_classes)
        factory = partial(_from_config, factory, config)
    elif model_cfg.num_classes is not None and _accepts(factory, "num_classes"):
        kwargs.setdefault("num_classes", model_cfg.num_classes)
    # Any failure here comes from the job's values (num_classes=-1 is a RuntimeError): bad input, not a crash.
    try:
        model = factory(**kwargs)
    except Exception as exc:  # noqa: BLE001
        first_line = (str(exc).strip().splitlines() or [""])[0]
        raise BadInput(f"model.kwargs: cannot build '{model_cfg.name}' (model.name) with {kwargs}: "
                       f"{type(exc).__name__}: {first_line}. Fix model.kwargs or model.num_classes.") from None
    if not isinstance(model, nn.Module):
        raise BadInput(f"model.name: '{model_cfg.name}' returned {type(model).__name__}, not a torch.nn.Module.")
    return model


def module_source(name: str, where: str = "model.name") -> Path | None:
    """The file or package directory to ship to workers for an import path (`name`).

    None for registry names, for modules installed in the environment and for ampflow's own (workers have
    those). A module found elsewhere (the submit directory, or any directory on the driver's sys.path) is the
    user's code, and goes with the job.
    """
    if not is_import_path(name):
        return None
    top = name.partition(":")[0].split(".")[0]
    if top == "orchestrator":
        return None
    module = import_module_from_cwd(top, where)
    file = Path(module.__file__ or "").resolve()
    return None if is_installed(file) else (file.parent if file.name == "__init__.py" else file)


def module_sources(cfg) -> list[Path]:
    """Every module of the user's own code a job names by import path (model, data, collate, loss, metrics,
    callbacks), once."""
    named = [(cfg.model.name, "model.name"), (cfg.data.name, "data.name"), (cfg.task.loss, "task.loss"),
             *([(cfg.data.collate, "data.collate")] if cfg.data.collate is not None else []),
             *((metric.name, f"task.metrics[{index}].name") for index, metric in enumerate(cfg.task.metrics)),
             *((callback.name, f"callbacks[{index}].name") for index, callback in enumerate(cfg.callbacks))]
    sources = (module_source(name, where) for name, where in named)
    return list(dict.fromkeys(source for source in sources if source is not None))