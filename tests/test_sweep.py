"""`orchestrator.cli.sweep`: one child run per precision preset under one parent run, and the comparison.

Bad input is refused before anything starts; the comparison is computed from what the child runs
logged; end to end, real Ray trains every preset and a real SQLite MLflow store holds the runs.
"""

import json
import subprocess
import sys
import time

import pytest
import yaml
from mlflow import MlflowClient
from mlflow.entities import Metric

from conftest import REPO, run_mains, small_job
from orchestrator.config import load_job
from orchestrator.config.loader import available_presets, configs_dir
from orchestrator.config.yamlsafe import load_yaml_mapping
from orchestrator.cli.sweep_report import ROW_KEYS, add_baseline_ratios, child_row, markdown_table, verdict
from orchestrator.tracking.summary_values import summary_tags
from orchestrator.tracking.tracker import RunTracker

# -- the config each child gets ---------------------------------------------------------------------


@pytest.mark.parametrize("preset", available_presets())
def test_a_command_line_preset_pulls_every_key_of_its_file(write_job, preset):
    # The sweep loads the job with `precision.preset=<p>` per child; the job names another preset.
    cfg = load_job(write_job(small_job(precision={"preset": "O1"})), [f"precision.preset={preset}"])
    assert cfg.precision.preset == preset
    for key, value in load_yaml_mapping(configs_dir() / "precision" / f"{preset}.yaml").items():
        assert cfg.precision[key] == value, f"precision.{key} is not {preset}'s"


# -- bad input: exit 2, nothing started -------------------------------------------------------------

CASES = {
    "unknown_preset": (small_job(), ["--presets", "O0,O9"], ["--presets", "unknown preset 'O9'", "Available: O0"]),
    "duplicate_via_alias": (small_job(), ["--presets", "O1,bf16-mixed,16-mixed"],
                            ["'O1' and '16-mixed' are both preset O1"]),
    "empty_list": (small_job(), ["--presets", " , "], ["--presets: no preset given"]),
    "job_server_address": (small_job(), ["--presets", "O0", "--address", "http://127.0.0.1:8265"],
                           ["does not submit to a job server", "ray://"]),
    "preset_override": (small_job(), ["--presets", "O0", "precision.preset=O1"], ["precision.preset is set by the sweep", "--presets"]),
    "lint_error_names_preset": (small_job(), ["--presets", "O0,O3", "precision.lint=error"],
                                ["preset O3: precision lint found", "precision.lint=warn"]),
    "job_precision_replaces_a_preset": (small_job(precision={"compute_dtype": "float16"}),
                                        ["--presets", "O0,bf16-mixed"],
                                        ["precision.compute_dtype", "replaces preset O0's float32"]),
    "negative_accuracy_drop": (small_job(), ["--presets", "O0", "--max-accuracy-drop=-0.1"],
                               ["--max-accuracy-drop -0.1: must be in [0, 1)"]),
    "bad_override": (small_job(), ["--presets", "O0", "run.epoch=2"], ["command line", "run.epochs"]),
    "more_cpus_than_exist": (small_job(scaling={"resources_per_worker": {"CPU": 4096}}), ["--presets", "O0"],
                             ["8192 CPU"]),
    "mlflow_unreachable": (small_job(tracking={"uri": "http://127.0.0.1:9"}), ["--presets", "O0"],
                           ["cannot be reached"]),
    "nothing_to_sweep": (small_job(), [], ["nothing to sweep", "--grid"]),
    "grid_malformed": (small_job(), ["--grid", "optim.lr"], ["--grid optim.lr: expected KEY=V1,V2"]),
    "grid_no_values": (small_job(), ["--grid", "optim.lr= , "], ["--grid optim.lr= , : no value given"]),
    "grid_value_twice": (small_job(), ["--grid", "optim.lr=0.1,0.1"], ["0.1 listed twice"]),
    "grid_key_twice": (small_job(), ["--grid", "optim.lr=0.1", "--grid", "optim.lr=0.2"],
                       ["--grid gives optim.lr twice"]),
    "grid_and_presets": (small_job(), ["--presets", "O0", "--grid", "precision.preset=O1"],
                         ["--presets and --grid precision.preset both sweep"]),
    "grid_unknown_key": (small_job(), ["--grid", "optim.lrr=0.1,0.2"], ["--grid optim.lrr:", "optim.lr"]),
    "grid_bad_value": (small_job(), ["--grid", "run.epochs=1,two"], ["--grid point run.epochs=two", "run.epochs"]),
    "grid_key_also_overridden": (small_job(), ["--grid", "optim.lr=0.1,0.2", "optim.lr=0.3"],
                                 ["optim.lr is swept by --grid"]),
    "grid_key_overridden_in_a_section": (small_job(), ["--grid", "optim.lr=0.1,0.2", "optim={lr: 0.3}"],
                                         ["optim.lr is swept by --grid"]),
    "grid_preset_also_overridden": (small_job(), ["--grid", "precision.preset=O0,O1", "precision.preset=O2"],
                                    ["precision.preset is set by the sweep", "--grid precision.preset="]),
    "grid_unknown_preset": (small_job(), ["--grid", "precision.preset=O0,O7"],
                            ["--grid: precision.preset: unknown preset 'O7'"]),
}

@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    # All cases in one fresh interpreter (startup is the slow part), each through sweep.main like the CLI.
    workdir = tmp_path_factory.mktemp("sweep-bad-input")
    (workdir / "jobs").mkdir()
    argvs = {}
    for name, (job, args, _) in CASES.items():
        path = workdir / "jobs" / f"{name}.yaml"
        path.write_text(yaml.safe_dump(job))
        argvs[name] = [str(path), *args]
    return run_mains("orchestrator.cli.sweep", argvs, workdir)


@pytest.mark.parametrize("name", CASES)
def test_bad_input_exits_2_says_what_and_starts_nothing(outcomes, name):
    result = outcomes[name]
    assert result["rc"] == 2
    errors = [line for line in result["stderr"].splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result["stderr"]
    for fragment in CASES[name][2]:
        assert fragment in result["stderr"]
    assert not result["ray"], "Ray must not be started for bad input"
    assert result["files"] == ["jobs"], "no mlflow.db (no MLflow run) and no ray_results may be left behind"


def test_job_precision_keys_that_keep_the_presets_are_announced(write_job, capsys):
    from orchestrator.cli.sweep import parse_args
    from orchestrator.cli.sweep_run import validate

    job = write_job(small_job(precision={"preset": "O1", "init_scale": 1024.0}))
    plan = validate(parse_args([str(job), "--presets", "O0,bf16-true"]))
    assert "precision.init_scale" in capsys.readouterr().err
    assert [cfg.precision.init_scale for cfg in plan.configs.values()] == [1024.0, 1024.0]
    assert [cfg.precision.compute_dtype for cfg in plan.configs.values()] == ["float32", "bfloat16"]
    assert [cfg.run.name for cfg in plan.configs.values()] == [f"{plan.name}-O0", f"{plan.name}-bf16-true"]


def test_lightning_names_are_accepted_and_children_run_the_canonical_preset(write_job):
    from orchestrator.cli.sweep import parse_args
    from orchestrator.cli.sweep_run import validate

    plan = validate(parse_args([str(write_job(small_job())), "--presets", "32-true, bf16", "run.name=mine"]))
    assert list(plan.configs) == ["O0", "bf16-mixed"] and plan.name == "mine-sweep"
    assert [cfg.precision.compute_dtype for cfg in plan.configs.values()] == ["float32", "bfloat16"]


def test_a_grid_runs_the_cartesian_product_each_point_labelled_by_its_values(write_job, capsys):
    from orchestrator.cli.sweep import parse_args
    from orchestrator.cli.sweep_run import validate

    job = write_job(small_job(run={"name": "g"}))
    plan = validate(parse_args([str(job), "--grid", "optim.lr=0.1,0.05", "--grid", "precision.preset=O0,bf16"]))
    assert list(plan.configs) == ["lr0.1-O0", "lr0.1-bf16-mixed", "lr0.05-O0", "lr0.05-bf16-mixed"]
    assert [(cfg.optim.lr, cfg.precision.preset, cfg.precision.compute_dtype) for cfg in plan.configs.values()] == [
        (0.1, "O0", "float32"), (0.1, "bf16-mixed", "bfloat16"), (0.05, "O0", "float32"),
        (0.05, "bf16-mixed", "bfloat16")]
    assert [run.name for run in plan.runs] == [f"g-sweep-{label}" for label in plan.configs]
    assert plan.points["lr0.05-O0"] == {"optim.lr": "0.05", "precision.preset": "O0"}
    assert not plan.presets_only and plan.presets == ["O0", "bf16-mixed"]

    only_lr = validate(parse_args([str(job), "--grid", "optim.lr=0.1,0.05", "run.name=h"]))
    assert list(only_lr.configs) == ["lr0.1", "lr0.05"] and only_lr.presets is None
    assert [cfg.precision.preset for cfg in only_lr.configs.values()] == [None, None]  # the job's own precision


def test_a_list_in_brackets_is_one_value_of_the_grid(write_job):
    from orchestrator.cli.sweep import parse_args
    from orchestrator.cli.sweep_run import validate

    job = write_job(small_job(run={"name": "g"}, optim={"name": "adamw"}))
    plan = validate(parse_args([str(job), "--grid", "optim.betas=[0.9, 0.99],[0.8,0.9]", "--grid", "optim.lr=0.1"]))
    assert [list(cfg.optim.betas) for cfg in plan.configs.values()] == [[0.9, 0.99], [0.8, 0.9]]
    assert list(plan.configs) == ["betas_0.9_0.99-lr0.1", "betas_0.8_0.9-lr0.1"]


def test_labels_hold_only_what_a_run_name_can_and_stay_unique():
    from orchestrator.cli.sweep_grid import point_labels

    assert list(point_labels([("precision.preset", ["O0", "O1"])])) == ["O0", "O1"]
    assert list(point_labels([("data.kwargs.path", ["a/b", "a:b"])])) == ["patha_b-1", "patha_b-2"]
    assert list(point_labels([("optim.betas", ["[0.9,0.99]"])])) == ["betas_0.9_0.99"]


def test_a_grids_table_has_its_label_and_a_column_per_swept_key():
    rows = []
    for label, lr, preset, samples in (("lr0.1-O0", "0.1", "O0", 100.0), ("lr0.05-O1", "0.05", "O1", 150.0)):
        row = dict.fromkeys(ROW_KEYS)
        row.update(preset=preset, run_id="r", status="FINISHED", samples_per_s=samples, peak_memory_bytes=2**20,
                   final_accuracy=0.9, skipped_steps=0.0, wall_time_s=1.0, point=label)
        row["optim.lr"] = lr
        rows.append(row)
    table = markdown_table(add_baseline_ratios(rows))
    assert table.splitlines()[0].startswith("| point | optim.lr | preset | status | samples/s | speedup vs lr0.1-O0 |")
    assert "| lr0.05-O1 | 0.05 | O1 | FINISHED | 150.0 | 1.50x |" in table
    assert verdict(rows, 0.01).startswith("Fastest: lr0.05-O1;")


# -- the comparison, from real MLflow runs ---------------------------------------------------------


def _child(client, experiment_id, histories: dict[str, list[tuple[int, float]]], status: str) -> str:
    run_id = client.create_run(experiment_id).info.run_id
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(key, value, now + i, step) for key, points in histories.items()
                                      for i, (step, value) in enumerate(points)])
    client.set_terminated(run_id, status=status)
    return run_id


def test_rows_are_computed_from_the_child_runs_metric_histories(mlflow_uri):
    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment_id = client.create_experiment("rows")
    # Logged out of step order on purpose: "first" and "last" are by step, not by insertion.
    fp32 = {"perf/samples_per_s": [(4, 120.0), (2, 10.0), (6, 100.0)], "memory/peak_bytes": [(6, 3e8), (3, 5e8)],
            "eval/accuracy": [(6, 0.9), (3, 0.8)], "amp/skipped_steps": [(2, 0.0), (6, 0.0)]}
    half = {"perf/samples_per_s": [(2, 50.0), (4, 330.0)], "memory/peak_bytes": [(6, 2e8)],
            "eval/accuracy": [(6, 0.85)], "amp/skipped_steps": [(6, 3.0), (2, 1.0)]}
    broken = {"perf/samples_per_s": [(2, 70.0)]}
    ids = [_child(client, experiment_id, fp32, "FINISHED"), _child(client, experiment_id, half, "FINISHED"),
           _child(client, experiment_id, broken, "FAILED")]
    def tracker(run_id):
        return RunTracker.open(mlflow_uri, run_id)

    rows = add_baseline_ratios([child_row(tracker(ids[0]), "O0", 0), child_row(tracker(ids[1]), "O1", 0),
                                child_row(tracker(ids[2]), "O3", 1)])

    assert all(tuple(row) == ROW_KEYS for row in rows)
    o0, o1, o3 = rows
    assert o0["samples_per_s"] == pytest.approx((120.0 + 100.0) / 2)  # the step-2 warm-up report left out
    assert o1["samples_per_s"] == pytest.approx(330.0)
    assert o3["samples_per_s"] == pytest.approx(70.0)  # a single report is kept
    assert (o0["peak_memory_bytes"], o1["peak_memory_bytes"]) == (5e8, 2e8)
    assert (o0["final_accuracy"], o1["final_accuracy"], o3["final_accuracy"]) == (0.9, 0.85, None)
    assert (o0["skipped_steps"], o1["skipped_steps"]) == (0.0, 3.0)
    assert [row["status"] for row in rows] == ["FINISHED", "FINISHED", "FAILED"]
    assert [row["run_id"] for row in rows] == ids
    run = client.get_run(ids[1]).info
    assert o1["wall_time_s"] == pytest.approx((run.end_time - run.start_time) / 1000)
    assert o1["speedup"] == pytest.approx(330.0 / 110.0)
    assert o1["memory_ratio"] == pytest.approx(2e8 / 5e8)
    assert o1["accuracy_delta"] == pytest.approx(0.85 - 0.9)
    assert (o0["speedup"], o0["memory_ratio"], o0["accuracy_delta"]) == (1.0, 1.0, 0.0)
    assert o3["accuracy_delta"] is None and o3["speedup"] == pytest.approx(70.0 / 110.0)

    table = markdown_table(rows).splitlines()
    assert len(table) == 2 + 3 and "speedup vs O0" in table[0]
    assert table[3].startswith("| O1 | FINISHED | 330.0 | 3.00x | 190.7 | 0.40x | 0.8500 | -0.0500 | 3 |")
    line = verdict(rows, max_accuracy_drop=0.01)
    assert "Fastest: O1" in line and "smallest peak memory: O1" in line and "most accurate: O0" in line
    assert "losing more than 0.01 accuracy vs O0: O1" in line and "not finished: O3" in line
    assert "vs O0: none" in verdict(rows, max_accuracy_drop=0.1)


def test_a_run_mlflow_never_created_is_a_row_of_its_own():
    row = child_row(None, "O2", 1)
    assert tuple(row) == ROW_KEYS and row["status"] == "FAILED" and row["samples_per_s"] is None


def test_a_failed_baseline_leaves_every_ratio_empty():
    finished = {**child_row(None, "O0", 0), "status": "FINISHED", "samples_per_s": 100.0,
                "peak_memory_bytes": 1e8, "final_accuracy": 0.9}
    rows = add_baseline_ratios([child_row(None, "O2", 1), finished])
    assert [(row["speedup"], row["memory_ratio"], row["accuracy_delta"]) for row in rows] == [(None,) * 3] * 2


# -- end to end ------------------------------------------------------------------------------------


def _sweep_runs(uri: str, experiment: str):
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    parents = [r for r in runs if r.data.tags.get("ampflow.sweep") == "true"]
    assert len(parents) == 1, f"expected exactly one parent run, found {len(parents)}"
    children = [r for r in runs if r is not parents[0]]
    return client, parents[0], children


def _expected_measurements(client, run_id: str) -> dict:
    """What a row must hold, recomputed here from the child's metric histories (a value that never changed is the
    run's summary tag of that name)."""
    def values(key):
        history = [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]
        held = summary_tags(client.get_run(run_id).data.tags).get(key)
        return history or ([] if held is None else [held])

    samples = values("perf/samples_per_s")
    samples = samples[1:] if len(samples) > 1 else samples
    return {"samples_per_s": sum(samples) / len(samples), "peak_memory_bytes": max(values("memory/peak_bytes")),
            "final_accuracy": values("eval/accuracy")[-1], "skipped_steps": values("amp/skipped_steps")[-1]}


FAILS_UNDER_FP16_AUTOCAST = """
import torch
import torch.nn as nn

class Net(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x):
        if self.training and torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16:
            raise RuntimeError("this model refuses fp16 autocast")
        return self.body(x)
"""


@pytest.mark.slow
def test_sweep_runs_each_preset_as_a_child_compares_them_and_goes_on_past_a_failed_one(ray_session, new_store,
                                                                                       tmp_path, monkeypatch, capsys):
    """A sweep of three presets, one failing, compared in one table.

    Long: it trains three runs one after another through Ray Train (one worker group each), since the sweep's
    children are whole submits and going on past a failed one is what it checks."""
    # An import-path model from the sweep's directory; it fails to train under O1 (fp16 autocast) only. The
    # failing preset is in the middle: the one after it still runs, and the first stays the baseline. In this
    # process's Ray (how a sweep that starts its own ships the model is submit's, test_submit_e2e).
    from orchestrator.cli.sweep import main

    (tmp_path / "sweep_nets.py").write_text(FAILS_UNDER_FP16_AUTOCAST)
    uri = new_store(tmp_path)
    job = tmp_path / "tiny.yaml"
    # One worker of two steps per child: what is checked is the sweep (shipping, order, the failed child), not DDP.
    job.write_text(yaml.safe_dump(small_job(model={"name": "sweep_nets:Net"}, scaling={"num_workers": 1},
                                            run={"max_steps_per_epoch": 2}, tracking={"experiment": "sweep-e2e"})))
    started = time.time()
    monkeypatch.chdir(tmp_path)
    code = main([str(job), "--presets", "O0,O1,bf16-mixed", f"tracking.uri={uri}",
                 f"checkpoint.storage_path={tmp_path / 'ray_results'}"])
    out = capsys.readouterr()
    assert code == 1, out.out + out.err  # one child failed
    assert "refuses fp16 autocast" in out.err
    client, parent, children = _sweep_runs(uri, "sweep-e2e")

    assert parent.info.status == "FAILED"
    assert parent.info.run_name.startswith("tiny-sweep-")
    assert parent.data.tags["sweep.presets"] == "O0,O1,bf16-mixed"
    by_preset = {child.data.tags["preset"]: child for child in children}
    assert sorted(by_preset) == ["O0", "O1", "bf16-mixed"] and len(children) == 3
    assert {preset: child.info.status for preset, child in by_preset.items()} == {
        "O0": "FINISHED", "O1": "FAILED", "bf16-mixed": "FINISHED"}
    for preset, child in by_preset.items():
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.info.run_name == f"{parent.info.run_name}-{preset}"
        assert child.info.start_time >= started * 1000 - 1000
        assert (tmp_path / "ray_results" / child.info.run_name).is_dir()  # its own Ray run directory
    assert by_preset["bf16-mixed"].data.params["precision.compute_dtype"] == "bfloat16"
    assert by_preset["O0"].data.params["precision.compute_dtype"] == "float32"

    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "sweep")}
    assert {"sweep/comparison.json", "sweep/comparison.md", "sweep/comparison.png"} <= artifacts
    rows = json.loads(open(client.download_artifacts(parent.info.run_id, "sweep/comparison.json")).read())
    assert [(row["preset"], row["status"]) for row in rows] == [
        ("O0", "FINISHED"), ("O1", "FAILED"), ("bf16-mixed", "FINISHED")]
    for row in rows:
        assert tuple(row) == ROW_KEYS
        child = by_preset[row["preset"]]
        assert row["run_id"] == child.info.run_id
        assert row["wall_time_s"] == pytest.approx((child.info.end_time - child.info.start_time) / 1000)
        if row["status"] != "FINISHED":
            continue
        for key, value in _expected_measurements(client, child.info.run_id).items():
            assert row[key] == pytest.approx(value), key
            assert parent.data.metrics[f"sweep/{row['preset']}/{key}"] == pytest.approx(value)
    assert rows[1]["speedup"] is None  # the failed child reported nothing to compare
    assert rows[2]["speedup"] == pytest.approx(rows[2]["samples_per_s"] / rows[0]["samples_per_s"])
    assert rows[2]["accuracy_delta"] == pytest.approx(rows[2]["final_accuracy"] - rows[0]["final_accuracy"])

    assert "| bf16-mixed | FINISHED |" in out.out and "Fastest: " in out.out
    assert "not finished: O1" in out.out
    assert parent.info.run_id in out.out


@pytest.mark.slow
def test_a_grid_leaves_a_parent_a_child_per_point_and_a_table_with_every_key(ray_session, new_store, tmp_path,
                                                                              monkeypatch, capsys):
    # Two points of two keys (the cartesian product itself is checked above, without Ray), in this process's Ray:
    # one worker of two steps each keeps it cheap; what is checked is the grid, not the training.
    from orchestrator.cli.sweep import main

    uri = new_store(tmp_path)
    job = tmp_path / "grid.yaml"
    job.write_text(yaml.safe_dump(small_job(run={"max_steps_per_epoch": 2}, scaling={"num_workers": 1},
                                            tracking={"experiment": "grid-e2e"})))
    monkeypatch.chdir(tmp_path)
    code = main([str(job), "--grid", "optim.lr=0.1,0.02", "--grid", "precision.preset=bf16-mixed",
                 f"tracking.uri={uri}", f"checkpoint.storage_path={tmp_path / 'ray_results'}",
                 "tracking.system_metrics_interval_s=0"])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    client, parent, children = _sweep_runs(uri, "grid-e2e")
    assert parent.info.status == "FINISHED" and len(children) == 2
    assert parent.data.tags["sweep.grid"] == "optim.lr=0.1,0.02;precision.preset=bf16-mixed"
    assert "optim.lr" not in parent.data.params and "precision.compute_dtype" not in parent.data.params
    points = {(child.data.tags["sweep.optim.lr"], child.data.tags["sweep.precision.preset"]): child
              for child in children}
    assert sorted(points) == [("0.02", "bf16-mixed"), ("0.1", "bf16-mixed")]
    for (lr, preset), child in points.items():
        assert child.info.status == "FINISHED" and child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.params["optim.lr"] == lr and child.data.tags["preset"] == preset
        assert child.info.run_name == f"{parent.info.run_name}-lr{lr}-{preset}"

    rows = json.loads(open(client.download_artifacts(parent.info.run_id, "sweep/comparison.json")).read())
    assert [(row["point"], row["optim.lr"], row["preset"]) for row in rows] == [
        ("lr0.1-bf16-mixed", "0.1", "bf16-mixed"), ("lr0.02-bf16-mixed", "0.02", "bf16-mixed")]
    for row in rows:
        assert row["run_id"] == points[(row["optim.lr"], row["preset"])].info.run_id
        assert parent.data.metrics[f"sweep/{row['point']}/final_accuracy"] == pytest.approx(row["final_accuracy"])
    assert "| point | optim.lr | preset | status |" in out.out
    assert "| lr0.02-bf16-mixed | 0.02 | bf16-mixed | FINISHED |" in out.out


@pytest.mark.slow
def test_ctrl_c_closes_the_parent_and_the_running_child_killed(new_store, tmp_path):
    """Ctrl-C to a sweep while its first child trains: exit 130, the parent run and that child KILLED, no later child.

    Long: the sweep starts a Ray of its own, as a user's does (the signal must end it), and the signal must land
    while a child trains, once its first loss is in the store."""
    import signal

    uri = new_store(tmp_path)
    job = tmp_path / "long.yaml"
    job.write_text(yaml.safe_dump(small_job(run={"epochs": 50, "max_steps_per_epoch": None},
                                            tracking={"uri": uri, "experiment": "sweep-ctrl-c"})))
    sweep = subprocess.Popen([sys.executable, "-m", "orchestrator.sweep", str(job), "--presets", "O0,bf16-mixed",
                              f"checkpoint.storage_path={tmp_path / 'ray_results'}"],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        client, deadline = MlflowClient(tracking_uri=uri), time.monotonic() + 240
        while time.monotonic() < deadline:  # wait until the first child is training (it has logged a loss)
            experiment = client.get_experiment_by_name("sweep-ctrl-c") if (tmp_path / "mlflow.db").exists() else None
            runs = client.search_runs([experiment.experiment_id]) if experiment else []
            if any("train/loss" in run.data.metrics for run in runs):
                break
            assert sweep.poll() is None, sweep.communicate()
            time.sleep(1)
        else:
            pytest.fail("the first child never logged a loss")
        sweep.send_signal(signal.SIGINT)
        stdout, stderr = sweep.communicate(timeout=120)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 130, stdout + stderr
    client, parent, children = _sweep_runs(uri, "sweep-ctrl-c")
    assert parent.info.status == "KILLED"
    assert [(child.data.tags["preset"], child.info.status) for child in children] == [("O0", "KILLED")]
