"""The causal language-model job (`jobs/lm.yaml`): the built-in `transformer_lm`, English text tokenized offline
(`lm_text`), the next-token loss and `eval/perplexity`; then the job trained through submit on 2 CPU ranks, with
the built-in model and with Hugging Face's GPT-2 built from a config, logged, and predicted with `ampflow
predict`, which gives the logits [N, T, vocab]."""

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import yaml

from conftest import REPO

TINY = {"n_layer": 1, "n_head": 2, "d_model": 32}


def text_data(tmp_path: Path, **kwargs) -> SimpleNamespace:
    return SimpleNamespace(kwargs={"block_size": 32, **kwargs}, root=str(tmp_path / "data"))


# -- the model ---------------------------------------------------------------------------------------------------


def test_transformer_lm_gives_per_token_logits_that_see_only_the_past():
    """Logits [N, T, vocab]; changing a token changes no logit before it (the attention is causal), and changes
    its own position's and later ones'."""
    from orchestrator.train.transformer_lm import TransformerLM

    torch.manual_seed(0)
    model = TransformerLM(vocab_size=50, block_size=16, **TINY).eval()
    ids = torch.randint(0, 50, (3, 16))
    changed = ids.clone()
    changed[:, 9] = (ids[:, 9] + 1) % 50
    with torch.no_grad():
        before, after = model(ids), model(changed)
    assert before.shape == (3, 16, 50)
    assert torch.equal(before[:, :9], after[:, :9])
    assert not torch.allclose(before[:, 9:], after[:, 9:])
    with pytest.raises(ValueError, match="more than block_size 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_the_head_is_tied_to_the_embedding_unless_asked_otherwise_and_the_docs_size_is_gpt2_small():
    from orchestrator.train.transformer_lm import TransformerLM

    tied, untied = TransformerLM(vocab_size=50, **TINY), TransformerLM(vocab_size=50, tie_weights=False, **TINY)
    assert tied.head.weight is tied.token_embedding.weight
    assert untied.head.weight is not untied.token_embedding.weight
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters()) == 50 * 32
    with torch.device("meta"):  # GPT-2 small as docs/lm.md gives it: about 124M parameters, no memory taken
        gpt2_small = TransformerLM(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, d_model=768)
    assert 123e6 < sum(p.numel() for p in gpt2_small.parameters()) < 126e6


# -- the loss and the metric ----------------------------------------------------------------------------------------


def test_next_token_loss_scores_each_position_against_the_next_label_and_skips_minus_100():
    from orchestrator.train.task import build_loss

    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    loss = build_loss(SimpleNamespace(loss="next_token", output=None))
    expected = F.cross_entropy(logits[:, :4].reshape(-1, 7), labels[:, 1:].reshape(-1))
    assert float(loss(logits, labels)) == pytest.approx(float(expected))
    ignored = labels.clone()
    ignored[0, 3] = -100  # the label of position 2's prediction
    keep = torch.ones(2, 4, dtype=torch.bool)
    keep[0, 2] = False
    expected = F.cross_entropy(logits[:, :4][keep], labels[:, 1:][keep])
    assert float(loss(logits, ignored)) == pytest.approx(float(expected))
    perfect = F.one_hot(torch.roll(labels, -1, dims=1), 7).float() * 100  # position t puts all on label t+1
    assert float(loss(perfect, labels)) == pytest.approx(0.0, abs=1e-6)
    # A Hugging Face output: the logits are read from it
    assert float(loss({"logits": logits}, labels)) == pytest.approx(float(loss(logits, labels)))


def test_perplexity_is_exp_of_the_eval_loss_and_a_name_the_job_can_use(tmp_path):
    from orchestrator.config.loader import load_job
    from orchestrator.errors import BadInput
    from orchestrator.train.task import build_metrics

    job = tmp_path / "lm.yaml"
    job.write_text((REPO / "jobs" / "lm.yaml").read_text())
    cfg = load_job(job, [])
    (metric,) = build_metrics(cfg.task)
    assert metric.of_loss(math.log(7.0)) == {"perplexity": pytest.approx(7.0)}
    assert metric.of_loss(1e6) == {"perplexity": math.inf}
    for metric in ("accuracy", "token_accuracy"):
        with pytest.raises(BadInput, match=rf"task.metrics\[0\]: '{metric}' scores each sample or token against its "
                                           r"own target, but task.loss 'next_token' predicts .* Use task.metrics: "
                                           r"\[perplexity\]"):
            load_job(job, [f"task.metrics=[{metric}]"])


def test_evaluation_logs_perplexity_from_the_loss_over_every_batch():
    from orchestrator.train.batch import Batch
    from orchestrator.train.evaluate import evaluate
    from orchestrator.train.task import build_loss, build_metrics
    from orchestrator.train.transformer_lm import TransformerLM

    class Prepared:
        model = TransformerLM(vocab_size=40, block_size=8, **TINY)

        @staticmethod
        def place(batch, device):
            return batch

    class Precision:
        @staticmethod
        def forward():
            import contextlib

            return contextlib.nullcontext()

    task = SimpleNamespace(loss="next_token", output=None, metrics=[SimpleNamespace(name="perplexity")])
    training = SimpleNamespace(prepared=Prepared, precision=Precision, loss=build_loss(task),
                               metrics=build_metrics(task))
    ids = torch.randint(0, 40, (6, 8))
    batches = [Batch(kwargs={"input_ids": ids[:4]}, targets=ids[:4], size=4),
               Batch(kwargs={"input_ids": ids[4:]}, targets=ids[4:], size=2)]
    metrics = evaluate(training, batches, torch.device("cpu"))
    with torch.no_grad():
        losses = [float(training.loss(Prepared.model(ids[:4]), ids[:4])),
                  float(training.loss(Prepared.model(ids[4:]), ids[4:]))]
    assert metrics["eval/loss"] == pytest.approx((4 * losses[0] + 2 * losses[1]) / 6, rel=1e-5)
    assert metrics["eval/perplexity"] == pytest.approx(math.exp(metrics["eval/loss"]), rel=1e-9)


# -- the text and the tokenizer ---------------------------------------------------------------------------------------


def test_lm_text_is_english_in_blocks_of_token_ids_split_by_text_and_the_bpe_decodes_back(tmp_path):
    """Blocks of int64 ids with labels equal to them; the eval blocks are the end of the corpus, tokenized with the
    tokenizer trained on the rest; the byte-level BPE gives the text back exactly."""
    from orchestrator.train.text import corpus_text, lm_text, tokenizer_for, TextSettings

    text = corpus_text()
    assert len(text) > 300_000 and "The \"if\" statement" in text  # the Python documentation's English prose
    train, evaluation = lm_text(text_data(tmp_path, vocab_size=300))
    sample = train[0]
    assert set(sample) == {"input_ids", "labels"} and sample["input_ids"].dtype == torch.int64
    assert sample["input_ids"].shape == (32,) and torch.equal(sample["input_ids"], sample["labels"])
    assert int(train.ids.max()) < 300 and train.vocab_size == 300
    cut = int(len(text) * 0.9)
    tokenizer = tokenizer_for(text[:cut], TextSettings(vocab_size=300), tmp_path / "data" / "lm_text")
    assert tokenizer.decode(train.ids.flatten().tolist()) == text[:cut][:len(tokenizer.decode(
        train.ids.flatten().tolist()))]
    assert tokenizer.decode(evaluation.ids[0].tolist()) in text[cut:]
    assert len(train) > 8 * len(evaluation) > 0


def test_the_bpe_is_trained_once_and_read_back_from_data_root(tmp_path):
    from orchestrator.train.text import lm_text

    first = lm_text(text_data(tmp_path, vocab_size=300))[0]
    (kept,) = (tmp_path / "data" / "lm_text").glob("bpe-300-*.json")
    tokenizer = json.loads(kept.read_text())
    tokenizer["model"]["merges"] = tokenizer["model"]["merges"][:10]  # the file read back is the one used
    kept.write_text(json.dumps(tokenizer))
    again = lm_text(text_data(tmp_path, vocab_size=300))[0]
    assert not torch.equal(first.ids, again.ids)
    kept.unlink()
    assert torch.equal(lm_text(text_data(tmp_path, vocab_size=300))[0].ids, first.ids)  # trained the same again


def test_bytes_need_no_tokenizer_package_and_bpe_says_what_to_install(tmp_path, monkeypatch):
    from orchestrator.errors import DataUnavailable
    from orchestrator.train.text import lm_text

    train, _ = lm_text(text_data(tmp_path, tokenizer="bytes"))
    assert train.vocab_size == 256 and bytes(train.ids[0].tolist()).decode("utf-8", "replace").strip()
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as where it is not installed: `import` fails
    with pytest.raises(DataUnavailable, match=r"tokenizers package, which is not installed. Install it \(pip "
                                              r"install tokenizers"):
        lm_text(text_data(tmp_path / "other"))


def test_a_text_file_of_the_users_is_a_corpus_and_bad_settings_are_refused(tmp_path):
    from orchestrator.errors import BadInput, DataUnavailable
    from orchestrator.train.text import lm_text

    story = tmp_path / "story.txt"
    story.write_text("It was a bright cold day in April, and the clocks were striking thirteen. " * 40)
    train, evaluation = lm_text(text_data(tmp_path, path=str(story), tokenizer="bytes"))
    assert bytes(train.ids[0].tolist()).decode() == story.read_text()[:32]
    with pytest.raises(DataUnavailable, match="data.kwargs.path: .*nowhere.txt is not a file"):
        lm_text(text_data(tmp_path, path=str(tmp_path / "nowhere.txt")))
    with pytest.raises(BadInput, match="data.kwargs: lm_text takes .*; not blocksize"):
        lm_text(SimpleNamespace(kwargs={"blocksize": 4}, root=str(tmp_path)))
    with pytest.raises(BadInput, match="data.kwargs.tokenizer: 'words' is not one of bpe, bytes"):
        lm_text(text_data(tmp_path, tokenizer="words"))


def test_a_missing_corpus_is_exit_2_naming_the_file_before_ray_starts(tmp_path, write_job, capsys):
    from orchestrator.cli.submit import main

    job = yaml.safe_load((REPO / "jobs" / "lm.yaml").read_text())
    job["data"]["kwargs"]["path"] = str(tmp_path / "missing.txt")
    assert main([str(write_job(job))]) == 2
    err = capsys.readouterr().err
    assert "data.kwargs.path:" in err and "missing.txt is not a file" in err and "Traceback" not in err


# -- named inputs in every loader -----------------------------------------------------------------------------------


def test_gpt2s_attention_mask_reaches_its_forward_by_name_in_every_loader_of_the_logged_model(mlflow_uri, tmp_path,
                                                                                            monkeypatch):
    """GPT-2's forward is (input_ids, cache, attention_mask, ...): the mask is bound by its name, never into `cache`
    by its place in task.inputs. The model exports to pt2 all the same; the program, the pyfunc and its raw model
    give the logits GPT-2 gives for the same padded batch, the mask heeded."""
    import mlflow
    from transformers import GPT2Config, GPT2LMHeadModel

    from orchestrator.config import load_job
    from orchestrator.tracking.logged_model import ModelInputs
    from orchestrator.tracking.tracker import RunTracker

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=60, n_positions=16, n_embd=32, n_layer=1, n_head=2)).eval()
    ids = torch.randint(0, 60, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0  # left padding: the mask changes row 1's logits
    inputs = ModelInputs.from_example(gpt2, {"named": {"input_ids": ids, "attention_mask": mask}})
    assert inputs.names == ["input_ids", "attention_mask"] and inputs.positional == 1

    monkeypatch.chdir(tmp_path)  # the store's artifacts (./mlruns) go there
    cfg = load_job(REPO / "jobs" / "quickstart.yaml", [f"tracking.uri={mlflow_uri}"])
    tracker = RunTracker.start(mlflow_uri, cfg, run_name="gpt2", tags={}, params={}, config_yaml="")
    assert tracker.log_model(gpt2, inputs) == "pt2"
    ids, mask = torch.randint(0, 60, (3, 16)), torch.ones(3, 16, dtype=torch.long)
    mask[0, :7] = 0
    with torch.no_grad():
        expected = gpt2(input_ids=ids, attention_mask=mask).logits
        unmasked = gpt2(input_ids=ids).logits
    assert not torch.allclose(expected[0], unmasked[0], atol=1e-4)

    uri = f"runs:/{tracker.run_id}/model"
    assert torch.allclose(mlflow.pytorch.load_model(uri)(ids, mask)["logits"], expected, atol=1e-5)
    pyfunc = mlflow.pyfunc.load_model(uri)
    predicted = pyfunc.predict({"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    assert predicted.shape == (3, 16, 60) and torch.allclose(torch.from_numpy(predicted), expected, atol=1e-5)
    for program in (pyfunc.get_raw_model(), tracker.load_model()):
        for outputs in (program(ids, mask), program(input_ids=ids, attention_mask=mask),
                        program(attention_mask=mask, input_ids=ids)):
            assert torch.allclose(outputs["logits"], expected, atol=1e-5)


# -- the job through submit: 2 CPU ranks, logged, predicted ----------------------------------------------------------

GPT2 = {"name": "transformers:GPT2LMHeadModel",
        "kwargs": {"vocab_size": 300, "n_positions": 32, "n_embd": 32, "n_layer": 1, "n_head": 2}}


def lm_job(uri: str, data_root: Path, model: dict, **task) -> dict:
    """jobs/lm.yaml at a test's size: 32-token blocks, a 300-token BPE, 4 steps of 8 blocks per rank."""
    job = yaml.safe_load((REPO / "jobs" / "lm.yaml").read_text())
    job["data"]["root"] = str(data_root)
    job["data"]["kwargs"].update(vocab_size=300, block_size=32, eval_fraction=0.02)
    job["model"] = model
    job["task"].update(task)
    job["run"].update(epochs=1, batch_size=8, max_steps_per_epoch=4)
    job["tracking"].update(uri=uri, log_every_n_steps=2, system_metrics_interval_s=0)
    return job


def train(tmp_path_factory, template: Path, name: str, model: dict, **task):
    """One submit of the LM job with `model`; (store URI, the finished run)."""
    import shutil

    from orchestrator.cli.submit import main
    from test_submit_e2e import only_run

    directory = tmp_path_factory.mktemp(name)
    shutil.copyfile(template, directory / "mlflow.db")
    uri = f"sqlite:///{directory / 'mlflow.db'}"
    job = lm_job(uri, directory / "data", model, **task)
    job["checkpoint"] = {"storage_path": str(directory / "checkpoints")}
    path = directory / "lm.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    assert main([str(path)]) == 0
    return uri, only_run(uri, "lm")[1], directory


@pytest.fixture(scope="module")
def built_in_run(ray_session, tmp_path_factory, _mlflow_template):
    return train(tmp_path_factory, _mlflow_template, "built-in",
                 {"name": "transformer_lm", "kwargs": {"vocab_size": 300, "block_size": 32, **TINY}})


@pytest.fixture(scope="module")
def gpt2_run(ray_session, tmp_path_factory, _mlflow_template):
    return train(tmp_path_factory, _mlflow_template, "gpt2", GPT2, loss="model")


def predict_eval(uri: str, run, directory: Path, capsys) -> torch.Tensor:
    from orchestrator.cli.predict import main

    output = directory / "logits.pt"
    assert main([run.info.run_id, "--tracking-uri", uri, "--output", str(output)]) == 0, capsys.readouterr().err
    return torch.load(output, weights_only=True)


@pytest.mark.slow
def test_the_built_in_lm_trains_on_two_ranks_with_perplexity_and_tokens_per_s(built_in_run):
    from mlflow import MlflowClient

    uri, run, _ = built_in_run
    metrics = run.data.metrics
    assert run.info.status == "FINISHED" and run.data.params["scaling.num_workers"] == "2"
    assert run.data.tags["model_format"] == "pt2"
    assert math.log(300) - 1.5 < metrics["eval/loss"] < math.log(300) + 0.5  # 8 steps from a uniform guess
    assert metrics["eval/perplexity"] == pytest.approx(math.exp(metrics["eval/loss"]), rel=1e-6)
    # every sample is 32 tokens: tokens/s is 32 x samples/s, at each report
    client = MlflowClient(tracking_uri=uri)
    tokens = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "perf/tokens_per_s")}
    samples = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "perf/samples_per_s")}
    assert tokens and all(tokens[step] == pytest.approx(32 * samples[step]) for step in tokens)


@pytest.mark.slow
def test_ampflow_predict_gives_the_built_in_lms_logits_by_run_and_through_its_pyfunc(built_in_run, capsys):
    import mlflow

    from orchestrator.cli.predict import main
    from orchestrator.train.text import lm_text

    uri, run, directory = built_in_run
    evaluation = lm_text(SimpleNamespace(kwargs={"vocab_size": 300, "block_size": 32, "eval_fraction": 0.02},
                                         root=str(directory / "data")))[1]
    logits = predict_eval(uri, run, directory, capsys)
    assert logits.shape == (len(evaluation), 32, 300) and logits.dtype == torch.float32
    # a file of token ids, by name, and the logged model's pyfunc, give the same logits
    ids = evaluation.ids[:3]
    torch.save({"input_ids": ids}, directory / "ids.pt")
    assert main([run.info.run_id, "--tracking-uri", uri, "--data", str(directory / "ids.pt"),
                 "--output", str(directory / "some.pt")]) == 0
    assert torch.allclose(torch.load(directory / "some.pt", weights_only=True), logits[:3], atol=1e-5)
    mlflow.set_tracking_uri(uri)
    pyfunc = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model")
    assert torch.allclose(torch.from_numpy(pyfunc.predict(ids.numpy())), logits[:3], atol=1e-5)


@pytest.mark.slow
def test_hugging_face_gpt2_trains_through_the_same_job_with_its_own_loss_and_predicts_its_logits(gpt2_run, capsys):
    uri, run, directory = gpt2_run
    metrics = run.data.metrics
    assert run.info.status == "FINISHED" and math.isfinite(metrics["eval/loss"])
    assert run.data.tags["model_format"] == "pt2" and run.data.params["scaling.num_workers"] == "2"
    assert metrics["eval/perplexity"] == pytest.approx(math.exp(metrics["eval/loss"]), rel=1e-6)
    assert metrics["perf/tokens_per_s"] > 0
    logits = predict_eval(uri, run, directory, capsys)
    assert logits.dim() == 3 and logits.shape[1:] == (32, 300) and torch.isfinite(logits).all()


def test_hugging_face_llama_built_from_a_config_takes_the_lm_blocks_with_either_loss(tmp_path):
    """`LlamaForCausalLM` through `model.name` and `model.kwargs` (its config's): the next-token loss on its logits
    is the loss it computes itself from `labels`."""
    from omegaconf import OmegaConf

    from orchestrator.train.batch import BatchLayout
    from orchestrator.train.models import build_model
    from orchestrator.train.task import build_loss
    from orchestrator.train.text import lm_text

    torch.manual_seed(0)
    llama = build_model(OmegaConf.create({"name": "transformers:LlamaForCausalLM", "num_classes": 10, "kwargs": {
        "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32}})).eval()
    train, _ = lm_text(text_data(tmp_path, vocab_size=300))
    raw = {key: torch.stack([train[i][key] for i in range(4)]) for key in ("input_ids", "labels")}
    task = SimpleNamespace(loss="model", target="labels", inputs=["input_ids"], output=None)
    with torch.no_grad():
        own = build_loss(task)(BatchLayout.from_task(task).batch(raw).forward(llama), raw["labels"])
        task.loss = "next_token"
        ours = build_loss(task)(BatchLayout.from_task(task).batch(raw).forward(llama), raw["labels"])
    assert float(ours) == pytest.approx(float(own), rel=1e-5) and math.log(300) - 1 < float(ours) < math.log(300) + 1


def test_a_model_with_fewer_token_rows_than_the_vocabulary_is_exit_2_naming_both(tmp_path, write_job, capsys):
    from orchestrator.cli.submit import main

    job = yaml.safe_load((REPO / "jobs" / "lm.yaml").read_text())
    job["data"]["root"] = str(tmp_path / "data")
    job["model"]["kwargs"]["vocab_size"] = 300
    assert main([str(write_job(job))]) == 2
    err = capsys.readouterr().err
    assert "token embedding has 300 rows, but data lm_text has a vocabulary of 512 tokens" in err, err
