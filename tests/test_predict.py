"""`orchestrator.predict(run_id or model_uri, data)` and `ampflow predict`: a logged model runs over a batch or a
dataset in the precision it was trained in (the run's policy and autocast, in eval mode, as its evaluation ran)
or exported in, loaded without unpickling; a model logged pickled is refused."""

import datetime

import numpy as np
import pytest
import torch

from conftest import REPO
from orchestrator.errors import BadInput

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """A run of the quickstart job under bf16 autocast, logged as ampflow logs one: its fp32 model `model` (a pt2
    program, weights of a model that is not freshly initialised), its float16 export `model_float16`, and its
    job. Returns (tracking URI, run id, job config, the fp32 weights)."""
    from orchestrator.runner.export import cast_for_inference
    from orchestrator.config import flatten, load_job, to_yaml
    from orchestrator.tracking.logged_model import ModelInputs
    from orchestrator.tracking.tracker import RunTracker
    from orchestrator.train.models import build_model

    directory = tmp_path_factory.mktemp("predict")
    uri = f"sqlite:///{directory / 'mlflow.db'}"
    cfg = load_job(REPO / "jobs" / "quickstart.yaml", ["precision.preset=bf16-mixed"])
    tracker = RunTracker.start(uri, cfg, run_name="predict", tags={}, params=flatten(cfg), config_yaml=to_yaml(cfg))
    torch.manual_seed(1)
    model = build_model(cfg.model).eval()
    with torch.no_grad():  # BatchNorm statistics that are not the identity
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5), module.running_var.uniform_(0.5, 2.0)
    example = ModelInputs.from_shape((3, 32, 32))
    assert tracker.log_model(model, example) == "pt2"
    exported = cast_for_inference(model, cfg.precision, torch.float16)
    assert tracker.log_model(exported, example, name="model_float16") == "pt2"
    tracker.finish("FINISHED")
    return uri, tracker.run_id, cfg, {k: v.clone() for k, v in model.state_dict().items()}


def trained_as_the_run_evaluates(cfg, weights):
    """The job's model with the weights, prepared by the run's `Precision` as training prepares it."""
    from orchestrator.precision import Precision
    from orchestrator.train.models import build_model

    model = build_model(cfg.model)
    model.load_state_dict(weights)
    precision = Precision(cfg.precision, CPU)
    precision.prepare(model)
    return model.eval(), precision


def test_a_run_predicts_a_batch_as_it_was_trained_bf16_autocast_in_eval_mode(logged):
    """Through `orchestrator.predict(...)`, also once `python -m orchestrator.predict`'s module is imported."""
    import orchestrator
    import orchestrator.predict  # noqa: F401
    from orchestrator.train.models import build_model

    uri, run_id, cfg, weights = logged
    batch = torch.randn(5, 3, 32, 32)
    outputs = orchestrator.predict(run_id, batch, tracking_uri=uri)
    model, precision = trained_as_the_run_evaluates(cfg, weights)
    with torch.no_grad(), precision.forward():
        expected = model(batch)
    assert outputs.dtype == torch.bfloat16 and outputs.device == CPU
    assert torch.equal(outputs, expected)
    fp32 = build_model(cfg.model)
    fp32.load_state_dict(weights)
    with torch.no_grad():
        assert not torch.equal(outputs.float(), fp32.eval()(batch))  # not the fp32 model's outputs
    assert torch.equal(orchestrator.predict(run_id, batch[:1], tracking_uri=uri), outputs[:1])  # no batch statistics


def test_a_run_predicts_its_eval_split_and_any_dataset_in_order(logged):
    from torch.utils.data import TensorDataset

    from orchestrator.runner.predict import load
    from orchestrator.train.data import build_datasets

    uri, run_id, cfg, _ = logged
    predictor = load(run_id, uri)
    eval_set = build_datasets(cfg.data, cfg.model.num_classes)[1]
    outputs = predictor.over("eval", batch_size=100)
    assert outputs.shape == (len(eval_set), 10)
    firsts = torch.stack([eval_set[i][0] for i in range(3)])
    assert torch.equal(outputs[:3], predictor(firsts))
    rows = torch.stack([eval_set[i][0] for i in range(7)])
    assert torch.equal(predictor.over(TensorDataset(rows), batch_size=3), outputs[:7])  # (inputs,) items
    with pytest.raises(BadInput, match="a tuple or list of tensors is ambiguous"):
        predictor.over([rows, torch.zeros(7)])  # inputs and targets, or two inputs?


def test_an_export_predicts_as_exported(logged):
    from orchestrator import predict
    from orchestrator.runner.export import cast_for_inference
    from orchestrator.train.models import build_model

    uri, run_id, cfg, weights = logged
    batch = torch.randn(4, 3, 32, 32)
    outputs = predict(f"runs:/{run_id}/model_float16", batch, tracking_uri=uri)
    model = build_model(cfg.model)
    model.load_state_dict(weights)
    with torch.no_grad():
        expected = cast_for_inference(model, cfg.precision, torch.float16)(batch)
    assert outputs.dtype == expected.dtype == torch.float16
    assert torch.equal(outputs, expected)


def test_a_model_logged_pickled_is_refused_never_unpickled(logged, tmp_path):
    import mlflow

    from orchestrator import predict
    from orchestrator.train.models import build_model

    uri, run_id, cfg, _ = logged
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(run_id=run_id):
        mlflow.pytorch.log_model(build_model(cfg.model), name="model_pickled", serialization_format="pickle",
                                 pip_requirements=["torch"])
    with pytest.raises(BadInput, match="cannot be loaded without unpickling it, and ampflow never unpickles a model"):
        predict(f"runs:/{run_id}/model_pickled", torch.zeros(1, 3, 32, 32), tracking_uri=uri)


def test_the_command_writes_predictions_and_refuses_bad_input_with_exit_2(logged, tmp_path, capsys):
    from orchestrator.cli.ampflow import main
    from orchestrator.runner.predict import load
    from orchestrator.train.data import build_datasets

    uri, run_id, cfg, _ = logged
    torch.save(datetime.date(2026, 1, 1), tmp_path / "planted.pt")  # an object: only a pickle can hold it
    np.save(tmp_path / "rows.npy", np.random.default_rng(0).standard_normal((6, 3, 32, 32), dtype=np.float32))

    def predict(*args: str) -> tuple[int, str]:
        code = main(["predict", *args, "--tracking-uri", uri])
        return code, capsys.readouterr().err

    assert predict(run_id, "--output", str(tmp_path / "eval.npy")) == (0, "")
    eval_rows = len(build_datasets(cfg.data, cfg.model.num_classes)[1])
    assert np.load(tmp_path / "eval.npy").shape == (eval_rows, 10)
    assert predict(run_id, "--data", str(tmp_path / "rows.npy"), "--output", str(tmp_path / "rows.pt"),
                   "--batch-size", "4") == (0, "")
    rows = torch.load(tmp_path / "rows.pt", weights_only=True)
    assert rows.shape == (6, 10) and rows.dtype == torch.bfloat16
    assert torch.equal(rows, load(run_id, uri)(torch.from_numpy(np.load(tmp_path / "rows.npy"))))

    for args, message in (
            (["0123456789abcdef"], "0123456789abcdef: no logged model at runs:/0123456789abcdef/model"),
            ([run_id, "--data", str(tmp_path / "planted.pt")], "--data: cannot read"),
            ([run_id, "--data", "train"], "--data: train is neither 'eval' nor a .pt or .npy file")):
        code, err = predict(*args, "--output", str(tmp_path / "x.pt"))
        assert code == 2 and err.startswith("error: ") and message in err, err
    assert predict(run_id, "--output", str(tmp_path / "x.csv"))[1].startswith("error: --output: ")
    assert not (tmp_path / "x.pt").exists() and not (tmp_path / "x.csv").exists()


def logged_tagger(tmp_path, monkeypatch, new_store, write_job) -> tuple:
    """A run of a token classifier over variable-length text (examples/text-classification's data, padded batch by
    batch by its `data.collate`), its model logged as ampflow logs one, with the padded length variable. Returns
    (tracking URI, run id, the model, its eval set, the eval set's batches of 6, their padded lengths)."""
    import shutil
    import sys

    from orchestrator.config import flatten, load_job, to_yaml
    from orchestrator.runner.export import eval_batches
    from orchestrator.tracking.logged_model import ModelInputs
    from orchestrator.tracking.tracker import RunTracker
    from orchestrator.train.data import build_datasets
    from orchestrator.train.models import build_model

    example = tmp_path / "text"
    shutil.copytree(REPO / "examples" / "text-classification", example)
    monkeypatch.chdir(example)
    monkeypatch.delitem(sys.modules, "textcls", raising=False)
    uri = new_store(tmp_path)
    cfg = load_job(write_job({
        "model": {"name": "tiny_nets:TokenTagger", "num_classes": 3},
        "data": {"name": "textcls:make_datasets", "kwargs": {"train_samples": 8, "eval_samples": 20},
                 "collate": "textcls:pad_collate"},
        "task": {"inputs": ["input_ids", "attention_mask"], "target": "labels"},
        "precision": {"preset": "O0"}, "tracking": {"uri": uri}}))
    tracker = RunTracker.start(uri, cfg, run_name="tagger", tags={}, params=flatten(cfg), config_yaml=to_yaml(cfg))
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    eval_set = build_datasets(cfg.data, cfg.model.num_classes)[1]
    batches = list(eval_batches(cfg, eval_set, batch_size=6))
    lengths = [batch.kwargs["input_ids"].shape[1] for batch in batches]
    assert len(set(lengths)) > 1  # the batches are padded to different lengths
    first = batches[0].kwargs
    inputs = ModelInputs.from_example(model, {"named": dict(first), "variable": {name: [1] for name in first}})
    assert tracker.log_model(model, inputs) == "pt2"
    tracker.finish("FINISHED")
    return uri, tracker.run_id, model, eval_set, batches, lengths


def test_per_token_outputs_of_batches_of_different_lengths_are_padded_to_the_longest(tmp_path, monkeypatch,
                                                                                     new_store, write_job):
    """A token classifier over variable-length text, padded batch by batch by the job's collate: the eval split's
    outputs are `(samples, longest, classes)`, each batch's in its rows and first columns, -100 past its end (as
    Hugging Face's Trainer.predict pads), and `ampflow predict --output preds.npy` writes the same array."""
    from orchestrator import predict
    from orchestrator.cli.ampflow import main
    from orchestrator.runner.predict import PAD_VALUE

    uri, run_id, model, eval_set, batches, lengths = logged_tagger(tmp_path, monkeypatch, new_store, write_job)
    outputs = predict(run_id, "eval", batch_size=6, tracking_uri=uri)
    assert outputs.shape == (len(eval_set), max(lengths), 3) and outputs.dtype == torch.float32
    row = 0
    with torch.no_grad():
        for batch, length in zip(batches, lengths):
            rows = slice(row, row + len(batch.kwargs["input_ids"]))
            assert torch.allclose(outputs[rows, :length], batch.forward(model), atol=1e-6)
            assert (outputs[rows, length:] == PAD_VALUE).all()
            row = rows.stop
    assert row == len(eval_set)

    assert main(["predict", run_id, "--output", str(tmp_path / "preds.npy"), "--batch-size", "6",
                 "--tracking-uri", uri]) == 0
    assert np.array_equal(np.load(tmp_path / "preds.npy"), outputs.numpy())


def test_outputs_that_cannot_hold_the_pad_are_padded_with_zeros_and_other_ranks_are_refused():
    from orchestrator.runner.predict import _concat

    masks = _concat([{"mask": torch.ones(1, 2, dtype=torch.bool)}, {"mask": torch.ones(2, 3, dtype=torch.bool)}])
    assert masks["mask"].tolist() == [[True, True, False], [True, True, True], [True, True, True]]
    with pytest.raises(BadInput, match=r"cannot be joined batch after batch: their shapes \[\(2,\), \(2, 3\)\]"):
        _concat([torch.zeros(2, 3), torch.zeros(2)])
