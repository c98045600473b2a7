"""Models as they come: outputs that are a dict, a dataclass, a tuple or a Hugging Face `ModelOutput` feed the
built-in losses and metrics (the prediction read from `task.output`, else `logits`); `task.loss: model` is the loss
the model returns, the model given the targets; a Hugging Face class is built from its config by `model.kwargs`;
the logged program returns plain tensors and dicts, and takes its inputs by keyword too."""

import pytest
import torch
from omegaconf import OmegaConf
from transformers import BertConfig, BertForSequenceClassification

from conftest import REPO
from orchestrator.config.schema import TaskSection
from orchestrator.errors import BadInput
from orchestrator.train.batch import BatchLayout, plain
from orchestrator.train.task import build_loss, build_metrics, fp32, prediction

TINY_BERT = dict(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                 max_position_embeddings=32)


def task(**values):
    return OmegaConf.merge(OmegaConf.structured(TaskSection), values)


@pytest.fixture(scope="module")
def bert():
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(num_labels=3, **TINY_BERT)).eval()


def tokens(samples=4, length=7):
    torch.manual_seed(1)
    return torch.randint(1, 40, (samples, length)), torch.ones(samples, length, dtype=torch.long)


@torch.no_grad()
def test_the_builtin_loss_and_metrics_read_a_model_outputs_logits(bert):
    ids, mask = tokens()
    labels = torch.tensor([0, 1, 2, 1])
    outputs = bert(input_ids=ids, attention_mask=mask)
    assert type(outputs).__name__ == "SequenceClassifierOutput"
    expected = torch.nn.functional.cross_entropy(outputs.logits, labels)
    assert float(build_loss(task())(outputs, labels)) == pytest.approx(float(expected))
    (metric,) = build_metrics(task())
    metric.update(fp32(outputs), labels)
    assert metric.sums["accuracy"][0] == int((outputs.logits.argmax(1) == labels).sum())
    assert type(fp32(outputs)) is type(outputs)  # the user's own functions still get a ModelOutput


def test_task_output_names_the_prediction_by_key_attribute_or_index_and_a_wrong_name_says_which():
    scores, other = torch.randn(4, 3), torch.randn(4, 5)
    labels = torch.tensor([0, 1, 2, 1])
    expected = float(torch.nn.functional.cross_entropy(scores, labels))
    for outputs, output in (({"scores": scores, "aux": other}, "scores"), ((other, scores), "1")):
        assert float(build_loss(task(output=output))(outputs, labels)) == pytest.approx(expected)
        (metric,) = build_metrics(task(output=output))
        metric.update(outputs, labels)
        assert metric.sums["accuracy"][0] == int((scores.argmax(1) == labels).sum())
    assert prediction({"logits": scores, "aux": other}) is scores
    with pytest.raises(BadInput, match=r"task.output: the model's output has no part 'score'; its parts are "
                                       r"scores, aux"):
        build_loss(task(output="score"))({"scores": scores, "aux": other}, labels)


def test_task_loss_model_gives_the_model_the_targets_and_takes_its_loss(bert):
    ids, mask = tokens()
    raw = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 2, 1])}
    job = task(loss="model", inputs=["input_ids", "attention_mask"], target="labels")
    batch = BatchLayout.from_task(job).batch(raw)
    assert [name for name, _ in batch.inputs()] == ["input_ids", "attention_mask"]  # the signature has no labels
    outputs = batch.forward(bert)
    expected = torch.nn.functional.cross_entropy(outputs.logits, raw["labels"])
    assert float(build_loss(job)(outputs, batch.targets)) == pytest.approx(float(expected))
    inference = BatchLayout.from_task(job, inference=True).batch(raw)
    assert inference.forward(bert).loss is None  # export and predict need no loss
    with pytest.raises(BadInput, match="task.loss: model: the model's output has no part 'loss'"):
        build_loss(job)({"logits": outputs.logits}, batch.targets)


def test_plain_outputs_are_dicts_of_tensors_without_the_parts_that_are_none(bert):
    ids, mask = tokens()
    outputs = plain(bert(input_ids=ids, attention_mask=mask))
    assert type(outputs) is dict and list(outputs) == ["logits"]
    assert plain((outputs["logits"], {"a": None, "b": outputs["logits"]})) == (outputs["logits"],
                                                                              {"b": outputs["logits"]})


def test_a_hugging_face_class_is_built_from_its_config_and_num_classes_is_its_num_labels():
    from orchestrator.train.models import build_model

    model = build_model(OmegaConf.create({"name": "transformers:BertForSequenceClassification", "num_classes": 5,
                                          "kwargs": TINY_BERT}))
    assert isinstance(model, BertForSequenceClassification)
    assert model.config.num_labels == 5 and model.config.hidden_size == 16


def test_an_exported_program_takes_its_inputs_by_keyword_as_the_forward_does(bert):
    from orchestrator.tracking.ampflow_pyfunc import accept_keywords

    ids, mask = tokens()
    handle = bert.register_forward_hook(lambda module, args, output: plain(output))
    try:
        program = torch.export.export(bert, (ids, mask)).module()
    finally:
        handle.remove()
    expected = bert(input_ids=ids, attention_mask=mask).logits
    program = accept_keywords(program)
    for outputs in (program(ids, mask), program(input_ids=ids, attention_mask=mask),
                    program(ids, attention_mask=mask)):
        assert type(outputs) is dict and torch.allclose(outputs["logits"], expected, atol=1e-6)
    with pytest.raises(TypeError, match="the model takes input_ids, attention_mask; unknown: mask; missing: "
                                        "attention_mask"):
        program(ids, mask=mask)


def test_each_loader_of_the_logged_program_takes_the_call_shapes_the_docs_give_it(bert, mlflow_uri, tmp_path,
                                                                                 monkeypatch):
    """`mlflow.pytorch.load_model`: positionally only, in the signature's order (torch's check of an exported
    program takes the one call shape it was exported with); the pyfunc's `get_raw_model()` and ampflow's own
    loader (`RunTracker.load_model`, predict, export): positionally or by the forward's names."""
    import mlflow

    from orchestrator.config import load_job
    from orchestrator.tracking.logged_model import ModelInputs
    from orchestrator.tracking.tracker import RunTracker

    monkeypatch.chdir(tmp_path)  # the store's artifacts (./mlruns) go there
    cfg = load_job(REPO / "jobs" / "quickstart.yaml", [f"tracking.uri={mlflow_uri}"])
    tracker = RunTracker.start(mlflow_uri, cfg, run_name="bert", tags={}, params={}, config_yaml="")
    ids, mask = tokens(2, 5)
    inputs = ModelInputs.from_example(bert, {"named": {"input_ids": ids, "attention_mask": mask},
                                             "variable": {"input_ids": [1], "attention_mask": [1]}})
    assert tracker.log_model(bert, inputs) == "pt2"
    ids, mask = tokens(3, 9)
    expected = bert(input_ids=ids, attention_mask=mask).logits

    uri = f"runs:/{tracker.run_id}/model"
    plain_program = mlflow.pytorch.load_model(uri)
    assert torch.allclose(plain_program(ids, mask)["logits"], expected, atol=1e-5)
    with pytest.raises(ValueError, match="kwarg keyword mismatch"):
        plain_program(input_ids=ids, attention_mask=mask)
    for program in (mlflow.pyfunc.load_model(uri).get_raw_model(), tracker.load_model()):
        for outputs in (program(ids, mask), program(input_ids=ids, attention_mask=mask),
                        program(attention_mask=mask, input_ids=ids), program(ids, attention_mask=mask)):
            assert torch.allclose(outputs["logits"], expected, atol=1e-5)


def test_the_logged_signature_has_the_prediction_of_a_model_output(bert):
    from orchestrator.tracking.logged_model import ModelInputs

    ids, mask = tokens(2, 5)
    inputs = ModelInputs.from_example(bert, {"named": {"input_ids": ids, "attention_mask": mask},
                                             "variable": {"input_ids": [1], "attention_mask": [1]}})
    (spec,) = inputs.signature(bert).outputs.inputs
    assert spec.shape == (-1, 3) and str(spec.type) == "float32"
    assert inputs.signature().outputs is None
