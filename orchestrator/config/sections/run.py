"""The `run` section (epochs, batches, seed, evaluation cadence, early stopping) and the job's own `callbacks`."""

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from omegaconf import MISSING

from orchestrator.config.strategies import DDP


@dataclass
class CallbackSection:
    name: str = MISSING
    """Import path `package.module:Class` of an object with any of the training loop's hook methods
    (`setup`, `before_step`, `after_backward`, `after_step`, `end_epoch`, `collect`, `on_checkpoint`,
    `state_dict`/`load_state_dict`, `teardown`; see docs/own-code.md)."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for its constructor."""


@dataclass
class EarlyStoppingSection:
    metric: str = "eval/loss"
    """The evaluation metric watched (`eval/loss`, `eval/accuracy`)."""
    mode: str = "min"
    """`min`: lower is better; `max`: higher is better."""
    patience: int = 3
    """Evaluations in a row without improvement after which training stops."""
    min_delta: float = 0.0
    """The least change that counts as an improvement."""


@dataclass
class RunSection:
    name: Optional[str] = None
    """Name of the Ray Train run and the MLflow run; defaults to `<job file stem>-<timestamp>`.
    Letters, digits, `.`, `_`, `-`, not starting with `.`: it names a directory under `checkpoint.storage_path`."""
    epochs: int = 1
    """Passes over the training set."""
    batch_size: int = 64
    """Batch size per worker (the global batch is this times num_workers, times `accumulate_steps`; elastic, times
    the range's max)."""
    seed: int = 0
    """Base seed; rank r seeds its RNGs with seed + r."""
    eval_every_n_epochs: int = 1
    """Evaluate on the held-out split every N epochs (and always after the last)."""
    eval_every_n_steps: Optional[int] = None
    """Also evaluate every N optimizer steps, mid-epoch included, logged with that step's report (Lightning's
    `val_check_interval`); a checkpoint taken at that step is scored by it (`checkpoint.score_metric`). Early
    stopping watches the evaluations at epoch ends. Null: at epoch ends only."""
    max_steps_per_epoch: Optional[int] = None
    """Stop each epoch after this many steps (for smoke runs); None trains on the whole shard."""
    freeze_norm: bool = False
    """Keep every normalisation layer in eval mode for the whole run (running statistics frozen, as when
    fine-tuning), under every preset, resume included."""
    accumulate_steps: int = 1
    """Micro-batches of `batch_size` per optimizer step (gradient accumulation): DDP syncs gradients on the last
    only, the loss scale is updated once per step. Effective batch: batch_size x accumulate_steps x num_workers (elastic:
    its max, whatever the workers now);
    steps, `max_steps_per_epoch` and checkpoints count optimizer steps."""
    worker_output: str = "rank0"
    """What the user's code prints on the workers (stdout, stderr) reaches the console, each line prefixed by its
    rank: `rank0` (rank 0's only), `all`, or `none` (kept in Ray's worker logs only)."""
    early_stopping: Optional[EarlyStoppingSection] = None
    """Stop when an evaluation metric stops improving (null: train all `epochs`)."""
