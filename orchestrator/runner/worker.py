"""What every Ray Train worker runs: the training loop (`orchestrator.train.loop`) in a Ray session.

The adapter adds nothing to the training: rank, world size and device come from Ray Train's
context, reports and checkpoints go to `ray.train.report`, the checkpoints to resume from are Ray
Train's newest and the older ones beside it in the run's storage, and under DDP the model is wrapped by
Ray Train's `prepare_model` with the job's DDP knobs (under `scaling.strategy: fsdp` the loop shards it
with FSDP2's `fully_shard` itself, not with Ray's FSDP1 `prepare_model(parallel_strategy="fsdp")`). The
controller-side relay turns the reports into MLflow (`orchestrator.tracking`).
"""

import time
from pathlib import Path
from typing import Any, Optional

import ray.train
import ray.train.torch
from omegaconf import OmegaConf

from orchestrator.runner import records
from orchestrator.tracking.relay import forwarded_output
from orchestrator.checkpoint.files import Candidate, checkpoint_names, directory_size, write_failure
from orchestrator.train.loop import TrainingLoop
from orchestrator.train.ddp import ddp_kwargs, register_comm_hook


class RaySession:
    def __init__(self) -> None:
        context = ray.train.get_context()
        self.rank, self.world_size = context.get_world_rank(), context.get_world_size()
        self.device = ray.train.torch.get_device()
        self.storage = context.get_storage()  # DeveloperAPI in Ray 2.60: the run's storage, to list checkpoints

    def report(self, metrics: dict[str, Any], checkpoint: Optional[Path] = None,
               checkpoint_name: Optional[str] = None) -> None:
        if metrics.get("at") is None:  # a report the loop did not time (a resumed attempt's first): now
            metrics = {**metrics, "at": time.time()}
        if checkpoint is None:
            ray.train.report(metrics)
            return
        try:
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(checkpoint)),
                             checkpoint_dir_name=checkpoint_name)
        except OSError as exc:  # Ray's copy to storage failed part-way (a full disk, a lost mount)
            target = f"{self.storage.experiment_fs_path}/{checkpoint_name}"
            remove_own_part(self.storage.storage_filesystem, target, Path(checkpoint))
            raise write_failure(exc, f"checkpoint {target} (rank {self.rank}'s part)",
                                directory_size(checkpoint)) from exc

    def checkpoints(self) -> list[Candidate]:
        return ray_candidates(self.storage.storage_filesystem, self.storage.experiment_fs_path)

    def logged_through(self) -> int:
        return records.read_logged_through(self.storage.storage_filesystem, self.storage.experiment_fs_path)

    def write_diagnostic(self, relative_path: str, text: str) -> None:
        path = f"{self.storage.experiment_fs_path}/{relative_path}"
        self.storage.storage_filesystem.create_dir(path.rpartition("/")[0], recursive=True)
        with self.storage.storage_filesystem.open_output_stream(path) as out:
            out.write(text.encode())


def remove_own_part(filesystem, target: str, staged: Path) -> None:
    """Remove what this rank was copying into the checkpoint directory `target` (the files of its staged checkpoint
    `staged`), never the directory: a peer may still be copying its own part into it, and would then fail on a
    directory gone (a collateral error that hides the cause) instead of on its own write. What peers leave behind is
    removed by the driver once every worker is gone (`orchestrator.checkpoint.stored.remove_unfinished`); a resume
    skips an incomplete checkpoint meanwhile."""
    for path in staged.rglob("*"):
        if path.is_file():
            try:
                filesystem.delete_file(f"{target}/{path.relative_to(staged).as_posix()}")
            except OSError:  # never copied, or storage itself is what failed
                pass


def ray_candidates(filesystem, run_dir: str) -> list[Candidate]:
    """Every checkpoint in the run's storage directory, newest first ([] for a new run).

    Not only the one Ray Train restores (`ray.train.get_checkpoint()`): a driver killed between the
    workers' upload of a checkpoint and Ray's registration of it leaves Ray pointing at an older one,
    or at none. Each rank's manifest vouches for a directory as for any other, and resuming from the
    newest complete one loses the fewest steps.
    """
    checkpoints = [ray.train.Checkpoint(path=f"{run_dir}/{name}", filesystem=filesystem)
                   for name in checkpoint_names(filesystem, run_dir)]
    return [(c.path, c.as_directory) for c in checkpoints]


def train_loop(config: dict[str, Any]) -> None:
    cfg = OmegaConf.create(config["job"])
    OmegaConf.set_readonly(cfg, True)  # read, never changed: its parts are built once (`orchestrator.config.job`)

    def prepare(model):
        wrapped = ray.train.torch.prepare_model(model, parallel_strategy_kwargs=ddp_kwargs(cfg.ddp))
        register_comm_hook(wrapped, cfg.ddp.comm_hook)
        return wrapped

    session = RaySession()
    with forwarded_output(config.get("relay"), session.rank, cfg.run.worker_output):
        TrainingLoop(cfg, session, run_id=config.get("run_id"), launched_at=config.get("launched_at"),
                     wrap=prepare).run()  # DDP's wrap; FSDP shards the model itself
