"""Train state <-> ray.train.Checkpoint.

Weights are always stored in fp32, whatever the training precision; everything
is plain tensors and numbers so loading works with `torch.load(weights_only=True)`.
"""

import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import ray.train
import torch
from torch import nn

STATE_FILE = "train_state.pt"


def fp32_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        key: (value.detach().float() if value.is_floating_point() else value.detach()).cpu()
        for key, value in model.state_dict().items()
    }


@contextmanager
def staged_checkpoint(state: dict[str, Any]) -> Iterator[ray.train.Checkpoint]:
    """Write `state` to a temporary directory and yield it as a Checkpoint to report."""
    with tempfile.TemporaryDirectory(prefix="ampflow-ckpt-") as tmp:
        torch.save(state, Path(tmp) / STATE_FILE)
        yield ray.train.Checkpoint.from_directory(tmp)


def load_state(checkpoint: Optional[ray.train.Checkpoint]) -> Optional[dict[str, Any]]:
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        return torch.load(Path(directory) / STATE_FILE, map_location="cpu", weights_only=True)
