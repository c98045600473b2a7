"""The validation run: the chosen policy trained beside fp32 for a few steps, from the same seed, on the same
batches, through the training core's own step (`accumulated_step`): its optimizer, schedule, loss scaling and
guard. The policy passes when its loss curve stays within the tolerance of fp32's."""

import math
from dataclasses import dataclass

import torch
from omegaconf import OmegaConf

from orchestrator.config.schema import PrecisionSection
from orchestrator.train.batch import Batch
from orchestrator.train.rng import seed_everything
from orchestrator.train.step import Step, accumulated_step
from orchestrator.train.training import build_training


@dataclass
class Validation:
    fp32_losses: list[float]
    policy_losses: list[float]
    gap: float
    """Mean relative difference of the two loss curves (inf when the policy's loss was not finite)."""
    skipped_steps: int
    """Steps the policy's loss scaler skipped (overflow while the scale settles)."""

    def passed(self, tolerance: float) -> bool:
        return self.gap <= tolerance


def losses(cfg, precision: dict, batches: list[Batch], device: torch.device) -> tuple[list[float], int]:
    """The loss at each step of a short run of `cfg` under `precision` (a `precision` section) on `batches`, one
    optimizer step each, and how many steps were skipped."""
    job = OmegaConf.merge(cfg, {"precision": OmegaConf.merge(OmegaConf.structured(PrecisionSection), precision)})
    seed_everything(job.run.seed)
    training = build_training(job, device, total_steps=len(batches))
    curve = []
    for number, batch in enumerate(batches, start=1):
        step = Step(number=number, epoch=0, index=number - 1, batches=[batch])
        accumulated_step(training, step, device)
        training.precision.settle()  # the step's outcome read (the schedule advances on a step taken), as the loop does
        curve.append(float(step.loss))
    return curve, training.precision.guard.counters.skipped_steps


def compare(reference: list[float], curve: list[float], skipped: int) -> Validation:
    """The policy's curve against fp32's (`reference`, from `losses` with `FP32`)."""
    gaps = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(curve, reference)]
    gap = math.inf if not all(math.isfinite(v) for v in curve) else sum(gaps) / max(len(gaps), 1)
    return Validation(reference, curve, gap, skipped)


FP32: dict = {}
"""The precision section of plain fp32 training (O0): the schema's defaults."""
