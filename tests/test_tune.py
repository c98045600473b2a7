"""`ampflow tune`: the probe finds each layer's error and fp16 headroom on the job's own data, the choice for a
target device lowers what is safe and cheap there, a failed validation moves the riskiest layer up, and the job
file written submits and trains. One model here has a layer whose activations exceed fp16's range."""

import json

import pytest
import torch
import torch.nn.functional as F
import yaml
from mlflow import MlflowClient

from conftest import small_job
from orchestrator.cli.tune import main
from orchestrator.config.loader import load_job
from orchestrator.train.batch import Batch
from orchestrator.autotune import run as tune_run
from orchestrator.autotune.probe import Probe

HOT_NETS = '''
import torch
from torch import nn


class HotNet(nn.Module):
    """A small CNN whose `hot` layer's activations exceed fp16's range (65504), scaled back before the head."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, stride=2)
        self.hot = nn.Linear(16 * 16 * 16, 64)
        self.head = nn.Linear(64, num_classes)
        with torch.no_grad():
            self.hot.weight.mul_(1e7)

    def forward(self, x):
        x = torch.relu(self.conv2(torch.relu(self.conv1(x)))).flatten(1)
        return self.head(torch.relu(self.hot(x) * 1e-7))
'''


@pytest.fixture
def hot_job(tmp_path, monkeypatch, mlflow_uri):
    """A job training HotNet (a module beside it, by import path) on digits, and its store."""
    (tmp_path / "hot_nets.py").write_text(HOT_NETS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    job = tmp_path / "hot.yaml"
    job.write_text(yaml.safe_dump(small_job(
        model={"name": "hot_nets:HotNet"}, scaling={"num_workers": 1}, run={"batch_size": 16},
        tracking={"uri": mlflow_uri, "experiment": "tune"},
        tune={"batches": 1, "validate_steps": 4})))
    return job, mlflow_uri


def test_the_probe_finds_the_layer_without_fp16_headroom_and_each_layers_error(hot_job):
    cfg = load_job(hot_job[0])
    batches = tune_run.job_batches(cfg, torch.device("cpu"), 1)
    from orchestrator.train.models import build_model

    torch.manual_seed(0)
    probe = Probe(build_model(cfg.model), batches, lambda out, y: F.cross_entropy(out.float(), y), torch.device("cpu"))
    assert list(probe.layers) == ["conv1", "conv2", "hot", "head"]
    assert probe.layers["hot"].headroom.max_abs_activation > 65504
    assert probe.layers["hot"].headroom.refusal.startswith("no fp16 headroom: activations reach")
    for name in ("conv1", "conv2", "head"):
        assert probe.layers[name].headroom.refusal is None, name
    assert probe.layers["hot"].work.flops == 2 * 16 * 16 * 16 * 64 * 16  # in_features x outputs, per batch of 16
    output_error, grad_error = probe.sensitivity("head", "bfloat16")
    assert 0 < output_error < 0.05 and 0 < grad_error < 0.05
    assert probe.sensitivity("head", "float16")[0] < output_error  # fp16 keeps 3 more bits than bf16


def test_float8_is_probed_for_linear_layers_only_emulated_where_asked_and_never_for_a_target_without_it(hot_job):
    from orchestrator.train.models import build_model
    from orchestrator.autotune.plan import options

    cfg = load_job(hot_job[0])
    torch.manual_seed(0)
    probe = Probe(build_model(cfg.model), tune_run.job_batches(cfg, torch.device("cpu"), 1),
                  lambda out, y: F.cross_entropy(out.float(), y), torch.device("cpu"))
    rows = {row.layer: row for row in options(probe, ["float8"], "h100", emulate_float8=True) if row.dtype == "float8"}
    assert rows["conv1"].refused == rows["conv2"].refused == "float8 applies to Linear layers"
    assert rows["head"].allowed and 0 < rows["head"].output_error < 0.2 and rows["head"].cost < float("inf")
    plain = {row.layer: row.refused for row in options(probe, ["float8"], "h100") if row.dtype == "float8"}
    assert plain["head"].startswith("this cpu has no float8 matmuls; tune.emulate_float8=true")
    a100 = {row.layer: row.refused for row in options(probe, ["float8"], "a100", True) if row.dtype == "float8"}
    assert a100["head"] == "float8 is not native on a100"


def test_for_an_h100_the_hot_layer_stays_out_of_fp16_the_others_are_lowered_and_the_tune_is_one_run(hot_job, capsys):
    job, uri = hot_job
    assert main([str(job), "tune.target=h100", "--output", "tuned.yaml"]) == 0
    out = capsys.readouterr()
    tuned = yaml.safe_load(open("tuned.yaml"))
    rules = {rule["match"]: rule["dtype"] for rule in tuned["precision"]["rules"]}
    assert rules.get("hot", "float32") in ("bfloat16", "float32")
    assert {"conv1", "conv2", "head"} <= set(rules) and all(rules[n] in ("float16", "bfloat16")
                                                            for n in ("conv1", "conv2", "head"))
    assert tuned["precision"]["master_weights"] is True and "tune" not in tuned
    assert tuned["model"] == {"name": "hot_nets:HotNet"}  # the rest of the job as written
    assert "never fp16 (no headroom): hot" in out.err and "predicted: " in out.err and "validation: " in out.err
    assert "wrote tuned.yaml" in out.out
    load_job("tuned.yaml")  # a valid job

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tune").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["ampflow.kind"] == "tune"
    assert run.data.params["tune.target"] == "h100" and run.data.metrics["tune/predicted_speedup"] > 1
    assert len(client.get_metric_history(run.info.run_id, "tune/loss_policy")) == 4
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "tune")}
    assert artifacts == {"tune/sensitivity.json", "tune/sensitivity.png", "tune/policy.yaml"}
    table = json.loads(open(client.download_artifacts(run.info.run_id, "tune/sensitivity.json")).read())
    hot_fp16 = next(r for r in table["rows"] if r["layer"] == "hot" and r["dtype"] == "float16")
    assert not hot_fp16["allowed"] and not hot_fp16["chosen"] and hot_fp16["refused"].startswith("no fp16 headroom")


def test_on_a_cpu_target_every_layer_stays_fp32_and_the_tuner_says_so(hot_job, capsys):
    assert main([str(hot_job[0]), "tune.target=cpu", "--output", "cpu.yaml", "-q"]) == 0
    assert yaml.safe_load(open("cpu.yaml"))["precision"]["rules"] == []
    assert "every layer stays float32: on cpu" in capsys.readouterr().err


def test_a_failed_validation_moves_the_riskiest_layer_up_and_checks_again(hot_job, monkeypatch):
    """The validation is faked to fail while `head` is lowered (the riskiest, as its error is made the largest):
    it goes up a dtype at a time and the tune ends with it in fp32, the others still lowered."""
    real_options = tune_run.options

    def options(*args):  # `head` made the riskiest layer
        return [row if row.layer != "head" or row.dtype == "float32" else
                type(row)(row.layer, row.dtype, 0.3, 0.3, row.cost, row.refused)
                for row in real_options(*args)]

    def losses(cfg, precision, batches, device):
        lowered = {rule["match"] for rule in precision.get("rules", [])}
        return [2.0 if "head" in lowered else 1.0] * len(batches), 0

    monkeypatch.setattr(tune_run, "options", options)
    monkeypatch.setattr(tune_run, "losses", losses)
    result = tune_run.tune(load_job(hot_job[0], ["tune.target=h100", "tune.tolerance=0.5"]), say=lambda line: None)
    assert [(layer, to) for layer, _, to in result.moved_up] == [("head", "float32")]
    assert result.assignment["head"] == "float32" and result.lowered  # the others still lowered
    assert [v.passed(0.5) for v in result.validations] == [False, True]


def test_without_a_passing_policy_within_max_rounds_nothing_is_written_and_it_exits_1(hot_job, monkeypatch, capsys):
    monkeypatch.setattr(tune_run, "losses", lambda cfg, precision, batches, device: (
        [2.0 if precision.get("rules") else 1.0] * len(batches), 0))
    assert main([str(hot_job[0]), "tune.target=h100", "tune.max_rounds=0", "--output", "never.yaml"]) == 1
    assert "above tune.tolerance=0.05" in capsys.readouterr().err
    assert not (hot_job[0].parent / "never.yaml").exists()


@pytest.mark.slow  # trains through submit on the session's Ray
def test_the_tuned_job_submits_and_trains_with_its_rules_honoured(hot_job, ray_session, capsys):
    from orchestrator.cli.submit import main as submit

    job, uri = hot_job
    assert main([str(job), "tune.target=h100", "tune.validate_steps=0", "--output", "tuned.yaml", "-q"]) == 0
    assert submit(["tuned.yaml", "-q", f"checkpoint.storage_path={job.parent / 'ray_results'}"]) == 0, \
        capsys.readouterr().err
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("tune").experiment_id])
    (trained,) = [r for r in runs if r.data.tags.get("ampflow.kind") != "tune"]
    assert trained.info.status == "FINISHED"
    audit = json.loads(open(client.download_artifacts(trained.info.run_id, "precision/audit.json")).read())
    rules = {r["match"]: r["dtype"] for r in yaml.safe_load(open("tuned.yaml"))["precision"]["rules"]}
    entries = {entry["name"]: entry for entry in audit}
    for layer in ("conv1", "conv2", "hot", "head"):  # each layer stored and computed in what the tune chose
        dtype = rules.get(layer, "float32")
        assert (entries[layer]["param_dtype"], entries[layer]["output_dtype"]) == (dtype, dtype), entries[layer]
