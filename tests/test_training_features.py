"""The training features AMP users expect, as torch.amp's recipes define them, on the Ray-free loop:
gradient clipping on unscaled gradients (the fp32 masters' where there are some) and never on a skipped
step, gradient accumulation equal to the bigger batch with DDP synchronising only the last micro-batch,
early stopping, and the learning rate in every report."""

import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from conftest import small_job
from drills import Overflow
from orchestrator.config import load_job
from orchestrator.train.data import build_rank_loaders
from orchestrator.train.local import LocalSession, spawn
from orchestrator.train.loop import TrainingLoop
from orchestrator.common.report import UNSCORED
from orchestrator.train.step import train_step
from orchestrator.train.stopping import EarlyStopping
from orchestrator.train.training import build_training

CPU = torch.device("cpu")


def first_batch(cfg):
    train_loader, _, position = build_rank_loaders(cfg, 0, 1, CPU)
    position.set_position(0, 0, cfg.run.batch_size)
    batch = next(iter(train_loader))
    return batch.args[0], batch.targets


def built(cfg):
    torch.manual_seed(0)  # the same initial weights for every build
    return build_training(cfg, CPU, total_steps=10)


def weights(training) -> dict:
    return {k: v.clone() for k, v in training.precision.fp32_state_dict().items()}


def distance(before: dict, after: dict) -> float:
    return math.sqrt(sum(((after[k] - before[k]).double() ** 2).sum().item() for k in before))


@pytest.mark.parametrize("preset", ["O1", "O2"])
def test_clipping_measures_and_clips_the_unscaled_gradients(write_job, preset):
    """Under a loss scale of 2^16, `train/grad_norm` is the fp32 model's own gradient norm (clipping before the
    unscale would see one 65536 times larger and clip the step to almost nothing), and SGD with lr 1 moves the
    weights by exactly the clip norm."""
    sections = dict(precision={"preset": preset, "init_scale": 2.0 ** 16}, scaling={"num_workers": 1},
                    optim={"lr": 1.0, "momentum": 0.0, "weight_decay": 0.0, "clip_grad_norm": 0.5},
                    run={"batch_size": 8})
    cfg = load_job(write_job(small_job(**sections)))
    inputs, targets = first_batch(cfg)

    reference = built(load_job(write_job(small_job(**{**sections, "precision": {"preset": "O0"}}), "fp32.yaml")))
    torch.nn.functional.cross_entropy(reference.prepared.model(inputs), targets).backward()
    true_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.prepared.model.parameters()]).item()
    assert true_norm > 2 * 0.5, "the batch's gradient must be big enough to be clipped"

    training = built(cfg)
    before = weights(training)
    loss, outcome = train_step(training, inputs, targets, CPU, step=1)
    assert outcome.stepped
    assert outcome.grad_norm.item() == pytest.approx(true_norm, rel=0.05)
    assert distance(before, training.precision.fp32_state_dict()) == pytest.approx(0.5, rel=0.02)


def test_a_step_the_scaler_skips_is_neither_clipped_nor_counted(write_job):
    cfg = load_job(write_job(small_job(precision={"preset": "O1"}, scaling={"num_workers": 1},
                                       optim={"clip_grad_norm": 0.5}, run={"batch_size": 8})))
    training = built(cfg)
    before = weights(training)
    inputs, targets = first_batch(cfg)
    overflow = lambda step: Overflow(at_steps=[1]).after_backward(SimpleNamespace(rank=0, training=training), step)  # noqa: E731
    _, outcome = train_step(training, inputs, targets, CPU, step=1, after_backward=overflow)
    assert not outcome.stepped and outcome.overflow
    assert outcome.grad_norm is None
    assert distance(before, training.precision.fp32_state_dict()) == 0.0


@pytest.mark.slow  # trains in processes of its own
def test_accumulating_four_batches_of_8_equals_one_batch_of_32_on_two_ddp_ranks(write_job, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the same kernels, summing alike, in both runs

    def trained(batch_size: int, accumulate: int, name: str) -> dict:
        cfg = load_job(write_job(small_job(precision={"preset": "O0"}, scaling={"num_workers": 2},
                                           run={"batch_size": batch_size, "accumulate_steps": accumulate,
                                                "max_steps_per_epoch": 2}), f"{name}.yaml"))
        return spawn(OmegaConf.to_container(cfg, resolve=True), world_size=2, directory=tmp_path / name)

    big, accumulated = trained(32, 1, "big"), trained(8, 4, "accumulated")
    for name, weight in big["weights"].items():
        torch.testing.assert_close(accumulated["weights"][name], weight, rtol=0, atol=1e-6, msg=name)
    assert [r.step for r in accumulated["reports"] if "train/loss" in r.metrics] == \
        [r.step for r in big["reports"] if "train/loss" in r.metrics]
    initial = built(load_job(write_job(small_job(precision={"preset": "O0"}), "initial.yaml"))).precision
    assert any(not torch.equal(initial.fp32_state_dict()[k], w) for k, w in big["weights"].items())


@pytest.mark.slow  # trains in processes of its own
def test_early_stopping_ends_the_run_at_the_first_evaluation_past_its_patience(write_job, tmp_path):
    """lr 0: evaluation never improves; with patience 2 the run stops after epoch 3 of 6, tagged, and every
    report carries the learning rate."""
    cfg = load_job(write_job(small_job(scaling={"num_workers": 1}, optim={"lr": 0.0},
                                       run={"epochs": 6, "max_steps_per_epoch": 2,
                                            "early_stopping": {"metric": "eval/loss", "patience": 2}})))
    reports = spawn(OmegaConf.to_container(cfg, resolve=True), world_size=1, directory=tmp_path / "run")["reports"]
    evaluated = [r for r in reports if "eval/loss" in r.metrics]
    assert [r.epoch for r in evaluated] == [1, 2, 3]
    assert evaluated[-1].tags["early_stopped_at_epoch"] == "3"
    assert reports and all(r.metrics["optim/lr"] == 0.0 for r in reports)


def test_evaluation_every_n_steps_is_in_that_steps_report_and_scores_the_checkpoint_taken_there(write_job,
                                                                                                  tmp_path):
    """`run.eval_every_n_steps` 2 with a checkpoint every step: the evaluations at steps 2 and 4 (mid-epoch) and
    at 5 (the epoch's end) are in those steps' reports; each checkpoint is scored by its own step's `eval/loss`,
    and one without an evaluation gets the worst score, so Ray Train drops it first."""
    cfg = load_job(write_job(small_job(scaling={"num_workers": 1}, run={"max_steps_per_epoch": 5,
                                                                        "eval_every_n_steps": 2},
                                       tracking={"log_every_n_steps": 10},
                                       checkpoint={"every_n_steps": 1, "score_metric": "eval/loss",
                                                   "score_mode": "min"})))
    session = LocalSession(0, 1, CPU, tmp_path / "checkpoints")
    TrainingLoop(cfg, session).run()
    assert [(r.step, "eval/loss" in r.metrics) for r in session.reports] == [
        (1, False), (2, True), (3, False), (4, True), (5, True)]
    assert [r.checkpoint_score for r in session.reports] == [
        UNSCORED, session.reports[1].metrics["eval/loss"], UNSCORED, session.reports[3].metrics["eval/loss"],
        session.reports[4].metrics["eval/loss"]]
    assert "train/loss" not in session.reports[1].metrics  # an evaluation alone reads no loss window


def test_early_stopping_counts_evaluations_without_an_improvement_beyond_min_delta():
    section = OmegaConf.create({"metric": "eval/accuracy", "mode": "max", "patience": 2, "min_delta": 0.01})
    stopping = EarlyStopping(section)
    values = (0.50, 0.60, 0.605, 0.62, 0.625, 0.629)
    decisions = [stopping.should_stop({"eval/accuracy": value}) for value in values]
    # 0.605 is within min_delta of 0.60, 0.625 and 0.629 of 0.62: the second of those in a row stops.
    assert decisions == [False, False, False, False, False, True]
    resumed = EarlyStopping(section, stopping.state())
    assert resumed.best == 0.62 and resumed.evaluations_without_improvement == 2


def test_accumulation_all_reduces_once_per_optimizer_step_and_updates_the_loss_scale_once(write_job, tmp_path):
    """Under fp16 autocast + GradScaler, 4 micro-batches make one optimizer step: DDP all-reduces the gradients
    only on the last (`no_sync` on the others) and the scaler steps and updates once."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from orchestrator.train.step import Step, accumulated_step

    cfg = load_job(write_job(small_job(precision={"preset": "O1"}, scaling={"num_workers": 1},
                                       run={"batch_size": 8, "accumulate_steps": 4})))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        all_reduces = []

        def counting(state, bucket):
            all_reduces.append(bucket.index())
            return allreduce_hook(state, bucket)

        def wrap(model):
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            ddp.register_comm_hook(None, counting)
            return ddp

        torch.manual_seed(0)
        training = build_training(cfg, CPU, total_steps=10, wrap=wrap)
        train_loader, _, position = build_rank_loaders(cfg, 0, 1, CPU)
        position.set_position(0, 0, cfg.run.batch_size)
        batches = iter(train_loader)
        step = Step(number=1, epoch=0, index=0, batches=[next(batches) for _ in range(4)])
        accumulated_step(training, step, CPU)
        outcome = step.outcome
        buckets = sorted(set(all_reduces))
        assert all_reduces == buckets, f"gradients all-reduced more than once in one optimizer step: {all_reduces}"
        assert outcome.stepped
        scaler = training.precision.guard.scaler
        assert int(scaler._growth_tracker.item()) == 1, "the loss scale must be updated once per optimizer step"
    finally:
        dist.destroy_process_group()
