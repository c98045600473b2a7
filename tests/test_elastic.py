"""An elastic run (`scaling.num_workers: [min, max]`) keeps its global batch on any number of workers: each step is
the same samples whether one rank or several train it, so a run that resizes mid-epoch goes on from its checkpoint
with every sample of the epoch trained once, and the weights come out as those of a run that never resized."""

import itertools
import json

import pytest
import torch
from omegaconf import OmegaConf

from conftest import drill, small_job
from indexed_data import trained_steps
from orchestrator.config import load_job
from orchestrator.config.workers import Workers
from orchestrator.errors import BadInput
from orchestrator.train.samplers import ElasticSampler
from orchestrator.config.layout import Layout
from orchestrator.checkpoint.resume import CheckpointFacts, IncompatibleResume, check_resume


def job(write_job, *overrides, **sections):
    return load_job(write_job(small_job(**sections)), list(overrides))


# -- the config -----------------------------------------------------------------------------------------------------

def test_a_range_loads_and_says_what_ray_train_gets(write_job):
    cfg = job(write_job, scaling={"num_workers": [1, 3], "resize_check_s": 5})
    workers = Workers.of(cfg.scaling)
    assert (workers.min, workers.max, workers.elastic, str(workers)) == (1, 3, True, "[1, 3]")
    assert workers.for_ray() == (1, 3)
    assert Workers.of(job(write_job, "scaling.num_workers=[2,2]").scaling).for_ray() == (2, 2)
    assert Workers.of(job(write_job).scaling).for_ray() == 2  # a number stays a fixed count


@pytest.mark.parametrize("value, batch_size, problem", [
    ("[0,2]", 32, "needs 1 <= min <= max, got [0, 2]"),
    ("[3,2]", 32, "needs 1 <= min <= max, got [3, 2]"),
    ("[1,2,3]", 32, "two whole numbers [min, max], got [1, 2, 3]"),
    ("two", 32, "a number of workers, or an elastic range [min, max], got 'two'"),
    ("0", 32, "must be >= 1, got 0"),
    # 3 micro-batches of one sample (the global batch) cannot make 2 ranks x 2 non-empty micro-batches.
    ("[1,3]", 1, "with 2 workers the global batch of 3 samples (run.batch_size x run.accumulate_steps x 3) cannot "
                 "give each rank 2 non-empty micro-batches"),
])
def test_a_range_that_cannot_work_is_bad_input_naming_the_key(write_job, value, batch_size, problem):
    with pytest.raises(BadInput) as info:
        job(write_job, f"scaling.num_workers={value}", f"run.batch_size={batch_size}")
    assert "job.yaml: scaling.num_workers: " in str(info.value) and problem in str(info.value)


# -- the order ------------------------------------------------------------------------------------------------------

def steps_on(world_size: int, *, samples: int, batch_size: int, accumulate_steps: int, max_world_size: int,
             epoch: int = 0, from_step: int = 0) -> list[list[list[int]]]:
    """Each step's micro-batches of indices, rank by rank, on `world_size` ranks."""
    ranks = []
    for rank in range(world_size):
        sampler = ElasticSampler(list(range(samples)), rank=rank, world_size=world_size, seed=7, batch_size=batch_size,
                                 accumulate_steps=accumulate_steps, max_world_size=max_world_size)
        sampler.set_position(epoch, from_step * sampler.per_rank, batch_size)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        ranks.append([batches[i:i + sampler.per_rank] for i in range(0, len(batches), sampler.per_rank)])
    return [[mb for rank in ranks for mb in rank[step]] for step in range(len(ranks[0]))]


@pytest.mark.parametrize("batch_size, accumulate_steps, max_world_size", [(8, 1, 2), (5, 2, 4), (2, 1, 3)])
def test_each_step_is_the_same_samples_on_any_world_size_and_each_sample_comes_once_an_epoch(
        batch_size, accumulate_steps, max_world_size):
    samples = 101
    global_batch = batch_size * accumulate_steps * max_world_size
    by_world = {w: steps_on(w, samples=samples, batch_size=batch_size, accumulate_steps=accumulate_steps,
                            max_world_size=max_world_size) for w in range(1, max_world_size + 1)}
    for world_size, steps in by_world.items():
        assert len(steps) == samples // global_batch
        for step in steps:
            per_rank = Workers(1, max_world_size, True).micro_batches(accumulate_steps, world_size)
            assert len(step) == world_size * per_rank  # every rank as many forward passes
            assert max(map(len, step)) - min(map(len, step)) <= 1 and min(map(len, step)) >= 1
        flat = [sorted(itertools.chain(*step)) for step in steps]
        assert flat == [sorted(itertools.chain(*step)) for step in by_world[1]], world_size
        trained = list(itertools.chain(*flat))
        assert len(trained) == len(set(trained)) == (samples // global_batch) * global_batch
    other_epoch = steps_on(2, samples=samples, batch_size=batch_size, accumulate_steps=accumulate_steps,
                           max_world_size=max_world_size, epoch=1)
    assert [sorted(itertools.chain(*s)) for s in other_epoch] != [sorted(itertools.chain(*s)) for s in by_world[2]]


def test_an_epoch_split_between_world_sizes_at_a_step_still_trains_every_sample_once():
    shape = dict(samples=120, batch_size=4, accumulate_steps=1, max_world_size=3)
    before = steps_on(3, **shape)[:4]  # steps 1-4 on three ranks, then the run goes on from step 4 on two
    after = steps_on(2, from_step=4, **shape)
    trained = [i for step in before + after for mb in step for i in mb]
    assert len(before + after) == 10 and sorted(trained) == sorted(set(trained)) and len(trained) == 120


# -- resuming -------------------------------------------------------------------------------------------------------

def facts(layout: Layout, batches_done: int) -> CheckpointFacts:
    return CheckpointFacts(global_step=batches_done, epoch=0, batches_done=batches_done, layout=layout,
                           model_shapes={}, precision={})


def test_mid_epoch_an_elastic_run_resumes_on_another_world_size_within_its_max_and_a_fixed_one_does_not(write_job):
    elastic = job(write_job, scaling={"num_workers": [1, 4]}, run={"batch_size": 8, "max_steps_per_epoch": None})
    saved = Layout.of(elastic, 1437, 4)
    assert saved.steps_per_epoch == 1437 // 32 == Layout.of(elastic, 1437, 1).steps_per_epoch
    assert Layout.of(elastic, 1437, 3).micro_batches == 2 and saved.global_batch == 32
    resumed = check_resume(facts(saved, 10), Layout.of(elastic, 1437, 3), "here")
    assert (resumed.epoch, resumed.batches_done) == (0, 10)

    other_max = job(write_job, scaling={"num_workers": [1, 2]}, run={"batch_size": 8, "max_steps_per_epoch": None})
    with pytest.raises(IncompatibleResume, match=r"scaling.num_workers: 4 in the run, 2 in this job"):
        check_resume(facts(saved, 10), Layout.of(other_max, 1437, 2), "here")
    fixed = job(write_job, scaling={"num_workers": 2}, run={"batch_size": 8, "max_steps_per_epoch": None})
    with pytest.raises(IncompatibleResume, match=r"scaling.num_workers: 2 in the run, 1 in this job"):
        check_resume(facts(Layout.of(fixed, 1437, 2), 10), Layout.of(fixed, 1437, 1), "here")


# -- training -------------------------------------------------------------------------------------------------------

def weights(result: dict) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in result["weights"].items() if tensor.is_floating_point()}


def assert_same_weights(a: dict, b: dict) -> None:
    for name, tensor in weights(a).items():
        torch.testing.assert_close(weights(b)[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def elastic_job(write_job, tmp_path, workers: list[int], batch_size: int, **sections) -> dict:
    cfg = job(write_job, data={"name": "indexed_data:digits_with_ids", "kwargs": {"train_samples": 96}},
              scaling=sections.pop("scaling", {"num_workers": workers}), precision={"preset": "O0"},
              run={"epochs": 2, "batch_size": batch_size, "max_steps_per_epoch": None},
              tracking={"log_every_n_steps": 1}, checkpoint={"every_n_steps": 2},
              callbacks=[{"name": "indexed_data:RecordSamples", "kwargs": {"path": str(tmp_path / "samples")}},
                         *sections.pop("callbacks", [])], **sections)
    return OmegaConf.to_container(cfg, resolve=True)


@pytest.mark.slow  # trains in processes of its own
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_rank_or_two_train_the_same_steps_to_the_same_weights_with_uneven_micro_batches(
        write_job, tmp_path, strategy):
    """Range [1, 3], batches of 5: a step is 15 samples, three micro-batches of 5 on one rank, and on two ranks two
    micro-batches each, of 4, 4 and 4, 3 samples: each loss weighted by its share of the global batch. Under FSDP
    the two ranks' per-unit collectives stay paired (as many forward and backward passes each)."""
    from orchestrator.train.local import spawn

    one = spawn(elastic_job(write_job, tmp_path / "one", [1, 3], 5), world_size=1, directory=tmp_path / "one")
    two = spawn(elastic_job(write_job, tmp_path / "two", [1, 3], 5, scaling={"num_workers": [1, 3],
                                                                             "strategy": strategy}),
                world_size=2, directory=tmp_path / "two")
    assert_same_weights(one, two)
    assert {r.metrics["system/world_size"] for r in two["reports"] if "system/world_size" in r.metrics} == {2.0}
    for name in ("one", "two"):
        steps = trained_steps(tmp_path / name / "samples")
        assert list(steps) == list(range(1, 13))  # 96 // 15 = 6 steps an epoch
        sizes = sorted(len(mb) for record in steps[1] for mb in record["ids"])
        assert sizes == ([5, 5, 5] if name == "one" else [3, 4, 4, 4])


@pytest.mark.slow  # trains in processes of its own
def test_a_run_that_loses_a_rank_mid_epoch_goes_on_from_its_checkpoint_each_sample_once_same_weights(
        write_job, tmp_path):
    """Two ranks fail at step 5 (the checkpoint of step 4 is the newest, mid-epoch: 6 steps an epoch), the run goes
    on from it on one rank: every step after 4 is the samples it would have been, each epoch trains each sample once, and the
    weights are those of the run that kept two ranks."""
    from orchestrator.train.local import spawn

    straight = spawn(elastic_job(write_job, tmp_path / "straight", [1, 2], 8), world_size=2,
                     directory=tmp_path / "straight")
    resized = tmp_path / "resized"
    with pytest.raises(Exception, match="drill: interrupted at step 5"):
        spawn(elastic_job(write_job, resized, [1, 2], 8, callbacks=[drill("Interrupt", at_step=5)]), world_size=2,
              directory=resized)
    # What submit --resume checks before Ray starts: the range goes on mid-epoch, a fixed count does not.
    from orchestrator.runner.preflight import check_resume_against_run
    from orchestrator.train.models import build_model

    elastic_cfg = OmegaConf.merge(elastic_job(write_job, resized, [1, 2], 8),
                                  {"checkpoint": {"storage_path": str(resized)}})  # spawn's: <it>/checkpoints
    assert check_resume_against_run(elastic_cfg, "checkpoints", build_model(elastic_cfg.model), 96).global_step == 4
    fixed = OmegaConf.merge(elastic_cfg, {"scaling": {"num_workers": 1}})
    with pytest.raises(IncompatibleResume, match=r"--resume: scaling.num_workers: 2 in the run, 1 in this job"):
        check_resume_against_run(fixed, "checkpoints", build_model(fixed.model), 96)
    result = spawn(elastic_job(write_job, resized, [1, 2], 8), world_size=1, directory=resized)
    assert_same_weights(straight, result)

    steps = trained_steps(resized / "samples")
    assert list(steps) == list(range(1, 13))  # 96 // 16 = 6 steps an epoch, 2 epochs
    assert {r["world_size"] for r in steps[4]} == {2} and {r["world_size"] for r in steps[5]} == {1}
    for epoch in (0, 1):
        ids = [i for records in steps.values() for r in records if r["epoch"] == epoch for mb in r["ids"] for i in mb]
        assert sorted(ids) == list(range(96)), epoch
    assert json.loads(json.dumps(result["reports"][-1].metrics))["system/world_size"] == 1.0


def test_the_console_says_when_the_worker_group_changes_size(capsys):
    """The driver's writer, from the reports in order: a restarted attempt first sends again the report of the
    checkpoint it resumed from (the old group's size), then its own."""
    from orchestrator.tracking.writer import MlflowWriter
    from orchestrator.common.report import Report

    writer = MlflowWriter(relay=None)
    sized = lambda seq, step, size, **tags: Report(seq=seq, step=step, metrics={"system/world_size": size},  # noqa
                                                   tags=tags)
    writer.accept([sized(1, 1, 1.0), sized(2, 2, 1.0)])
    writer.accept([sized(2, 2, 1.0, resumed_from_step="2"), sized(3, 3, 2.0), sized(4, 4, 2.0)])
    writer.accept([sized(4, 4, 2.0, resumed_from_step="4"), sized(5, 5, 1.0)])
    assert capsys.readouterr().err.splitlines() == [
        "elastic: the run goes on with 2 worker(s) (was 1) from step 3, with the same global batch.",
        "elastic: the run goes on with 1 worker(s) (was 2) from step 5, with the same global batch."]


def test_a_training_set_smaller_than_one_global_batch_is_refused_before_ray_starts(write_job, tmp_path, monkeypatch):
    from orchestrator.runner.preflight import preflight

    monkeypatch.chdir(tmp_path)
    path = write_job(small_job(data={"name": "indexed_data:digits_with_ids", "kwargs": {"train_samples": 40}},
                               scaling={"num_workers": [1, 3]}, run={"batch_size": 16},
                               checkpoint={"storage_path": str(tmp_path / "storage")}))
    with pytest.raises(BadInput, match=r"run: the training set has 40 samples, too few for one optimizer step: a "
                                       r"step's global batch of 48 \(run.batch_size x run.accumulate_steps x 3, the "
                                       r"most workers of scaling.num_workers \[1, 3\]\)"):
        preflight([load_job(path)], path, address=None)
    preflight([load_job(path, ["scaling.num_workers=[1,2]"])], path, address=None)  # 32 samples a step: fits
