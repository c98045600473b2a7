"""Transformers as they come, under per-layer precision: a rule that would lower part of an attention block (the
query projection alone) is refused before Ray starts, naming the rule; the tuner lowers an attention block's
projections together, skips a candidate the model cannot run with and says why, and keeps the job's own preset and
rules; per-token outputs log a sequence dim of -1 and are scored by `token_accuracy`, `-100` ignored."""

import json
import shutil
import sys

import pytest
import torch
import yaml

from conftest import REPO, run_mains, small_job
from orchestrator.config import load_job
from orchestrator.errors import BadInput

BERT_KWARGS = {"vocab_size": 128, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
               "intermediate_size": 32, "max_position_embeddings": 64}
QUERY = "bert.encoder.layer.0.attention.self.query"
BLOCK = "bert.encoder.layer.0.attention.self"
VIT = {"name": "timm:create_model", "kwargs": {"model_name": "vit_tiny_patch16_224", "img_size": 32, "depth": 1,
                                               "embed_dim": 32, "num_heads": 2}}

TAGGING = '''
import torch

PAD = 0


class Tagged(torch.utils.data.Dataset):
    """Sentences of token ids 1..127 of many lengths, each token tagged with its id modulo 4."""

    def __init__(self, samples, seed):
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(3, 12, (samples,), generator=generator)
        self.ids = [torch.randint(1, 128, (int(n),), generator=generator) for n in lengths]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index] % 4}


def make_datasets(train_samples=32, eval_samples=16):
    return Tagged(train_samples, 0), Tagged(eval_samples, 1)


def pad_collate(samples):
    """ids padded with 0, tags with -100 (no loss or metric counts them), the attention mask."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), longest), PAD)
    labels = torch.full((len(samples), longest), -100)
    for row, sample in enumerate(samples):
        ids[row, :len(sample["input_ids"])] = sample["input_ids"]
        labels[row, :len(sample["labels"])] = sample["labels"]
    return {"input_ids": ids, "attention_mask": ids != PAD, "labels": labels}
'''

FUSSY = '''
import torch
from torch import nn


class Fussy(nn.Module):
    """A net whose `gate` must compute in fp32: the forward refuses anything else (as some kernels do)."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Linear(3 * 32 * 32, 32)
        self.gate = nn.Linear(32, 32)
        self.head = nn.Linear(32, num_classes)

    def forward(self, x):
        x = torch.relu(self.stem(x.flatten(1)))
        gate = self.gate(x)
        if gate.dtype != torch.float32:
            raise RuntimeError(f"gate computed in {gate.dtype}; this kernel takes float32 only")
        return self.head(x * torch.sigmoid(gate).to(x.dtype))
'''


def bert_job(uri=None, **precision):
    return {"model": {"name": "transformers:BertForSequenceClassification", "num_classes": 4, "kwargs": BERT_KWARGS},
            "data": {"name": "textcls:make_datasets", "kwargs": {"train_samples": 64, "eval_samples": 32},
                     "collate": "textcls:pad_collate"},
            "task": {"inputs": ["input_ids", "attention_mask"], "target": "labels"},
            "optim": {"name": "adamw", "lr": 0.003}, "precision": {"preset": "O0", **precision},
            "scaling": {"num_workers": 1}, "run": {"epochs": 1, "batch_size": 16},
            "tracking": {"experiment": "bert", "uri": uri or "sqlite:///mlflow.db", "system_metrics_interval_s": 0,
                         "log_model": False},
            "tune": {"batches": 1, "validate_steps": 2}}


QUERY_RULE = {"master_weights": True, "loss_scale": "dynamic", "rules": [{"match": QUERY, "dtype": "float16"}]}


@pytest.fixture
def text_dir(tmp_path, monkeypatch):
    """A working directory holding the text-classification example's data module and the tagging one."""
    shutil.copy(REPO / "examples" / "text-classification" / "textcls.py", tmp_path)
    (tmp_path / "tagging.py").write_text(TAGGING)
    (tmp_path / "fussy.py").write_text(FUSSY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("textcls", "tagging", "fussy"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path


def preflight_policy(cfg):
    """Pre-flight's data and policy checks, as submit runs them before Ray starts; the first training batch."""
    from orchestrator.runner.preflight import check_data_fits_model
    from orchestrator.precision.kept import check_policy_kept
    from orchestrator.train.models import build_model

    model, first = build_model(cfg.model), []
    check_data_fits_model(cfg, model, first)
    check_policy_kept(cfg, model, first[0])
    return first[0]


def test_the_query_projection_lowered_alone_is_refused_naming_the_rule_and_the_whole_block_runs(text_dir, write_job):
    with pytest.raises(BadInput) as refused:
        preflight_policy(load_job(write_job(bert_job(**QUERY_RULE))))
    message = str(refused.value)
    assert message.startswith(f"precision.rules[0] {{match: '{QUERY}', dtype: float16}} splits an attention block: "
                              f"in {BLOCK} the attention takes query in float16 and key, value in float32")
    assert f"{{match: '{BLOCK}', dtype: float16}}" in message  # the fix it gives ...
    block = {**QUERY_RULE, "rules": [{"match": BLOCK, "dtype": "float16"}]}
    cfg = load_job(write_job(bert_job(**block)))
    first = preflight_policy(cfg)  # ... passes, and one step of training keeps every promise
    from orchestrator.precision import broken_promises
    from orchestrator.train.step import Step, accumulated_step
    from orchestrator.train.training import build_training

    training = build_training(cfg, torch.device("cpu"), total_steps=2)
    step = Step(number=1, epoch=0, index=0, batches=[first])
    accumulated_step(training, step, torch.device("cpu"))
    entries = {e["name"]: e for e in training.precision.audit.close()}
    assert broken_promises(list(entries.values())) == [] and torch.isfinite(step.loss)
    assert {entries[f"{BLOCK}.{p}"]["output_dtype"] for p in ("query", "key", "value")} == {"float16"}


def test_under_fsdp_the_lowered_query_is_refused_as_under_ddp(text_dir, write_job):
    """FSDP2 casts each unit's inputs to its own dtype: a query projection lowered alone splits the block there too,
    and its pre-flight (`FsdpStrategy.check_plan`) refuses it naming the rule."""
    from orchestrator.runner.preflight import check_data_fits_model
    from orchestrator.train.fsdp_strategy import FsdpStrategy
    from orchestrator.train.models import build_model

    cfg = load_job(write_job({**bert_job(**QUERY_RULE), "scaling": {"num_workers": 2, "strategy": "fsdp"}}))
    model, first = build_model(cfg.model), []
    check_data_fits_model(cfg, model, first)
    with pytest.raises(BadInput, match=rf"precision.rules\[0\] {{match: '{QUERY}', dtype: float16}} splits an "
                                       "attention block"):
        FsdpStrategy.check_plan(cfg, model, first[0])


@pytest.mark.slow  # a fresh interpreter runs submit
def test_submit_refuses_the_lowered_query_before_ray_starts(text_dir, write_job):
    job = write_job(bert_job(**QUERY_RULE))
    (result,) = run_mains("orchestrator.cli.submit", {"query": [str(job)]}, text_dir).values()
    assert result["rc"] == 2 and not result["ray"], result["stderr"][-2000:]
    assert f"precision.rules[0] {{match: '{QUERY}', dtype: float16}} splits an attention block" in result["stderr"]
    assert "Traceback" not in result["stderr"]


def test_the_tuner_lowers_the_attention_projections_together(text_dir, write_job):
    from orchestrator.train import task
    from orchestrator.train.models import build_model
    from orchestrator.autotune import run as tune_run
    from orchestrator.autotune.plan import options
    from orchestrator.autotune.probe import Probe

    cfg = load_job(write_job(bert_job()))
    torch.manual_seed(0)
    probe = Probe(build_model(cfg.model), tune_run.job_batches(cfg, torch.device("cpu"), 1),
                  task.build_loss(cfg.task), torch.device("cpu"))
    unit = f"{BLOCK}.{{query,key,value}}"
    assert unit in probe.layers and QUERY not in probe.layers
    assert probe.layers[unit].layers == tuple(f"{BLOCK}.{p}" for p in ("query", "key", "value"))
    rows = {(row.layer, row.dtype): row for row in options(probe, ["float16", "bfloat16"], "h100")}
    # errors of the dtype alone: dropout drops the same units in every pass of the probe
    assert all(row.allowed and row.output_error < 0.01 for row in rows.values()), \
        {k: (r.output_error, r.refused) for k, r in rows.items()}


def test_a_candidate_the_model_cannot_run_lowered_is_skipped_and_the_tune_says_why(text_dir, write_job, capsys):
    from orchestrator.cli.tune import main

    job = write_job(small_job(model={"name": "fussy:Fussy"}, scaling={"num_workers": 1}, run={"batch_size": 16},
                              tracking={"uri": "sqlite:///mlflow.db", "experiment": "fussy"},
                              tune={"batches": 1, "validate_steps": 2}))
    assert main([str(job), "tune.target=h100", "--output", "tuned.yaml", "-q"]) == 0
    err = capsys.readouterr().err
    assert "skipped, the model does not run with them lowered:" in err
    assert "gate: fails in float16: RuntimeError: gate computed in torch.float16; this kernel takes float32 only" in err
    rules = {rule["match"]: rule["dtype"] for rule in yaml.safe_load(open("tuned.yaml"))["precision"]["rules"]}
    assert "gate" not in rules and {"stem", "head"} <= set(rules)


def test_a_tuned_vit_keeps_the_preset_and_the_users_head_rule(text_dir, write_job):
    """O2 and `head*: float32` are the job's: the written policy keeps both, the tune never moves `head`, and the
    tuned job's first step computes the head in fp32 with every promise kept."""
    from orchestrator.cli.tune import main
    from orchestrator.precision import broken_promises
    from orchestrator.train.step import train_step
    from orchestrator.train.training import build_training

    job = write_job(small_job(model=VIT, precision={"preset": "O2", "rules": [{"match": "head*", "dtype": "float32"}]},
                              scaling={"num_workers": 1}, run={"batch_size": 16},
                              tracking={"uri": "sqlite:///mlflow.db", "experiment": "vit"},
                              tune={"batches": 1, "validate_steps": 2}))
    assert main([str(job), "tune.target=h100", "--output", "tuned.yaml", "-q"]) == 0
    precision = yaml.safe_load(open("tuned.yaml"))["precision"]
    assert precision["preset"] == "O2"
    assert precision["rules"][0] == {"match": "head*", "dtype": "float32"}  # as the job wrote it, first
    assert not any(rule["match"].startswith("head") for rule in precision["rules"][1:])

    training = build_training(load_job("tuned.yaml"), torch.device("cpu"), total_steps=2)
    loss, _ = train_step(training, torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,)), torch.device("cpu"), 1)
    entries = {e["name"]: e for e in training.precision.audit.close()}
    assert broken_promises(list(entries.values())) == []
    assert (entries["head"]["param_dtype"], entries["head"]["output_dtype"]) == ("float32", "float32")
    assert entries["(model)"]["param_dtype"] == "float16"  # O2's: the class token and position embeddings
    assert torch.isfinite(loss)


def test_per_token_outputs_have_a_variable_sequence_dim_in_the_schema():
    import transformers

    from orchestrator.tracking.logged_model import ModelInputs

    config = transformers.BertConfig(**BERT_KWARGS, num_labels=4)
    ids = torch.randint(1, 100, (2, 9))
    example = {"named": {"input_ids": ids, "attention_mask": torch.ones(2, 9, dtype=torch.bool)},
               "variable": {"input_ids": [1], "attention_mask": [1]}}
    tagger = transformers.BertForTokenClassification(config)
    inputs = ModelInputs.from_example(tagger, example)
    schema = inputs.signature(tagger)
    assert [spec.shape for spec in schema.inputs.inputs] == [(-1, -1), (-1, -1)]
    assert schema.outputs.inputs[0].shape == (-1, -1, 4)
    classifier = transformers.BertForSequenceClassification(config)  # one prediction per sentence: 4 classes fixed
    assert ModelInputs.from_example(classifier, example).signature(classifier).outputs.inputs[0].shape == (-1, 4)


def test_token_accuracy_ignores_padding_and_accuracy_points_to_it(text_dir, write_job):
    from orchestrator.runner.preflight import check_data_fits_model
    from orchestrator.train.models import build_model
    from orchestrator.train.task import token_accuracy

    scores = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]], [[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]]])
    targets = torch.tensor([[0, 0, -100], [1, -100, -100]])  # 2 of the 3 counted tokens right; padding ignored
    correct, counted = token_accuracy(scores, targets)["token_accuracy"]
    assert (int(correct), int(counted)) == (2, 3)

    def job(**task):
        return {"model": {"name": "transformers:BertForTokenClassification", "num_classes": 4,
                          "kwargs": BERT_KWARGS},
                "data": {"name": "tagging:make_datasets", "collate": "tagging:pad_collate"},
                "task": {"inputs": ["input_ids", "attention_mask"], "target": "labels", "loss": "model", **task},
                "scaling": {"num_workers": 1}, "run": {"batch_size": 4}}

    cfg = load_job(write_job(job()))
    with pytest.raises(BadInput, match=r"task.metrics\[0\]: 'accuracy' fails .*per-token outputs .*Name the metric "
                                       r"for tokens, task.metrics: \[token_accuracy\]"):
        check_data_fits_model(cfg, build_model(cfg.model))
    cfg = load_job(write_job(job(metrics=["token_accuracy"])))
    _, evaluated = check_data_fits_model(cfg, build_model(cfg.model))
    assert "eval/token_accuracy" in evaluated


@pytest.mark.slow  # tunes, then trains through submit on the session's Ray
def test_the_bare_bert_classifier_tunes_and_its_tuned_job_trains(text_dir, write_job, ray_session, new_store, capsys):
    """The issue's command, `ampflow tune` of a bare Hugging Face BERT for an h100, no longer fails in its
    attention: the written job lowers the attention's projections together, and it trains through submit with every
    layer stored and computed as the tune chose.

    Long: a tune (probe and validation) and one BERT training run through submit."""
    from mlflow import MlflowClient

    from orchestrator.cli.submit import main as submit
    from orchestrator.cli.tune import main

    uri = new_store(text_dir)
    job = write_job(bert_job(uri))
    assert main([str(job), "tune.target=h100", "--output", "tuned.yaml", "-q"]) == 0, capsys.readouterr().err
    tuned = yaml.safe_load(open("tuned.yaml"))["precision"]
    rules = {rule["match"]: rule["dtype"] for rule in tuned["rules"]}
    projections = [f"{BLOCK}.{p}" for p in ("query", "key", "value")]
    assert len({rules.get(p, "float32") for p in projections}) == 1  # lowered together, or not at all
    assert rules and tuned["preset"] == "O0"
    assert submit(["tuned.yaml", "-q", f"checkpoint.storage_path={text_dir / 'ray_results'}"]) == 0, \
        capsys.readouterr().err
    client = MlflowClient(uri)
    (trained,) = [r for r in client.search_runs([client.get_experiment_by_name("bert").experiment_id])
                  if r.data.tags.get("ampflow.kind") != "tune"]
    assert trained.info.status == "FINISHED"
    audit = {e["name"]: e for e in json.loads(open(client.download_artifacts(
        trained.info.run_id, "precision/audit.json")).read())}
    for layer, dtype in rules.items():  # each layer stored and computed in what the tune chose
        assert (audit[layer]["param_dtype"], audit[layer]["output_dtype"]) == (dtype, dtype), audit[layer]


@pytest.mark.slow  # tunes, then trains through submit on the session's Ray
def test_the_tuned_vit_trains_through_submit_with_its_head_and_preset_kept(text_dir, write_job, ray_session, new_store,
                                                                           capsys):
    """The issue's ViT: tuned for an h100 under O2 with `head*: float32`, then submitted; the run's audit has the head
    stored and computed in fp32 and the root's own parameters in O2's float16.

    Long: a tune and one ViT training run through submit."""
    from mlflow import MlflowClient

    from orchestrator.cli.submit import main as submit
    from orchestrator.cli.tune import main
    from orchestrator.tracking.tracker import RunTracker

    uri = new_store(text_dir)
    job = write_job(small_job(model=VIT, precision={"preset": "O2", "rules": [{"match": "head*", "dtype": "float32"}]},
                              scaling={"num_workers": 1}, run={"epochs": 1, "batch_size": 16, "max_steps_per_epoch": 2},
                              tracking={"uri": uri, "experiment": "vit", "system_metrics_interval_s": 0},
                              tune={"batches": 1, "validate_steps": 0}))
    assert main([str(job), "tune.target=h100", "--output", "tuned.yaml", "-q"]) == 0, capsys.readouterr().err
    assert submit(["tuned.yaml", "-q", f"checkpoint.storage_path={text_dir / 'ray_results'}"]) == 0, \
        capsys.readouterr().err
    client = MlflowClient(uri)
    (trained,) = [r for r in client.search_runs([client.get_experiment_by_name("vit").experiment_id])
                  if r.data.tags.get("ampflow.kind") != "tune"]
    assert trained.info.status == "FINISHED"
    entries = {e["name"]: e for e in RunTracker.open(uri, trained.info.run_id).load_json("precision/audit.json")}
    assert (entries["head"]["param_dtype"], entries["head"]["output_dtype"]) == ("float32", "float32")
    assert entries["head"]["rule"] == "head*" and entries["(model)"]["param_dtype"] == "float16"
