"""Your own model, data, loss and metrics, by import path: a small regression on generated data.

Nothing here is image classification: 8 input features, one real-valued target, a Huber loss, and
mean absolute / squared error as the evaluation metrics. ampflow imports this module from the
directory you submit in and ships it to every Ray worker.
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset


class Mlp(nn.Module):
    """8 features -> one value."""

    def __init__(self, in_features: int = 8, hidden: int = 64):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                    nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).squeeze(-1)


def make_datasets(train_samples: int = 2048, eval_samples: int = 512, features: int = 8, noise: float = 0.1,
                  seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """y = sin(x . w) + x . v + noise, the same data on every worker (a fixed seed)."""
    generator = torch.Generator().manual_seed(seed)
    w, v = torch.randn(features, generator=generator), torch.randn(features, generator=generator) / features
    x = torch.randn(train_samples + eval_samples, features, generator=generator)
    y = torch.sin(x @ w) + x @ v + noise * torch.randn(len(x), generator=generator)
    return (TensorDataset(x[:train_samples], y[:train_samples]),
            TensorDataset(x[train_samples:], y[train_samples:]))


def huber(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss: (outputs, targets) -> the batch mean (ampflow hands it fp32 outputs)."""
    return nn.functional.huber_loss(outputs, targets.float(), delta=1.0)


def errors(outputs: torch.Tensor, targets: torch.Tensor) -> dict:
    """Metrics: {name: (sum, count)} for this batch; ampflow sums them over the eval set and all ranks and logs
    eval/mae and eval/mse."""
    error = outputs - targets.float()
    return {"mae": (error.abs().sum(), error.numel()), "mse": (error.pow(2).sum(), error.numel())}
