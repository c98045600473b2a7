"""Training data whose samples say who they are, for the tests that prove which samples each step trained on.

`digits_with_ids(train_samples)`: the first `train_samples` of the digits training set (and the whole eval set),
each image's first pixel replaced by its index / 1000 (`sample_ids` reads them back from a batch's inputs).
`RecordSamples(path)` is a callback: each rank appends, before each step, one JSON line per step to
`<path>.rank<r>.jsonl`: the attempt, rank, world size, epoch, step and the ids of its micro-batches.
"""

import json
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from orchestrator.train.data import _digits

SCALE = 1000.0


def digits_with_ids(train_samples: int = 96):
    train, evaluation = _digits()
    images, labels = (tensor[:train_samples].clone() for tensor in train.tensors)
    images[:, 0, 0, 0] = torch.arange(len(images), dtype=images.dtype) / SCALE
    return TensorDataset(images, labels), evaluation


def sample_ids(inputs: torch.Tensor) -> list[int]:
    return [int(round(value * SCALE)) for value in inputs[:, 0, 0, 0].tolist()]


class RecordSamples:
    def __init__(self, path: str):
        self.path = path

    def before_step(self, loop, step) -> None:
        line = {"attempt": loop.attempt, "rank": loop.rank, "world_size": loop.world_size, "epoch": step.epoch,
                "step": step.number, "ids": [sample_ids(batch.args[0]) for batch in step.batches]}
        with open(f"{self.path}.rank{loop.rank}.jsonl", "a") as out:
            out.write(json.dumps(line) + "\n")


def trained_steps(path: Path) -> dict[int, list[dict]]:
    """For each step, the records of the attempt that trained it last (what the run kept: an attempt that ended
    restarted from a checkpoint, and its steps after that checkpoint were trained again)."""
    records = [json.loads(line) for file in sorted(path.parent.glob(f"{path.name}.rank*.jsonl"))
               for line in file.read_text().splitlines()]
    latest: dict[int, int] = {}
    for record in records:
        latest[record["step"]] = max(latest.get(record["step"], 0), record["attempt"])
    steps: dict[int, list[dict]] = {}
    for record in records:
        if record["attempt"] == latest[record["step"]]:
            steps.setdefault(record["step"], []).append(record)
    return dict(sorted(steps.items()))
