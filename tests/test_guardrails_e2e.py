"""Loss-scale telemetry, memory by dtype, non-finite losses and the collapse guardrails, through submit (2 Ray workers,
real MLflow)."""

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import drill, small_job
from orchestrator.tracking.summary_values import values
from test_submit_e2e import only_run

pytestmark = pytest.mark.slow

SIMPLE_CNN_PARAMS = 268_650


def submit(tmp_path, monkeypatch, write_job, mlflow_uri, experiment, **sections) -> int:
    from orchestrator.cli.submit import main

    monkeypatch.chdir(tmp_path)
    sections["tracking"] = {"uri": mlflow_uri, "experiment": experiment, "log_every_n_steps": 1,
                            **sections.get("tracking", {})}
    return main([str(write_job(small_job(**sections)))])


def history(client, run_id, key) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def artifact_json(client, run_id, path):
    return json.loads(Path(client.download_artifacts(run_id, path)).read_text())


def checkpoint_states(tmp_path) -> list[dict]:
    files = sorted((tmp_path / "ray_results").glob("*/checkpoint_*/train_state.pt"))
    return [torch.load(f, weights_only=True) for f in files]


def test_an_overflow_and_a_nan_loss_are_skipped_one_backing_the_scale_off_logged_and_plotted_with_memory_by_dtype(
        ray_session, tmp_path, monkeypatch, write_job, mlflow_uri):
    # Step 2's loss is NaN (skipped, `on_nan_loss: skip`), step 3's features.3 gradient overflows (skipped).
    rc = submit(tmp_path, monkeypatch, write_job, mlflow_uri, "telemetry",
                precision={"preset": "O1", "init_scale": 1024, "scaler": {"on_nan_loss": "skip"}},
                callbacks=[drill("NanLoss", at_step=2), drill("Overflow", at_steps=[3], layer="features.3")])
    assert rc == 0
    client, run = only_run(mlflow_uri, "telemetry")
    run_id, metrics = run.info.run_id, values(run.data.metrics, run.data.tags)  # summary tags too

    scale = dict(history(client, run_id, "amp/loss_scale"))
    assert scale[2] == 1024.0  # no backoff for a bad loss
    assert scale[3] == 512.0  # the overflowing step backed the scale off
    assert metrics["amp/nan_loss_steps"] == 1.0
    assert history(client, run_id, "amp/skipped_steps")[-1] == (4, 2.0)
    assert metrics["amp/skip_rate"] == 0.5 and metrics["amp/consecutive_skips"] == 0.0
    assert {"amp/growth_events", "amp/rank_disagreements"} <= set(metrics)
    # Every step once, no step logged twice; step 2's loss was NaN: no train/loss to log there.
    for key, logged in (("amp/loss_scale", [1, 2, 3, 4]), ("train/loss", [1, 3, 4])):
        steps = Counter(step for step, _ in history(client, run_id, key))
        assert set(steps.values()) == {1} and sorted(steps) == logged, key

    log = artifact_json(client, run_id, "amp/overflow_log.json")
    assert [(r["step"], r["rank"], r["layer"], r["kind"]) for r in log] == [(3, 0, "features.3", "inf"),
                                                                            (3, 1, "features.3", "inf")]
    assert log[0]["loss_scale"] == 1024.0 and log[0]["max_abs_grad"] > 0

    assert metrics["memory/params_float32_bytes"] == SIMPLE_CNN_PARAMS * 4
    assert metrics["memory/grads_float32_bytes"] == SIMPLE_CNN_PARAMS * 4
    assert metrics["memory/optimizer_float32_bytes"] == SIMPLE_CNN_PARAMS * 4  # SGD momentum
    assert metrics["memory/activations_float16_bytes"] > 0  # fp16 autocast
    assert metrics["memory/weight_casts_float16_bytes"] > 0
    assert metrics["memory/rank0_peak_bytes"] > 0 and metrics["memory/rank1_peak_bytes"] > 0
    assert metrics["memory/peak_bytes"] == max(metrics["memory/rank0_peak_bytes"], metrics["memory/rank1_peak_bytes"])
    table = artifact_json(client, run_id, "memory/breakdown.json")
    assert {"category": "params", "dtype": "float32", "bytes": SIMPLE_CNN_PARAMS * 4,
            "MiB": round(SIMPLE_CNN_PARAMS * 4 / 2**20, 3)} in table
    plots = {a.path for a in client.list_artifacts(run_id, "plots")}
    assert plots == {"plots/loss_scale.png", "plots/memory.png"}
    assert Path(client.download_artifacts(run_id, "plots/loss_scale.png")).read_bytes()[:4] == b"\x89PNG"


COLLAPSE = {"callbacks": [drill("Overflow", at_steps=[2, 3, 4], layer="classifier.3")]}


def test_collapse_abort_fails_naming_the_overflowing_layer(ray_session, tmp_path, monkeypatch, write_job,
                                                           mlflow_uri, capsys):
    rc = submit(tmp_path, monkeypatch, write_job, mlflow_uri, "abort",
                precision={"preset": "O1", "scaler": {"max_consecutive_skips": 2}}, **COLLAPSE)
    assert rc == 1
    err = capsys.readouterr().err
    assert "raised LossScaleCollapsed: loss scale collapsed at step 4" in err
    assert "overflowing layers: classifier.3" in err and "on_collapse: promote" in err
    client, run = only_run(mlflow_uri, "abort")
    assert run.info.status == "FAILED"
    assert {a.path for a in client.list_artifacts(run.info.run_id, "plots")} >= {"plots/loss_scale.png"}


def test_collapse_promote_moves_the_layer_to_fp32_and_training_finishes(ray_session, tmp_path, monkeypatch,
                                                                        write_job, mlflow_uri):
    rc = submit(tmp_path, monkeypatch, write_job, mlflow_uri, "promote",
                precision={"preset": "O2", "init_scale": 1024,
                           "scaler": {"max_consecutive_skips": 2, "on_collapse": "promote"}}, run={"epochs": 2},
                **COLLAPSE)
    assert rc == 0
    client, run = only_run(mlflow_uri, "promote")
    assert run.info.status == "FINISHED"
    assert run.data.tags["precision.promoted"] == "classifier.3"
    audit = {e["name"]: e for e in artifact_json(client, run.info.run_id, "precision/audit.json")}
    promoted = audit["classifier.3"]
    assert (promoted["param_dtype"], promoted["output_dtype"], promoted["rule"]) == ("float32", "float32", "promoted")
    assert audit["classifier.1"]["param_dtype"] == "float16"  # the rest of the policy stands
    log = artifact_json(client, run.info.run_id, "amp/overflow_log.json")
    assert log[-1] == {"step": 4, "event": "collapse", "action": "promote", "layers": ["classifier.3"],
                       "reason": "3 consecutive skipped steps (max_consecutive_skips=2)"}
    promoted_bytes = values(run.data.metrics, run.data.tags)["memory/params_float32_bytes"]
    assert promoted_bytes == (128 * 10 + 10) * 4  # the promoted layer, measured again
    state = checkpoint_states(tmp_path)[-1]
    assert state["promoted"] == ["classifier.3"]
    assert {v.dtype for v in state["model"].values() if v.is_floating_point()} == {torch.float32}


def test_collapse_rollback_restores_the_last_checkpoint(ray_session, tmp_path, monkeypatch, write_job, mlflow_uri):
    # Epoch 1 (steps 1-4) ends in a checkpoint; in epoch 2 step 5 trains, steps 6-8 overflow and the
    # third skip trips the guardrail: weights, optimizer and scale go back to the epoch-1 checkpoint.
    rc = submit(tmp_path, monkeypatch, write_job, mlflow_uri, "rollback",
                precision={"preset": "O1", "init_scale": 1024,
                           "scaler": {"max_consecutive_skips": 2, "on_collapse": "rollback"}},
                run={"epochs": 2}, callbacks=[drill("Overflow", at_steps=[6, 7, 8])])
    assert rc == 0
    client, run = only_run(mlflow_uri, "rollback")
    scale = dict(history(client, run.info.run_id, "amp/loss_scale"))
    assert (scale[7], scale[8]) == (256.0, 1024.0)  # backed off twice, then the checkpoint's scale
    assert artifact_json(client, run.info.run_id, "amp/overflow_log.json")[-1]["action"] == "rollback"
    first, last = checkpoint_states(tmp_path)
    assert (first["global_step"], last["global_step"]) == (4, 8)
    for key, value in first["model"].items():  # step 5's update was rolled back with the rest
        assert torch.equal(value, last["model"][key]), key


def test_a_nan_loss_under_bf16_fails_at_its_step_saying_there_is_nothing_to_resume(
        ray_session, tmp_path, monkeypatch, write_job, mlflow_uri, capsys):
    # bf16: no scaler, but every step's flags are agreed all the same: the run fails at the step itself, before
    # the first checkpoint (the epoch's end).
    rc = submit(tmp_path, monkeypatch, write_job, mlflow_uri, "nan-abort", precision={"preset": "bf16-mixed"},
                callbacks=[drill("NanLoss", at_step=2)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "raised NonFiniteLoss: the loss was not finite at step 2 on rank(s) [0, 1]" in err
    assert "No finite checkpoint was written: there is nothing to resume." in err
    assert "orchestrator.submit" not in err  # no command to resume what does not exist
    assert not list(tmp_path.glob("ray_results/nan-abort-*/checkpoint_0*"))
