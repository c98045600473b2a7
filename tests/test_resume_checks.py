"""`--resume` checks the job against the run before Ray starts: what the checkpoint can go on under is handled
exactly, the rest is refused with exit 2 naming the key and both values, and a changed preset is recorded on
the run. The run to resume is written the way a run writes it (the Ray-free loop into `<storage>/<run name>`,
the run record beside it), so no Ray is needed.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from conftest import run_mains, small_job
from orchestrator.config import load_job
from orchestrator.runner import records
from orchestrator.checkpoint.stored import newest, remove_unfinished
from orchestrator.runner.preflight import preflight
from orchestrator.train.local import LocalSession
from orchestrator.train.loop import TrainingLoop
from orchestrator.config.layout import Layout, steps_per_epoch
from orchestrator.checkpoint.resume import IncompatibleResume

CPU = torch.device("cpu")
RUN = "interrupted"


def run_job(storage: Path, **sections) -> dict:
    """One worker, 256 synthetic samples in batches of 32 (8 per epoch, 4 trained), cosine schedule."""
    job = small_job(data={"name": "synthetic", "synthetic_samples": 256}, scaling={"num_workers": 1},
                    optim={"schedule": "cosine"}, precision={"preset": "O0"}, checkpoint={"storage_path": str(storage),
                                                                                          "every_n_steps": 2},
                    run={"max_steps_per_epoch": 4})
    for name, values in sections.items():
        job[name] = {**job.get(name, {}), **values}
    return job


def interrupt(cfg, job_path: Path, run_id=None) -> None:
    """Train `cfg` as a run called RUN would be trained, then leave it as a killed driver leaves it."""
    storage = cfg.checkpoint.storage_path
    TrainingLoop(cfg, LocalSession(0, 1, CPU, Path(storage) / RUN), run_id=run_id).run()
    records.write_record(storage, RUN, job_file=str(job_path.resolve()), run_id=run_id, status="KILLED")


def test_the_steps_per_epoch_the_driver_computes_are_the_ones_the_loop_trains():
    from torch.utils.data import DataLoader, TensorDataset

    from orchestrator.train.samplers import train_shard

    for samples, world, batch, accumulate in [(256, 1, 32, 1), (1437, 2, 32, 1), (1437, 3, 50, 2), (10, 4, 3, 1)]:
        data = TensorDataset(torch.zeros(samples, 1))
        loader = DataLoader(data, batch_size=batch, sampler=train_shard(data, 0, world, seed=0))
        assert steps_per_epoch(samples, world, batch, accumulate, None) == len(loader) // accumulate
        assert steps_per_epoch(samples, world, batch, accumulate, 2) == min(2, len(loader) // accumulate)


# name: (overrides, what the one error line says)
REFUSED = {
    "model": (["model.kwargs.width=8"], "--resume: model: `features.0.weight` is 16x3x3x3 in the checkpoint and "
                                        "8x3x3x3 in this job's model"),
    "world_size": (["scaling.num_workers=2"], "--resume: scaling.num_workers: 1 in the run, 2 in this job. The "
                                              "checkpoint was taken in the middle of epoch 1 (step 2 of 4)"),
    "batch_size": (["run.batch_size=16"], "--resume: run.batch_size: 32 in the run, 16 in this job."),
    "accumulation": (["run.accumulate_steps=2"], "--resume: run.accumulate_steps: 1 in the run, 2 in this job."),
    "data_size": (["data.synthetic_samples=512"], "--resume: data (training samples): 256 in the run, 512 in this "
                                                  "job."),
    "schedule": (["optim.schedule=onecycle"], "--resume: optim.schedule: 'cosine' in the run, 'onecycle' in this job"),
    "schedule_length": (["run.epochs=2"], "--resume: the schedule's total steps: 4 in the run, 8 in this job "
                                          "(run.epochs 1 -> 2)"),
    "world_size_on_a_uri": (["scaling.num_workers=2", "checkpoint.storage_path=file://{storage}"],
                            "--resume: scaling.num_workers: 1 in the run, 2 in this job."),
}


def test_a_changed_job_is_refused_with_exit_2_naming_the_key_and_both_values_before_ray_starts(tmp_path):
    """The run's newest checkpoint is mid-epoch (step 2 of 4): each change is refused by `submit --resume` with
    one error line, no Ray started, nothing written; from a local path and from a storage URI alike."""
    storage = tmp_path / "storage"
    job_path = tmp_path / "jobs" / "job.yaml"
    job_path.parent.mkdir()
    job_path.write_text(yaml.safe_dump(run_job(storage)))
    interrupt(load_job(job_path), job_path)
    end_of_epoch = sorted((storage / RUN).glob("checkpoint_*"))[-1]
    shutil.rmtree(end_of_epoch)  # the driver died before it: the newest checkpoint is mid-epoch
    before = sorted(p.relative_to(storage) for p in storage.rglob("*"))

    argvs = {name: [str(job_path), "--resume", *(o.format(storage=storage) for o in overrides)]
             for name, (overrides, _) in REFUSED.items()}
    results = run_mains("orchestrator.cli.submit", argvs, tmp_path)
    for name, (_, message) in REFUSED.items():
        result = results[name]
        assert result["rc"] == 2, (name, result["stderr"])
        errors = [line for line in result["stderr"].splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and message in errors[0], (name, result["stderr"])
        assert "or start a new run without --resume" in errors[0]
        assert not result["ray"], f"{name}: Ray must not start for a refused resume"
    assert sorted(p.relative_to(storage) for p in storage.rglob("*")) == before


def test_a_checkpoint_at_an_epoch_end_goes_on_at_the_next_epoch_under_another_batch_size_and_more_epochs(
        write_job, tmp_path):
    """Trained 1 epoch in batches of 64 (4 steps); resumed for 2 epochs in batches of 32 (8 steps an epoch) with
    a constant learning rate: checked before Ray starts, then epoch 2 is trained whole (steps 5 to 12), never
    the rest of epoch 1 again."""
    storage = tmp_path / "storage"
    sections = dict(optim={"schedule": "none"}, run={"max_steps_per_epoch": None, "batch_size": 64})
    first = write_job(run_job(storage, **sections))
    interrupt(load_job(first), first)
    resumed = load_job(first, ["run.batch_size=32", "run.epochs=2"])
    (run,) = preflight([resumed], first, None, resume=True).runs
    assert run.resumed_from.global_step == 4 and run.resumed_from.layout.steps_per_epoch == 4

    session = LocalSession(0, 1, CPU, storage / RUN)
    TrainingLoop(resumed, session).run()
    resent, *trained = session.reports  # the checkpoint's own report is sent again first
    assert (resent.step, resent.epoch) == (4, 1)
    assert {r.epoch for r in trained} == {2} and min(r.step for r in trained) > 4
    assert trained[-1].step == 12 and trained[-1].total_steps == 12


def test_the_workers_refuse_a_mid_epoch_change_the_driver_did_not_see(write_job, tmp_path):
    storage = tmp_path / "storage"
    job_path = write_job(run_job(storage))
    cfg = load_job(job_path)
    interrupt(cfg, job_path)
    shutil.rmtree(sorted((storage / RUN).glob("checkpoint_*"))[-1])
    with pytest.raises(IncompatibleResume, match="run.batch_size: 32 in the run, 16 in this job"):
        TrainingLoop(load_job(job_path, ["run.batch_size=16"]), LocalSession(0, 1, CPU, storage / RUN))


def test_a_checkpoint_records_the_layout_it_was_trained_under(write_job, tmp_path):
    storage = tmp_path / "storage"
    job_path = write_job(run_job(storage))
    interrupt(load_job(job_path), job_path)
    stored = newest(str(storage), RUN)
    assert stored.name.startswith("checkpoint_000000004_") and stored.finite
    assert stored.facts.layout == Layout(world_size=1, batch_size=32, accumulate_steps=1, train_samples=256,
                                         steps_per_epoch=4, epochs=1, total_steps=4)
    assert stored.facts.layout.schedule == {"schedule": "cosine", "warmup_fraction": None, "schedule_kwargs": {}}
    assert stored.facts.model_shapes["features.0.weight"] == [16, 3, 3, 3]
    uri = newest(f"file://{storage}", RUN)  # the same small files, read through pyarrow's filesystem
    assert uri.facts == stored.facts


def test_after_a_failed_copy_the_part_a_peer_left_is_removed_and_the_newest_complete_checkpoint_stays(
        write_job, tmp_path):
    """A full disk: rank 0's copy of step 4 failed and it removed what it wrote; its peer's copy, into the same
    directory, succeeded and left rank 1's part. Once the workers are gone the driver removes it."""
    storage = tmp_path / "storage"
    job_path = write_job(run_job(storage))
    interrupt(load_job(job_path), job_path)
    run_dir = storage / RUN
    (complete,) = run_dir.glob("checkpoint_000000004_*")
    leftover = run_dir / "checkpoint_000000006_0"
    leftover.mkdir()
    (leftover / "rank1.pt").write_bytes(b"rank 1's part")
    (leftover / "manifest_rank1.json").write_text("{}")

    assert remove_unfinished(str(storage), RUN) == [str(leftover)]
    assert sorted(p.name for p in run_dir.glob("checkpoint_*")) == sorted(
        p.name for p in [*run_dir.glob("checkpoint_000000002_*"), complete])
    assert newest(str(storage), RUN).path == str(complete)
    assert remove_unfinished(f"file://{storage}", RUN) == []  # the complete ones are never touched


def test_the_driver_removes_them_after_a_failed_checkpoint_write_only():
    """As Ray Train hands the driver a worker's exception: wrapped in a RayTaskError that is also the cause's type."""
    from ray.exceptions import RayTaskError
    from ray.train import WorkerGroupError

    from orchestrator.runner.outcome import checkpoint_write_failed
    from orchestrator.checkpoint.files import CheckpointWriteError

    def failed(cause: Exception) -> WorkerGroupError:
        return WorkerGroupError("training failed", {1: RayTaskError("train_loop", "", cause).as_instanceof_cause()})

    assert checkpoint_write_failed(failed(CheckpointWriteError("could not write checkpoint ... disk is full")))
    assert not checkpoint_write_failed(failed(RuntimeError("a bug in the model")))
    assert not checkpoint_write_failed(RuntimeError("the controller failed"))


def test_a_resume_under_another_preset_is_recorded_on_the_run(write_job, tmp_path, mlflow_uri, capsys):
    from mlflow import MlflowClient

    from orchestrator.runner import driver
    from orchestrator.tracking.tracker import RunTracker

    storage = tmp_path / "storage"
    job_path = write_job(run_job(storage, tracking={"uri": mlflow_uri, "experiment": "presets"}))
    cfg = load_job(job_path)
    tracker = RunTracker.start(mlflow_uri, cfg, run_name=RUN, tags={"preset": "O0", "compute_dtype": "float32"},
                               params={"precision.preset": "O0"}, config_yaml="")
    interrupt(cfg, job_path, run_id=tracker.run_id)
    tracker.finish("KILLED")

    fp16 = load_job(job_path, ["precision.preset=O1"])
    (run,) = preflight([fp16], job_path, None, resume=True).runs
    plan = driver.plan_run(fp16, job_path, None, run)
    plan.tracker.finish("KILLED")
    data = MlflowClient(tracking_uri=mlflow_uri).get_run(tracker.run_id).data
    assert (data.tags["preset"], data.tags["compute_dtype"]) == ("O1", "float16")
    assert json.loads(data.tags["precision_history"]) == [
        {"from_step": 1, "preset": "O0", "compute_dtype": "float32"},
        {"from_step": 5, "preset": "O1", "compute_dtype": "float16"}]
    assert data.params["precision.preset"] == "O0"  # what trained steps 1-4
    assert data.params["from_step_5/precision.preset"] == "O1"
    assert data.params["from_step_5/precision.compute_dtype"] == "float16"
    assert "recorded on the run from step 5" in capsys.readouterr().err
