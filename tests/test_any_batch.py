"""Any batch a DataLoader yields and any model, without Ray: batches read as `task.inputs`/`task.target` say with
their dtypes kept, pre-flight on token ids, the logged model's inputs from a real batch, a torchmetrics metric
computed over two ranks equal to the same metric over the whole eval set in one process, and a model's own
`train()` honoured."""

import dataclasses
import sys
from collections import namedtuple

import pytest
import torch
from torch import nn

from conftest import REPO
from orchestrator.config import load_job
from orchestrator.errors import BadInput
from orchestrator.train.batch import BatchLayout, InputExample

EXAMPLE = REPO / "examples" / "text-classification"
CPU = torch.device("cpu")


@pytest.fixture
def textcls(monkeypatch):
    """The text example's module, imported from its directory as submit would (cwd first on sys.path)."""
    monkeypatch.chdir(EXAMPLE)
    monkeypatch.delitem(sys.modules, "textcls", raising=False)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import textcls

    return textcls


def text_job(*overrides):
    return load_job(EXAMPLE / "job.yaml", ["data.kwargs.train_samples=256", "data.kwargs.eval_samples=101",
                                           "run.batch_size=16", *overrides])


@dataclasses.dataclass
class Encoded:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor


def test_a_batch_is_read_from_dicts_dataclasses_tuples_and_pairs_with_every_dtype_kept():
    ids = torch.randint(1, 9, (3, 5))
    mask, labels = ids > 2, torch.tensor([0, 1, 2])
    named = BatchLayout(("input_ids", "attention_mask"), "labels")
    Row = namedtuple("Row", "input_ids attention_mask labels")
    for raw in ({"input_ids": ids, "attention_mask": mask, "labels": labels, "length": 5},
                Encoded(ids, mask, labels), Row(ids, mask, labels)):
        batch = named.batch(raw)
        assert batch.args == () and list(batch.kwargs) == ["input_ids", "attention_mask"] and batch.size == 3
        assert batch.kwargs["input_ids"] is ids and batch.targets is labels
    everything_else = BatchLayout((), "labels").batch({"input_ids": ids, "attention_mask": mask, "labels": labels})
    assert list(everything_else.kwargs) == ["input_ids", "attention_mask"]
    by_index = BatchLayout(("0", "1"), "2").batch((ids, mask, labels))  # a tuple's parts by index: positional
    assert by_index.args == (ids, mask) and by_index.kwargs == {}
    pair = BatchLayout().batch([{"input_ids": ids}, labels])  # (inputs, targets) with a dict of keyword inputs
    assert pair.kwargs == {"input_ids": ids} and pair.targets is labels

    images = torch.randn(3, 3, 4, 4)
    placed = BatchLayout().batch(((images, ids, mask), labels)).to(CPU, torch.channels_last)
    assert [t.dtype for t in placed.args] == [torch.float32, torch.int64, torch.bool]
    assert placed.args[0].is_contiguous(memory_format=torch.channels_last) and placed.targets.dtype == torch.int64

    with pytest.raises(BadInput, match="task.inputs: the batch has no part 'token_ids'; its parts are input_ids, "
                                       "attention_mask, labels"):
        BatchLayout(("token_ids",), "labels").batch({"input_ids": ids, "attention_mask": mask, "labels": labels})
    with pytest.raises(BadInput, match=r"task.target: a batch here is dict with parts input_ids, labels, not an "
                                       r"\(inputs, targets\) pair"):
        BatchLayout().batch({"input_ids": ids, "labels": labels})


def test_the_input_example_keeps_the_first_batch_and_learns_which_dims_vary(textcls):
    from orchestrator.tracking.logged_model import ModelInputs

    train, _ = textcls.make_datasets(64, 8)
    layout, example = BatchLayout(("attention_mask", "input_ids"), "labels"), InputExample()  # not the call order
    for start in range(0, 64, 8):
        example.observe(layout.batch(textcls.pad_collate([train[i] for i in range(start, start + 8)])))
    again = InputExample(example.state())  # as a checkpoint keeps it
    assert again.named["input_ids"].shape[0] == 2 and again.variable == {"input_ids": [1], "attention_mask": [1]}

    inputs = ModelInputs.from_example(textcls.TinyTextClassifier(), again.state())
    assert inputs.names == ["input_ids", "attention_mask"] and inputs.positional == 2  # bound to forward's order
    specs = [(spec.name, str(spec.type), spec.shape) for spec in inputs.signature().inputs.inputs]
    assert specs == [("input_ids", "int64", (-1, -1)), ("attention_mask", "bool", (-1, -1))]
    digits = ModelInputs.from_example(nn.Linear(8, 2), {"positional": [torch.zeros(2, 8)]})
    (spec,) = digits.signature().inputs.inputs
    assert spec.name is None and spec.shape == (-1, 8) and digits.example().shape == (2, 8)


def test_preflight_takes_int64_token_ids_through_the_collate_function_and_names_every_metric(textcls):
    from orchestrator.runner.preflight import check_data_fits_model
    from orchestrator.train.models import build_model

    cfg = text_job()
    lineage, evaluated = check_data_fits_model(cfg, build_model(cfg.model))
    assert evaluated == {"eval/loss", "eval/accuracy", "eval/f1_macro"}
    train = lineage[0]
    assert [(name, dtype) for name, dtype, _ in train.inputs] == [("input_ids", "int64"), ("attention_mask", "bool")]
    assert train.target_dtype == "int64" and train.num_samples == 256


@pytest.mark.slow  # trains in processes of its own
def test_a_torchmetrics_f1_over_two_uneven_shards_equals_it_over_the_whole_eval_set_in_one_process(
        textcls, tmp_path):
    """101 eval samples: rank 0 scores 51 and rank 1 50, each with a short last batch. The logged macro-F1 is
    torchmetrics' own sync of both ranks' states, the same number as one process computes over all 101."""
    from omegaconf import OmegaConf
    from torch.utils.data import DataLoader
    from torchmetrics.classification import MulticlassF1Score

    from orchestrator.train.local import spawn

    cfg = text_job("precision.preset=O0", "run.max_steps_per_epoch=4", "tracking.system_metrics_interval_s=0")
    result = spawn(OmegaConf.to_container(cfg, resolve=True), 2, tmp_path)
    logged = result["reports"][-1].metrics

    model = textcls.TinyTextClassifier(num_classes=4, **cfg.model.kwargs)
    model.load_state_dict(result["weights"])
    _, evaluation = textcls.make_datasets(256, 101)
    f1, correct = MulticlassF1Score(num_classes=4, average="macro"), 0
    with torch.no_grad():
        for batch in DataLoader(evaluation, batch_size=16, collate_fn=textcls.pad_collate):
            logits = model.eval()(batch["input_ids"], batch["attention_mask"])
            f1.update(logits, batch["labels"])
            correct += int((logits.argmax(1) == batch["labels"]).sum())
    assert logged["eval/f1_macro"] == pytest.approx(float(f1.compute()), abs=1e-6)
    assert logged["eval/accuracy"] == pytest.approx(correct / 101, abs=1e-9)


class NormEval(nn.Module):
    """A model keeping its BatchNorm in eval mode whenever it is put in training mode (mmdetection's norm_eval)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8, num_classes)

    def train(self, mode: bool = True):
        super().train(mode)
        self.bn.eval()
        return self

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def test_training_runs_the_models_own_train_so_its_norm_layers_stay_in_eval_mode(tmp_path, monkeypatch):
    from orchestrator.train.local import LocalSession
    from orchestrator.train.loop import TrainingLoop

    (tmp_path / "norm_eval_models.py").write_text("from test_any_batch import NormEval\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    cfg = load_job(REPO / "jobs" / "quickstart.yaml", [
        "model.name=norm_eval_models:NormEval", "precision.preset=O0", "scaling.num_workers=1", "run.epochs=1",
        "run.max_steps_per_epoch=3", "run.batch_size=8", "tracking.system_metrics_interval_s=0"])
    model = TrainingLoop(cfg, LocalSession(0, 1, CPU, tmp_path / "checkpoints")).run().prepared.raw
    assert model.training and model.conv.training and not model.bn.training  # after training and evaluation
    assert int(model.bn.num_batches_tracked) == 0 and torch.equal(model.bn.running_mean, torch.zeros(8))
