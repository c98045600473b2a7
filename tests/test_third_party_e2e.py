"""Third-party models as they come, through `submit`: a bare Hugging Face BERT (built from its config, no weights)
with the default loss and with its own (`task.loss: model`), then exported, predicted over its eval split and
called by keyword; timm's ViT by `timm:create_model` under O2 with an fp32 head; a dict-output model exported.
No wrapper code: job files alone."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO, small_job
from test_submit_e2e import only_run

pytestmark = pytest.mark.slow

BERT = {"name": "transformers:BertForSequenceClassification", "num_classes": 4,
        "kwargs": {"vocab_size": 128, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                   "intermediate_size": 32, "max_position_embeddings": 64}}


def bert_job(uri, **task):
    return {"model": BERT,
            "data": {"name": "textcls:make_datasets", "kwargs": {"train_samples": 64, "eval_samples": 32},
                     "collate": "textcls:pad_collate"},
            "task": {"inputs": ["input_ids", "attention_mask"], "target": "labels", **task},
            "optim": {"name": "adamw", "lr": 0.003}, "precision": {"preset": "O0"},
            "scaling": {"num_workers": 1}, "run": {"epochs": 1, "batch_size": 16},
            "tracking": {"experiment": "bert", "log_every_n_steps": 2, "uri": uri, "system_metrics_interval_s": 0}}


@pytest.fixture
def text_example(tmp_path, monkeypatch):
    example = tmp_path / "text"
    shutil.copytree(REPO / "examples" / "text-classification", example)
    monkeypatch.chdir(example)
    monkeypatch.delitem(sys.modules, "textcls", raising=False)
    return example


def test_a_bare_hugging_face_model_trains_exports_predicts_and_takes_keywords(ray_session, new_store, tmp_path,
                                                                               text_example, write_job, capsys):
    """The default loss and accuracy read the `SequenceClassifierOutput`'s logits; the logged program returns a
    dict and loads without transformers; export (bfloat16) leaves the run's end alone; predict over the eval
    split pads its batches with the job's collate; the export takes `input_ids=..., attention_mask=...`; plain
    `mlflow.pytorch.load_model` takes the inputs positionally, the pyfunc's raw model by keyword too.

    Long: one BERT training run through submit, then an export and predictions, each loading the logged model."""
    import orchestrator
    from orchestrator.cli.export import main as export_main
    from orchestrator.cli.submit import main
    from orchestrator.runner.predict import load

    uri = new_store(tmp_path)
    assert main([str(write_job(bert_job(uri)))]) == 0
    client, run = only_run(uri, "bert")
    assert run.info.status == "FINISHED" and 0 <= run.data.metrics["eval/accuracy"] <= 1
    profile = json.loads(client.get_run(run.info.run_id).inputs.dataset_inputs[0].dataset.profile)
    assert profile["sample_shape"] == ["variable"]  # sentences of many lengths, not the first one's

    predictions = orchestrator.predict(run.info.run_id, "eval", tracking_uri=uri)
    assert isinstance(predictions, torch.Tensor) and predictions.shape == (32, 4)

    end = run.info.end_time
    assert export_main([run.info.run_id, "--dtype", "bfloat16", "--tracking-uri", uri]) == 0
    assert client.get_run(run.info.run_id).info.end_time == end
    exported = load(f"runs:/{run.info.run_id}/model_bfloat16", uri).model
    ids = torch.randint(1, 60, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.bool)
    by_keyword = exported(input_ids=ids, attention_mask=mask)
    assert type(by_keyword) is dict and torch.equal(by_keyword["logits"], exported(ids, mask)["logits"])
    assert "Downloading artifacts" not in capsys.readouterr().err

    # Anyone loads the logged program without importing transformers, and its pyfunc gives an array. Plain
    # `mlflow.pytorch.load_model` takes the inputs positionally, in the signature's order (torch refuses any other
    # call shape of an exported program); the pyfunc's raw model takes them positionally or by keyword.
    script = ("import sys, mlflow, numpy as np, torch\n"
              f"mlflow.set_tracking_uri({uri!r})\n"
              f"uri = 'runs:/{run.info.run_id}/model'\n"
              "ids, mask = torch.randint(1, 60, (2, 5)), torch.ones(2, 5, dtype=torch.bool)\n"
              "net = mlflow.pytorch.load_model(uri)\n"
              "out = net(ids, mask)\n"
              "try:\n"
              "    net(input_ids=ids, attention_mask=mask); plain = 'keywords'\n"
              "except ValueError as exc:\n"
              "    plain = 'positional-only' if 'keyword mismatch' in str(exc) else repr(exc)\n"
              "pyfunc = mlflow.pyfunc.load_model(uri)\n"
              "raw = pyfunc.get_raw_model()\n"
              "same = all(torch.equal(call()['logits'], out['logits']) for call in (\n"
              "    lambda: raw(ids, mask), lambda: raw(input_ids=ids, attention_mask=mask),\n"
              "    lambda: raw(ids, attention_mask=mask)))\n"
              "pred = pyfunc.predict({'input_ids': ids.numpy(), 'attention_mask': mask.numpy()})\n"
              "print(type(out).__name__, plain, same, type(pred).__name__, pred.shape, 'transformers' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.stdout.split()[-7:] == ["dict", "positional-only", "True", "ndarray", "(2,", "4)", "False"], \
        done.stderr[-2000:]


def test_a_hugging_face_model_trains_with_its_own_loss(ray_session, new_store, tmp_path, text_example, write_job):
    """`task.loss: model`: the model is given `labels` and its `loss` is trained and evaluated."""
    from orchestrator.cli.submit import main

    uri = new_store(tmp_path)
    job = bert_job(uri, loss="model")
    job["tracking"]["log_model"] = False
    assert main([str(write_job(job))]) == 0
    _, run = only_run(uri, "bert")
    metrics = run.data.metrics
    assert run.info.status == "FINISHED" and 1.0 < metrics["eval/loss"] < 2.0  # about ln 4 for 4 classes
    assert "eval/accuracy" in metrics


def test_timm_vit_trains_under_o2_with_an_fp32_head(ray_session, new_store, tmp_path, write_job):
    """The issue's failure: the root's own parameters (class token, position embeddings) no longer make the audit
    promise float16 for an output that the fp32 head computes."""
    from orchestrator.cli.submit import main
    from orchestrator.tracking.tracker import RunTracker

    uri = new_store(tmp_path)
    job = small_job(model={"name": "timm:create_model",
                           "kwargs": {"model_name": "vit_tiny_patch16_224", "img_size": 32, "depth": 1,
                                      "embed_dim": 32, "num_heads": 2}},
                    precision={"preset": "O2", "rules": [{"match": "head*", "dtype": "float32"}]},
                    scaling={"num_workers": 1}, run={"epochs": 1, "batch_size": 16, "max_steps_per_epoch": 2},
                    tracking={"experiment": "vit", "uri": uri, "system_metrics_interval_s": 0})
    assert main([str(write_job(job))]) == 0
    _, run = only_run(uri, "vit")
    entries = {e["name"]: e for e in RunTracker.open(uri, run.info.run_id).load_json("precision/audit.json")}
    assert entries["(model)"]["param_dtype"] == "float16"
    assert entries["(model)"]["output_dtype"] == entries["head"]["output_dtype"] == "float32"


def test_a_dict_output_model_exports_by_the_part_task_output_names(ray_session, new_store, tmp_path, write_job):
    """`task.output: scores` for the built-in loss and accuracy, and for the export at the end of training."""
    from orchestrator.cli.submit import main

    uri = new_store(tmp_path)
    job = small_job(model={"name": "tiny_nets:TwoHeads"}, task={"output": "scores"}, precision={"preset": "O0"},
                    scaling={"num_workers": 1}, export={"dtype": "bfloat16", "max_accuracy_drop": 1.0},
                    tracking={"experiment": "two-heads", "uri": uri, "log_model": True,
                              "system_metrics_interval_s": 0})
    assert main([str(write_job(job))]) == 0
    _, run = only_run(uri, "two-heads")
    metrics = run.data.metrics
    assert run.data.tags["export_status"] == "logged"
    assert metrics["export/accuracy"] == pytest.approx(metrics["eval/accuracy"], abs=0.1)


def test_a_run_failed_by_its_audit_still_logs_the_audit(ray_session, new_store, tmp_path, write_job, capsys):
    """`PolicyNotHonoured` ends the run FAILED, naming the layer; its `precision/audit.json` is logged all the same."""
    from orchestrator.cli.submit import main
    from orchestrator.tracking.tracker import RunTracker

    uri = new_store(tmp_path)
    job = small_job(model={"name": "tiny_nets:Float64Output"}, precision={"preset": "O0"},
                    scaling={"num_workers": 1}, run={"epochs": 1, "batch_size": 16, "max_steps_per_epoch": 2},
                    tracking={"experiment": "audit", "uri": uri, "system_metrics_interval_s": 0})
    assert main([str(write_job(job))]) == 1
    assert "layer '(model)' (Float64Output) computed in float64, policy promised float32" in capsys.readouterr().err
    _, run = only_run(uri, "audit")
    assert run.info.status == "FAILED"
    tracker = RunTracker.open(uri, run.info.run_id)
    (entry,) = tracker.load_json("precision/audit.json")
    assert (entry["output_dtype"], entry["promised_output_dtype"]) == ("float64", "float32")
    assert tracker.load_json("precision/audit_summary.json")
