"""Your own optimizer, parameter groups and schedule: an optimizer class by import path with its own kwargs,
groups chosen by parameter name (the fp32 masters' under O2), a precision lint that measures the real class
and each group, a schedule of your own or a built-in one after a warmup, advanced once per optimizer step
taken; bad input named by its key before anything starts; exact resume (CPU, no Ray)."""

import re
import shutil

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from conftest import drill, small_job
from orchestrator.config import load_job
from orchestrator.config.schema import OptimSection
from orchestrator.errors import BadInput
from orchestrator.runner.precision_lint import lint
from orchestrator.config.optim import check
from orchestrator.train import optim
from orchestrator.checkpoint.files import read_checkpoint
from orchestrator.train.local import LocalSession
from orchestrator.train.loop import TrainingLoop
from orchestrator.train.models import build_model
from orchestrator.train.step import train_step
from orchestrator.train.training import build_training

CPU = torch.device("cpu")

SCHEDULES = '''
from torch.optim.lr_scheduler import LambdaLR


def warm_then_halve(optimizer, total_steps, every=2):
    """Two steps at half the rate, then the full rate halved every `every` steps."""
    return LambdaLR(optimizer, lambda step: 0.5 if step < 2 else 0.5 ** ((step - 2) // every))


def not_a_schedule(optimizer, total_steps):
    return "cosine"
'''


@pytest.fixture
def own_schedules(tmp_path, monkeypatch):
    """A user's module of schedule factories, importable from the directory submit runs in."""
    (tmp_path / "own_schedules.py").write_text(SCHEDULES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "own_schedules"


def section(**fields):
    return OmegaConf.structured(OptimSection(**fields))


# -- the optimizer and its groups -----------------------------------------------------------------


def test_groups_take_parameters_by_name_and_their_settings_step_the_fp32_masters(write_job):
    """Under O2 the model's weights are fp16 and the optimizer steps fp32 masters: each group holds the masters
    of the parameters its glob names, and steps them with its own learning rate (AdamW's first step moves every
    weight by about its lr)."""
    cfg = load_job(write_job(small_job(
        precision={"preset": "O2"}, scaling={"num_workers": 1},
        optim={"name": "adamw", "lr": 0.01, "weight_decay": 0.1,
               "param_groups": [{"match": "*.bias", "weight_decay": 0.0}, {"match": "classifier.*", "lr": 0.001}]})))
    torch.manual_seed(0)
    training = build_training(cfg, CPU, total_steps=4)
    names = {id(tensor): name for name, tensor in training.precision.named_tensors}
    groups = training.optimizer.param_groups
    assert [sorted(names[id(tensor)] for tensor in group["params"]) for group in groups] == [
        ["features.0.weight", "features.3.weight"],
        ["classifier.1.bias", "classifier.3.bias", "features.0.bias", "features.3.bias"],
        ["classifier.1.weight", "classifier.3.weight"],
    ]
    assert [(group["lr"], group["weight_decay"]) for group in groups] == [(0.01, 0.1), (0.01, 0.0), (0.001, 0.1)]
    model = training.prepared.raw
    stepped = [tensor for group in groups for tensor in group["params"]]
    assert model.features[0].weight.dtype == torch.float16
    assert all(tensor.dtype == torch.float32 for tensor in stepped)
    assert not {id(tensor) for tensor in stepped} & {id(param) for param in model.parameters()}

    before = {name: tensor.detach().clone() for name, tensor in training.precision.named_tensors}
    generator = torch.Generator().manual_seed(0)
    _, outcome = train_step(training, torch.randn(8, 3, 32, 32, generator=generator),
                            torch.randint(0, 10, (8,), generator=generator), CPU, step=1)
    assert outcome.stepped
    after = dict(training.precision.named_tensors)
    moved = {name: (after[name] - before[name]).abs().max().item() for name in before}
    assert moved["features.0.weight"] == pytest.approx(0.01, rel=0.05)
    assert moved["classifier.3.weight"] == pytest.approx(0.001, rel=0.05)
    # The fp16 weights are the rounded masters.
    assert torch.equal(model.classifier[3].weight, after["classifier.3.weight"].half())


def test_a_glob_matches_a_parameter_name_or_its_modules_class_and_the_first_match_wins():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.LayerNorm(8))
    cfg = section(param_groups=[{"match": "*Norm*", "weight_decay": 0.0}, {"match": "*.bias", "lr": 0.5}])
    assert optim.groups_of(cfg, model) == {
        "0.weight": 0, "0.bias": 2, "1.weight": 1, "1.bias": 1, "2.weight": 0, "2.bias": 2, "3.weight": 1, "3.bias": 1}


def test_an_optimizer_by_import_path_gets_lr_weight_decay_its_kwargs_and_group_settings():
    model = nn.Linear(4, 2)
    cfg = section(name="torch.optim:RMSprop", lr=0.01, weight_decay=0.001, kwargs={"alpha": 0.9, "centered": True},
                  param_groups=[{"match": "bias", "alpha": 0.5}])
    check(cfg)
    optimizer = optim.build_optimizer(cfg, model.named_parameters(), model)
    assert type(optimizer) is torch.optim.RMSprop
    default, bias = optimizer.param_groups
    assert (default["lr"], default["weight_decay"], default["alpha"], default["centered"]) == (0.01, 0.001, 0.9, True)
    assert default["momentum"] == 0  # optim.momentum is the built-in sgd's, not passed to another class
    assert bias["alpha"] == 0.5 and bias["params"] == [model.bias]


def test_the_param_group_table_says_where_each_parameter_landed():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    cfg = section(name="sgd", lr=0.1, param_groups=[{"match": "BatchNorm*", "weight_decay": 0.0}])
    named = list(model.named_parameters())
    optimizer = optim.build_optimizer(cfg, named, model)
    optim.build_scheduler(section(name="sgd", schedule="cosine", warmup_fraction=0.5), optimizer, 10)
    table = optim.param_group_table(cfg, optimizer, named)
    assert [(row["parameter"], row["group"], row["match"]) for row in table] == [
        ("0.weight", 0, "default"), ("0.bias", 0, "default"),
        ("1.weight", 1, "param_groups[0]: BatchNorm*"), ("1.bias", 1, "param_groups[0]: BatchNorm*")]
    assert table[0] == {"parameter": "0.weight", "group": 0, "match": "default", "shape": [8, 4],
                        "dtype": "float32", "lr": 0.1, "weight_decay": 5e-4}  # the rate before the warmup
    assert table[2]["weight_decay"] == 0.0


@pytest.mark.parametrize("optim_section, expected", [
    ({"name": "orchestrator.train.models:SimpleCNN"}, ["optim.name", "not a torch.optim.Optimizer subclass"]),
    ({"name": "torch.optim:RMSprop", "kwargs": {"alpah": 0.9}},
     ["optim.kwargs.alpah", "takes no argument 'alpah'", "alpha"]),
    ({"name": "adam", "kwargs": {"lr": 0.1}}, ["optim.kwargs.lr", "set optim.lr instead"]),
    ({"name": "sgd", "kwargs": {"betas": [0.9, 0.99]}}, ["optim.kwargs.betas", "takes no argument 'betas'"]),
    ({"name": "torch.optim:LBFGS"}, ["optim.weight_decay", "LBFGS takes no 'weight_decay'"]),
    ({"param_groups": [{"match": "*.bias", "momentun": 0.0}]},
     ["optim.param_groups[0].momentun", "takes no argument", "momentum"]),
    ({"param_groups": [{"lr": 0.1}]}, ["optim.param_groups[0].match"]),
    ({"param_groups": [{"match": "*.bias", "lr": -1.0}]}, ["optim.param_groups[0].lr", ">= 0"]),
    ({"schedule": "torch.optim:SGD"}, ["optim.schedule", "not an LRScheduler"]),
    ({"schedule": "torch.optim.lr_scheduler:ReduceLROnPlateau"}, ["optim.schedule", "without a metric"]),
    ({"schedule": "torch.optim.lr_scheduler:StepLR"}, ["optim.schedule_kwargs", "step_size"]),
    ({"schedule": "torch.optim.lr_scheduler:StepLR", "schedule_kwargs": {"step_size": 2, "gama": 0.5}},
     ["optim.schedule_kwargs", "gama"]),
    ({"schedule": "cosine", "schedule_kwargs": {"T_max": 5}}, ["optim.schedule_kwargs", "import-path"]),
    ({"schedule": "cosine", "warmup_fraction": 1.0}, ["optim.warmup_fraction", "[0, 1)"]),
    ({"schedule": "torch.optim.lr_scheduler:StepLR", "schedule_kwargs": {"step_size": 2}, "warmup_fraction": 0.1},
     ["optim.warmup_fraction", "your own schedule"]),
])
def test_bad_optimizer_or_schedule_input_names_its_key_when_the_job_loads(write_job, optim_section, expected):
    with pytest.raises(BadInput) as info:
        load_job(write_job(small_job(optim=optim_section)))
    assert "job.yaml" in str(info.value)
    for fragment in expected:
        assert fragment in str(info.value)


def test_preflight_warns_of_a_glob_that_matches_nothing_and_refuses_what_the_optimizer_refuses(
        write_job, own_schedules, capsys):
    from orchestrator.runner.preflight import check_optimizer

    cfg = load_job(write_job(small_job(optim={"param_groups": [{"match": "*.bias", "weight_decay": 0.0},
                                                               {"match": "backbone.*", "lr": 1e-4}]})))
    model = build_model(cfg.model)
    warned: set[str] = set()
    check_optimizer(cfg, model, warned)
    check_optimizer(cfg, model, warned)  # a sweep's next point: not again
    printed = capsys.readouterr().err
    assert printed.count("warning:") == 1
    assert "optim.param_groups[1]: 'backbone.*' matches no parameter" in printed and "features.0.weight" in printed

    for sections, expected in [
        ({"name": "adam", "eps": -1.0}, "optim: adam refuses this job's settings (ValueError: Invalid epsilon"),
        ({"schedule": f"{own_schedules}:not_a_schedule"}, "optim.schedule: 'own_schedules:not_a_schedule' returned "
                                                          "a str, not a torch.optim.lr_scheduler.LRScheduler"),
    ]:
        bad = load_job(write_job(small_job(optim=sections), "bad.yaml"))
        with pytest.raises(BadInput, match=re.escape(expected)):
            check_optimizer(bad, model, set())


def test_the_lint_measures_the_jobs_own_optimizer_class_and_each_groups_settings(write_job):
    """fp16 state without masters (O3): Adam's v = g^2 underflows at eps 1e-7 but not at eps 1e-3, so only the
    group left at 1e-7 is an error; RMSprop (squares too) is measured and refused, Adamax (no squares) is not."""
    def findings(optim_section):
        cfg = load_job(write_job(small_job(precision={"preset": "O3"}, optim=optim_section)))
        return [finding for finding in lint(cfg, build_model(cfg.model)) if "Measured" in finding]

    grouped = findings({"name": "adam", "lr": 0.001, "eps": 1e-7,
                        "param_groups": [{"match": "classifier.*", "eps": 1e-3}]})
    assert len(grouped) == 1 and "group default" in grouped[0] and "v = g^2" in grouped[0]
    (rmsprop,) = findings({"name": "torch.optim:RMSprop", "lr": 0.001, "kwargs": {"eps": 1e-7}})
    assert rmsprop.severity == "error" and "optim.name=torch.optim:RMSprop" in rmsprop
    assert "master_weights: true" in rmsprop
    assert findings({"name": "torch.optim:Adamax", "lr": 0.001}) == []


# -- the schedule ---------------------------------------------------------------------------------


def rates(optim_cfg, total_steps: int, group_lrs=(0.1, 0.01)) -> list[list[float]]:
    """Each group's learning rate at each optimizer step, the schedule stepped after each."""
    params = [nn.Parameter(torch.zeros(1)) for _ in group_lrs]
    optimizer = torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, group_lrs)])
    scheduler = optim.build_scheduler(optim_cfg, optimizer, total_steps)
    seen = []
    for _ in range(total_steps):
        seen.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return seen


def test_a_warmup_rises_linearly_to_each_groups_rate_then_none_stays_and_cosine_anneals():
    constant = rates(section(schedule="none", warmup_fraction=0.3), 10)
    assert [lrs[0] for lrs in constant] == pytest.approx([0.025, 0.05, 0.075] + [0.1] * 7)
    assert all(lrs[1] == pytest.approx(lrs[0] / 10) for lrs in constant)  # each group at its own rate

    cosine = [lrs[0] for lrs in rates(section(schedule="cosine", warmup_fraction=0.3), 10)]
    assert cosine[:4] == pytest.approx([0.025, 0.05, 0.075, 0.1])
    assert all(later < earlier for earlier, later in zip(cosine[3:], cosine[4:]))
    assert cosine[-1] < 0.01

    assert [lrs[0] for lrs in rates(section(schedule="cosine"), 10)][0] == 0.1  # no warmup unless asked
    assert rates(section(schedule="none"), 3) == [[0.1, 0.01]] * 3


def test_a_warmup_then_cosine_resumes_from_its_checkpointed_state_where_it_was(tmp_path):
    """As a resumed run rebuilds it: a fresh optimizer and schedule, then both states loaded back (from a file
    read with weights_only, as checkpoints are)."""
    cfg = section(schedule="cosine", warmup_fraction=0.3)

    def built():
        optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
        return optimizer, optim.build_scheduler(cfg, optimizer, 10)

    optimizer, scheduler = built()
    for _ in range(2):  # into the warmup
        optimizer.step()
        scheduler.step()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp_path / "state.pt")
    straight = []
    for _ in range(8):
        straight.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()

    optimizer, scheduler = built()
    saved = torch.load(tmp_path / "state.pt", weights_only=True)
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    resumed = []
    for _ in range(8):
        resumed.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert resumed == straight and straight[:2] == pytest.approx([0.075, 0.1])


def test_onecycle_peaks_at_each_groups_own_rate():
    seen = rates(section(schedule="onecycle", lr=0.1), 20)
    assert max(lrs[0] for lrs in seen) == pytest.approx(0.1)
    assert max(lrs[1] for lrs in seen) == pytest.approx(0.01)


def test_a_schedule_by_import_path_a_class_with_kwargs_or_your_own_factory(own_schedules):
    step = rates(section(schedule="torch.optim.lr_scheduler:StepLR", schedule_kwargs={"step_size": 2, "gamma": 0.5}),
                 5, group_lrs=(0.1,))
    assert [lrs[0] for lrs in step] == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025])
    # OneCycleLR takes total_steps: it is given the run's, so it lasts exactly the run.
    one_cycle = section(schedule="torch.optim.lr_scheduler:OneCycleLR", schedule_kwargs={"max_lr": 0.1})
    check(one_cycle)
    assert len(rates(one_cycle, 7, group_lrs=(0.1,))) == 7
    own = section(schedule=f"{own_schedules}:warm_then_halve", schedule_kwargs={"every": 1})
    check(own)
    assert [lrs[0] for lrs in rates(own, 5, group_lrs=(0.1,))] == pytest.approx([0.05, 0.05, 0.1, 0.05, 0.025])


def test_the_schedule_advances_once_per_optimizer_step_taken(write_job, tmp_path):
    """4 optimizer steps of 2 micro-batches each under fp16 autocast, step 2's gradients overflowing (the scaler
    skips it): the schedule advances 3 times, not 8 (micro-batches) or 4 (steps). A 2-step warmup from 1/3 of
    the rate: the rate after the skipped step is still the one after step 1."""
    cfg = load_job(write_job(small_job(
        precision={"preset": "O1"}, scaling={"num_workers": 1}, optim={"lr": 0.03, "warmup_fraction": 0.5},
        run={"batch_size": 8, "accumulate_steps": 2, "max_steps_per_epoch": 4}, tracking={"log_every_n_steps": 1},
        callbacks=[drill("Overflow", at_steps=[2])], data={"name": "synthetic", "synthetic_samples": 128})))
    session = LocalSession(0, 1, CPU, tmp_path / "checkpoints")
    training = TrainingLoop(cfg, session).run()
    assert training.precision.guard.counters.skipped_steps == 1
    assert training.scheduler.last_epoch == 3
    after_step = {report.step: report.metrics["optim/lr"] for report in session.reports if "train/loss" in report.metrics}
    assert after_step == pytest.approx({1: 0.02, 2: 0.02, 3: 0.03, 4: 0.03})


# -- end to end -----------------------------------------------------------------------------------


def assert_bit_identical(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_bit_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_bit_identical(x, y, f"{where}[{index}]")
    else:
        assert a == b, where


def test_own_optimizer_groups_and_schedule_train_and_resume_bit_identical(write_job, tmp_path, own_schedules):
    """RMSprop by import path with three groups on O2's fp32 masters and a schedule factory of the user's: a run
    resumed from its step-4 checkpoint ends with the same weights, optimizer state (every group), schedule and
    loss scale as the run that was never interrupted, bit for bit."""
    cfg = load_job(write_job(small_job(
        precision={"preset": "O2"}, scaling={"num_workers": 1},
        optim={"name": "torch.optim:RMSprop", "lr": 0.002, "weight_decay": 1e-3, "kwargs": {"alpha": 0.95},
               "param_groups": [{"match": "*.bias", "weight_decay": 0.0}, {"match": "classifier.*", "lr": 5e-4}],
               "schedule": f"{own_schedules}:warm_then_halve", "schedule_kwargs": {"every": 2}},
        run={"epochs": 2, "batch_size": 8, "max_steps_per_epoch": 3}, checkpoint={"every_n_steps": 2})))

    def train(directory):
        session = LocalSession(0, 1, CPU, directory)
        return TrainingLoop(cfg, session).run(), session

    def final_state(directory):
        newest = sorted(path for path in directory.iterdir() if path.name.startswith("checkpoint_"))[-1]
        return read_checkpoint(newest, rank=0)

    straight, _ = train(tmp_path / "straight")
    interrupted = tmp_path / "interrupted"
    interrupted.mkdir()
    for checkpoint in (tmp_path / "straight").glob("checkpoint_*"):
        if int(checkpoint.name.split("_")[1]) <= 4:  # as if the run had died during step 5
            shutil.copytree(checkpoint, interrupted / checkpoint.name)
    resumed, session = train(interrupted)
    assert session.reports[0].tags["resumed_from_step"] == "4"

    a, b = final_state(tmp_path / "straight"), final_state(interrupted)
    assert a.global_step == b.global_step == 6
    for part in ("model", "optimizer", "scheduler", "scaler", "counters"):
        assert_bit_identical(getattr(a, part), getattr(b, part), part)
    # It trained, in its groups, under its schedule: step 6 runs at 1/4 of each group's rate.
    assert [group["lr"] for group in b.optimizer["param_groups"]] == pytest.approx([5e-4, 5e-4, 1.25e-4])
    assert b.scheduler["last_epoch"] == 6 - b.counters["skipped_steps"]
    at_step_4 = read_checkpoint(sorted(interrupted.glob("checkpoint_000000004_*"))[0], rank=0)
    assert all(torch.isfinite(weight).all() for weight in b.model.values())
    assert not torch.equal(at_step_4.model["features.0.weight"], b.model["features.0.weight"])
    table = optim.param_group_table(cfg.optim, resumed.optimizer, resumed.precision.named_tensors)
    assert {row["parameter"]: row["group"] for row in table} == {
        "features.0.weight": 0, "features.3.weight": 0, "features.0.bias": 1, "features.3.bias": 1,
        "classifier.1.bias": 1, "classifier.3.bias": 1, "classifier.1.weight": 2, "classifier.3.weight": 2}
    assert {row["dtype"] for row in table} == {"float32"}  # the masters; the model's weights are fp16
    assert resumed.prepared.raw.features[0].weight.dtype == torch.float16
