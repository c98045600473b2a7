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
    with pytest.raises(BadInput, match=r"task.metrics\[0\]: 'accuracy' needs one class score per sample.*"
                                       r"perplexity"):
        load_job(job, ["task.metrics=[accuracy]"])


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
