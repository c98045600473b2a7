"""What every Ray Train worker runs: the training loop (`orchestrator.train.loop`) in a Ray session.

The adapter adds nothing to the training: rank, world size and device come from Ray Train's
context, reports and checkpoints go to `ray.train.report`, the checkpoints to resume from are Ray
Train's newest and the older ones beside it in the run's storage, and the model is wrapped by
Ray Train's `prepare_model` with the job's DDP knobs. The controller-side relay turns the reports
into MLflow (`orchestrator.tracking`).
"""

import contextlib
import errno
from pathlib import Path
from typing import Any, Optional

import ray.train
import ray.train.torch
from omegaconf import OmegaConf

from orchestrator.runner import records
from orchestrator.tracking.relay import forwarded_output
from orchestrator.train.checkpoint import Candidate, directory_size, write_failure
from orchestrator.train.loop import TrainingLoop
from orchestrator.train.training import ddp_kwargs, register_comm_hook


class RaySession:
    def __init__(self, disk_full_at_step: Optional[int] = None) -> None:
        """`disk_full_at_step`: the `faults.disk_full_at_step` drill (Ray's copy of that step's checkpoint fails)."""
        context = ray.train.get_context()
        self.rank, self.world_size = context.get_world_rank(), context.get_world_size()
        self.device = ray.train.torch.get_device()
        self.storage = context.get_storage()  # DeveloperAPI in Ray 2.60: where the kill fault leaves its marker
        self.disk_full_at_step = disk_full_at_step

    def report(self, metrics: dict[str, Any], checkpoint: Optional[Path] = None,
               checkpoint_name: Optional[str] = None) -> None:
        if checkpoint is None:
            ray.train.report(metrics)
            return
        copy_fails = metrics.get("step") == self.disk_full_at_step
        try:
            with disk_full_during_copy() if copy_fails else contextlib.nullcontext():
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(checkpoint)),
                                 checkpoint_dir_name=checkpoint_name)
        except OSError as exc:  # Ray's copy to storage failed part-way (a full disk, a lost mount)
            target = f"{self.storage.experiment_fs_path}/{checkpoint_name}"
            remove_partial(self.storage.storage_filesystem, target)
            raise write_failure(exc, f"checkpoint {target} (rank {self.rank}'s part)",
                                directory_size(checkpoint)) from exc

    def checkpoints(self) -> list[Candidate]:
        return ray_candidates(self.storage.storage_filesystem, self.storage.experiment_fs_path)

    def fault_marker_dir(self) -> tuple[Any, str]:
        return self.storage.storage_filesystem, self.storage.experiment_fs_path

    def logged_through(self) -> int:
        return records.read_logged_through(self.storage.storage_filesystem, self.storage.experiment_fs_path)


def remove_partial(filesystem, path: str) -> None:
    """Remove a checkpoint directory Ray could not finish copying: never left for a resume to trip over."""
    from pyarrow import fs

    try:
        if filesystem.get_file_info(path).type != fs.FileType.NotFound:
            filesystem.delete_dir(path)
    except OSError:  # already gone, or another rank removed it first
        pass


@contextlib.contextmanager
def disk_full_during_copy():
    """The `faults.disk_full_at_step` drill: Ray's copy of a checkpoint to storage writes half of the first file,
    then fails with ENOSPC, as a disk filling up mid-copy does. Patches Ray's internal copy function
    (`ray.train.v2._internal.execution.storage._pyarrow_fs_copy_files`, Ray 2.60) for the one report."""
    from ray.train.v2._internal.execution import storage

    real = storage._pyarrow_fs_copy_files

    def copy_until_full(source, destination, source_filesystem=None, destination_filesystem=None, **kwargs):
        first = sorted(Path(source).iterdir())[0]
        destination_filesystem.create_dir(destination, recursive=True)
        with destination_filesystem.open_output_stream(f"{destination}/{first.name}") as out:
            out.write(first.read_bytes()[: first.stat().st_size // 2])
        raise OSError(errno.ENOSPC, "No space left on device (faults.disk_full_at_step)")

    storage._pyarrow_fs_copy_files = copy_until_full
    try:
        yield
    finally:
        storage._pyarrow_fs_copy_files = real


def ray_candidates(filesystem, run_dir: str) -> list[Candidate]:
    """Every checkpoint in the run's storage directory, newest first ([] for a new run).

    Not only the one Ray Train restores (`ray.train.get_checkpoint()`): a driver killed between the
    workers' upload of a checkpoint and Ray's registration of it leaves Ray pointing at an older one,
    or at none. Each rank's manifest vouches for a directory as for any other, and resuming from the
    newest complete one loses the fewest steps.
    """
    from pyarrow import fs

    infos = filesystem.get_file_info(fs.FileSelector(run_dir, allow_not_found=True))
    names = sorted((i.base_name for i in infos if i.type == fs.FileType.Directory
                    and i.base_name.startswith("checkpoint_")), reverse=True)
    checkpoints = [ray.train.Checkpoint(path=f"{run_dir}/{name}", filesystem=filesystem) for name in names]
    return [(c.path, c.as_directory) for c in checkpoints]


def train_loop(config: dict[str, Any]) -> None:
    cfg = OmegaConf.create(config["job"])

    def prepare(model):
        wrapped = ray.train.torch.prepare_model(model, parallel_strategy_kwargs=ddp_kwargs(cfg.ddp))
        register_comm_hook(wrapped, cfg.ddp.comm_hook)
        return wrapped

    session = RaySession(disk_full_at_step=cfg.faults.disk_full_at_step)
    with forwarded_output(config.get("relay"), session.rank, cfg.run.worker_output):
        TrainingLoop(cfg, session, run_id=config.get("run_id"), launched_at=config.get("launched_at"),
                     wrap=prepare).run()
