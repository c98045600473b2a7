"""`scaling.strategy: fsdp` through the training loop itself (`TrainingLoop`), without Ray: on two spawned gloo ranks,
the same fp32 job under DDP and FSDP ends at the same weights, each rank holds half the state, and a run whose rank
is killed resumes from its sharded checkpoint bit-identically; in one process, a collapsed loss scale rolls back to,
or promotes a layer from, this rank's shards. The config and pre-flight checks of the strategy, and the refusal of a
checkpoint written under the other strategy, need no process group."""

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from omegaconf import OmegaConf
from torch import nn

from conftest import REPO, drill, small_job
from orchestrator.config import load_job
from orchestrator.errors import BadInput

QUICKSTART = REPO / "jobs" / "quickstart.yaml"
IDENTITY_TOLERANCE = 1e-5
"""Largest |DDP - FSDP| allowed of a weight after 4 fp32 steps (SGD with momentum, 2 micro-batches each, clipped).
The two reduce in different orders (all-reduce vs reduce-scatter), so the last bits may differ: measured 3e-8,
while each step moves them by up to lr x clip = 2.5e-3."""
SIMPLE_CNN_PARAMS = 268_650


def job_config(tmp_path: Path, name: str, **sections):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(small_job(**sections), sort_keys=False))
    return load_job(path)


def spawned(cfg, directory: Path) -> dict:
    from orchestrator.train.local import spawn

    return spawn(OmegaConf.to_container(cfg, resolve=True), world_size=2, directory=directory)


# -- config and pre-flight ------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, problem", [
    (["scaling.strategy=zero"], "scaling.strategy: unknown strategy 'zero'. Use one of ddp, fsdp."),
    (["precision.reduce_dtype=int8"], "precision.reduce_dtype: unknown dtype 'int8'"),
    (["scaling.fsdp.wrap=['features', ' ']"], "scaling.fsdp.wrap[1]: must be a glob"),
    (["scaling.strategy=fsdp", "ddp.comm_hook=bf16"], "ddp.comm_hook: 'bf16' compresses DDP's all-reduce, which "
                                                      "scaling.strategy fsdp does not use"),
    (["scaling.strategy=fsdp", "perf.channels_last=true"], "perf.channels_last: torch's FSDP2 shards contiguous "
                                                           "parameters only"),
])
def test_a_strategy_setting_that_cannot_work_is_bad_input_naming_its_key(overrides, problem):
    with pytest.raises(BadInput) as info:
        load_job(QUICKSTART, overrides)
    assert problem in str(info.value) and str(QUICKSTART) in str(info.value)


def test_fsdp_settings_that_can_work_load():
    cfg = load_job(QUICKSTART, ["scaling.strategy=fsdp", "precision.reduce_dtype=bf16", "scaling.fsdp.wrap=[features]"])
    assert cfg.scaling.strategy == "fsdp" and list(cfg.scaling.fsdp.wrap) == ["features"]
    assert load_job(QUICKSTART, ["ddp.comm_hook=bf16"]).scaling.strategy == "ddp"  # the default strategy


class Tied(nn.Module):
    """An embedding-like input layer and an output layer sharing one weight."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4, bias=False)
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.mix(self.embed(x)))


def test_preflight_refuses_a_rule_fsdp_cannot_honour_and_a_wrap_glob_matching_nothing():
    from orchestrator.train.models import build_model
    from orchestrator.train.strategy import check_plan

    rule = "precision.rules=[{match: head, dtype: float32}]"
    with pytest.raises(BadInput, match=r"parameter '(embed|head)\.weight' is shared by .*rule 'head' \(float32\)"):
        check_plan(load_job(QUICKSTART, ["scaling.strategy=fsdp", "precision.preset=bf16-true", rule]), Tied())
    check_plan(load_job(QUICKSTART, ["precision.preset=bf16-true", rule]), Tied())  # DDP honours it
    cnn = build_model(load_job(QUICKSTART).model)
    with pytest.raises(BadInput, match=r"scaling.fsdp.wrap\[0\]: 'Block' matches no module holding parameters"):
        check_plan(load_job(QUICKSTART, ["scaling.strategy=fsdp", "scaling.fsdp.wrap=[Block]"]), cnn)


def test_submit_exits_2_before_anything_starts_when_the_units_cannot_be_planned(tmp_path, monkeypatch, capsys):
    from orchestrator.cli.submit import main

    monkeypatch.chdir(tmp_path)
    assert main([str(QUICKSTART), "scaling.strategy=fsdp", "scaling.fsdp.wrap=[Block]",
                 f"checkpoint.storage_path={tmp_path / 'runs'}", f"tracking.uri=sqlite:///{tmp_path / 'm.db'}"]) == 2
    assert "scaling.fsdp.wrap[0]: 'Block' matches no module holding parameters in SimpleCNN" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "m.db").exists()


def test_a_checkpoint_of_the_other_strategy_is_refused_naming_both(tmp_path):
    from orchestrator.train import rng
    from orchestrator.checkpoint.files import local_candidates, write_checkpoint_files
    from orchestrator.train.strategy import IncompatibleStrategy, resume, written_under

    ddp_written = tmp_path / "run" / "checkpoint_000000004_1"
    ddp_written.mkdir(parents=True)
    write_checkpoint_files(ddp_written, 0, {"model": {}, "optimizer": {}, "scheduler": {}, "scaler": None,
                                            "counters": {}}, {"rng": rng.capture(), "window": {}})
    assert written_under(ddp_written) == "ddp"
    cfg = load_job(QUICKSTART, ["scaling.strategy=fsdp"])
    built = []
    with pytest.raises(IncompatibleStrategy) as info:
        resume(cfg, local_candidates(tmp_path / "run"), 0, 1, torch.device("cpu"), built.append)
    assert "written under scaling.strategy ddp, and this job trains under fsdp" in str(info.value)
    assert "scaling.strategy=ddp" in str(info.value) and str(ddp_written) in str(info.value)
    assert built == []  # refused before anything was built

    fsdp_written = tmp_path / "other" / "checkpoint_000000004_1"
    fsdp_written.mkdir(parents=True)
    (fsdp_written / "manifest_rank0.json").write_text('{"strategy": "fsdp", "world_size": 2, "files": {}}')
    with pytest.raises(IncompatibleStrategy, match="under scaling.strategy fsdp, and this job trains under ddp"):
        resume(load_job(QUICKSTART), local_candidates(tmp_path / "other"), 0, 1, torch.device("cpu"), built.append)
    assert built == []


# -- two ranks: identity, memory per rank, exact resume ------------------------------------------------------------

@pytest.mark.slow
def test_the_same_fp32_job_ends_at_the_same_weights_under_ddp_and_fsdp_with_half_the_state_per_rank(tmp_path):
    """4 steps of SGD with momentum, each over 2 micro-batches (the first reduces nothing), clipped to a norm the
    gradients exceed: the step's no_sync and clip go through the strategy."""
    from orchestrator.precision import Policy, plan
    from orchestrator.precision.fsdp import FsdpSettings, plan_units
    from orchestrator.train.fsdp_memory import predict_rank_bytes
    from orchestrator.train.models import build_model

    sections = dict(precision={"preset": "O0"}, optim={"name": "sgd", "lr": 0.05, "momentum": 0.9,
                                                       "clip_grad_norm": 0.05},
                    run={"max_steps_per_epoch": 4, "accumulate_steps": 2}, tracking={"log_every_n_steps": 4})
    ddp = spawned(job_config(tmp_path, "ddp", **sections), tmp_path / "ddp")
    cfg = job_config(tmp_path, "fsdp", scaling={"num_workers": 2, "strategy": "fsdp"}, **sections)
    fsdp = spawned(cfg, tmp_path / "fsdp")

    assert list(fsdp["weights"]) == list(ddp["weights"])
    for name, weight in ddp["weights"].items():
        assert fsdp["weights"][name].dtype == torch.float32
        assert (fsdp["weights"][name] - weight).abs().max() <= IDENTITY_TOLERANCE, name
    ddp_norm, fsdp_norm = (next(r.metrics["train/grad_norm"] for r in run["reports"] if "train/grad_norm" in r.metrics)
                           for run in (ddp, fsdp))
    assert fsdp_norm == pytest.approx(ddp_norm, rel=1e-5)
    assert fsdp_norm > 0.05  # clipped: the norm before clipping exceeded the limit
    ddp_end, fsdp_end = ddp["reports"][-1].metrics, fsdp["reports"][-1].metrics  # the epoch's: memory

    # Each rank holds its shards: half of every parameter, gradient and momentum buffer (every first dimension of
    # simple_cnn is even), exactly as orchestrator.summary --strategy fsdp predicts.
    model = build_model(cfg.model)
    policy = Policy.from_config(cfg.precision)
    predicted = predict_rank_bytes(model, plan_units(model, policy, plan(model, policy), FsdpSettings()), 2,
                                   optimizer_states=1)
    for category in ("params", "grads", "optimizer"):
        assert ddp_end[f"memory/{category}_float32_bytes"] == SIMPLE_CNN_PARAMS * 4, category
        assert fsdp_end[f"memory/{category}_float32_bytes"] == predicted[category]["float32"] == SIMPLE_CNN_PARAMS * 2
    assert fsdp_end["memory/params_bytes"] == SIMPLE_CNN_PARAMS * 2
    assert fsdp_end["memory/rank0_state_bytes"] == fsdp_end["memory/rank1_state_bytes"] == 3 * SIMPLE_CNN_PARAMS * 2
    assert ddp_end["memory/rank1_state_bytes"] == 3 * SIMPLE_CNN_PARAMS * 4
    activations = "memory/activations_float32_bytes"
    assert fsdp_end[activations] == ddp_end[activations]  # a batch each, alike

    audit = {entry["name"]: entry for entry in fsdp["reports"][0].tables["precision/audit"]}
    assert audit["classifier.3"]["unit"] == "classifier" and audit["classifier.3"]["storage_dtype"] == "float32"


class LocalCheckpoint:
    def __init__(self, path: Path):
        self.path = path

    @contextmanager
    def as_directory(self):
        yield str(self.path)


def full_checkpoint(directory: Path) -> dict:
    """Every tensor of a sharded checkpoint, whole (model and optimizer state), and its train_state.pt."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # fills `state` itself

    from orchestrator.checkpoint.sharded import _SafePlanner, _SafeReader

    class Planner(_SafePlanner, _EmptyStateDictLoadPlanner):
        pass

    state: dict = {}
    _load_state_dict(state, storage_reader=_SafeReader(directory / "sharded"), planner=Planner(), no_dist=True)
    return {**state, "train_state": torch.load(directory / "train_state.pt", weights_only=True)}


@pytest.mark.slow
def test_a_killed_rank_resumes_from_the_sharded_checkpoint_bit_identical_to_an_uninterrupted_run(tmp_path):
    """O2 (fp16 units computing on fp32 shards), Adam, a loss scale growing every 2 steps and a one-cycle schedule:
    every piece of state moves. Rank 1 dies at the start of step 7; the newest checkpoint is step 6's, mid-epoch
    (the second epoch's, after one evaluation)."""
    from orchestrator.train.models import build_model
    from orchestrator.train.strategy import load_trained_weights

    sections = dict(scaling={"num_workers": 2, "strategy": "fsdp"},
                    precision={"preset": "O2", "init_scale": 1024, "growth_interval": 2},
                    optim={"name": "adam", "lr": 0.002, "schedule": "onecycle"},
                    run={"epochs": 2, "max_steps_per_epoch": 4, "batch_size": 16}, tracking={"log_every_n_steps": 3},
                    checkpoint={"every_n_steps": 3})
    straight = spawned(job_config(tmp_path, "straight", **sections), tmp_path / "straight")
    marker = tmp_path / "killed"
    killed = job_config(tmp_path, "killed", **sections,
                        callbacks=[drill("KillRank", rank=1, at_step=7, marker=str(marker))])
    with pytest.raises(Exception):  # torch.multiprocessing: a rank exited with code 1
        spawned(killed, tmp_path / "resumed")
    assert marker.exists()
    kept = sorted((tmp_path / "resumed" / "checkpoints").iterdir())
    assert [p.name.split("_")[1] for p in kept] == ["000000003", "000000004", "000000006"]
    (tmp_path / "resumed" / "rendezvous").unlink(missing_ok=True)  # the killed group's
    resumed = spawned(killed, tmp_path / "resumed")

    for name, weight in straight["weights"].items():
        assert torch.equal(resumed["weights"][name], weight), name  # atol=0
    (final_a,) = (tmp_path / "straight" / "checkpoints").glob("checkpoint_000000008_*")
    (final_b,) = (tmp_path / "resumed" / "checkpoints").glob("checkpoint_000000008_*")
    a, b = full_checkpoint(final_a), full_checkpoint(final_b)
    optimizer_keys = [key for key in a["optimizer"]["state"]]
    assert optimizer_keys and a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for key in optimizer_keys:
        for item, value in a["optimizer"]["state"][key].items():
            assert torch.equal(value, b["optimizer"]["state"][key][item]), (key, item)
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]  # the schedule's learning rate
    state_a, state_b = a["train_state"], b["train_state"]
    assert state_a["model"] == state_b["model"] == {} and state_a["optimizer"] == {}  # the shards hold them
    for part in ("scaler", "scheduler", "counters"):
        assert state_a[part] == state_b[part], part
    assert state_a["scaler"]["scale"] > 1024.0  # the scale grew: its state came back too
    assert resumed["reports"][0].tags.get("resumed_from_step") == "6"

    # The final model, read whole from the shards in this process (as the driver logs it): the trained weights.
    model = build_model(killed.model)
    assert load_trained_weights(LocalCheckpoint(final_b), model).sample_shape == [3, 32, 32]
    for name, value in model.state_dict().items():
        assert torch.equal(value, straight["weights"][name]), name


# -- one rank, in this process: rebuilds after a collapsed loss scale ---------------------------------------------

@contextmanager
def process_group(directory: Path):
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Recorder:
    """Test hook: the full weights and Adam's moments at chosen points."""

    def __init__(self):
        self.seen: dict = {}

    def record(self, loop, key) -> None:
        optimizer = loop.training.optimizer
        moments = [state["exp_avg"].to_local().clone() for state in optimizer.state.values()]
        self.seen[key] = (loop.training.full_state_dict(), moments, loop.training.precision.guard.loss_scale())

    def after_backward(self, loop, step):
        self.record(loop, ("before", step.number))

    def after_step(self, loop, step):
        self.record(loop, ("after", step.number))

    def on_checkpoint(self, loop, directory, name):
        self.record(loop, ("checkpoint", loop.global_step))


def run_in_process(cfg, directory: Path) -> tuple[list, Recorder, object]:
    from orchestrator.train.local import LocalSession
    from orchestrator.train.loop import TrainingLoop

    recorder = Recorder()
    with process_group(directory):
        session = LocalSession(0, 1, torch.device("cpu"), directory / "checkpoints")
        training = TrainingLoop(cfg, session, hooks=[recorder]).run()
    return session.reports, recorder, training


def assert_same(a, b):
    weights_a, moments_a, _ = a
    weights_b, moments_b, _ = b
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert len(moments_a) == len(moments_b) and all(torch.equal(x, y) for x, y in zip(moments_a, moments_b))


COLLAPSE = dict(scaling={"num_workers": 1, "strategy": "fsdp"}, optim={"name": "adam", "lr": 0.002},
                run={"max_steps_per_epoch": 5}, tracking={"log_every_n_steps": 1})


@pytest.mark.slow
def test_a_collapse_promotes_the_overflowing_layer_into_a_unit_of_its_own_keeping_the_shards(tmp_path):
    cfg = job_config(tmp_path, "promote", **COLLAPSE,
                     precision={"preset": "O2", "init_scale": 1024,
                                "scaler": {"max_consecutive_skips": 1, "on_collapse": "promote"}},
                     callbacks=[drill("Overflow", at_steps=[2, 3], layer="classifier.3")])
    reports, recorder, training = run_in_process(cfg, tmp_path)
    assert training.promoted == ["classifier.3"]
    assert [r.tags.get("precision.promoted") for r in reports if r.tags.get("precision.promoted")] == ["classifier.3"]
    # Rebuilt at step 3 from this rank's shards: the same weights and moments, in new units.
    assert_same(recorder.seen[("before", 3)], recorder.seen[("after", 3)])
    audits = [r.tables["precision/audit"] for r in reports if "precision/audit" in r.tables]
    head = {entry["name"]: entry for entry in audits[-1]}["classifier.3"]
    assert len(audits) == 2 and head["unit"] == "classifier.3" and head["param_dtype"] == "float32"
    assert head["rule"] == "promoted"
    trained_on = [r for r in reports if "train/loss" in r.metrics][-1]  # training went on after the rebuild
    assert trained_on.step == 5 and torch.isfinite(torch.tensor(trained_on.metrics["train/loss"]))


@pytest.mark.slow
def test_a_collapse_rolls_back_to_the_last_checkpoints_shards(tmp_path):
    cfg = job_config(tmp_path, "rollback", **COLLAPSE, checkpoint={"every_n_steps": 2},
                     precision={"preset": "O2", "init_scale": 1024,
                                "scaler": {"max_consecutive_skips": 1, "on_collapse": "rollback"}},
                     callbacks=[drill("Overflow", at_steps=[3, 4])])
    reports, recorder, _ = run_in_process(cfg, tmp_path)
    at_checkpoint, rolled_back = recorder.seen[("checkpoint", 2)], recorder.seen[("after", 4)]
    assert_same(at_checkpoint, rolled_back)
    assert rolled_back[2] == at_checkpoint[2] == 1024.0  # the checkpoint's scale, not the backed-off one
    assert any(record.get("action") == "rollback" for r in reports for record in r.overflow_records)
