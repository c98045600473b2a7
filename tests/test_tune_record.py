"""What a tune leaves in MLflow, read as a person reads the run page: the tune run named like every run, its params
and tags agreeing, naming the job file it wrote; the tuned job's runs tagged with their rules and linked back to
the tune; and the sensitivity chart drawing only what was measured, with the gradient error and the time beside the
output error."""

import math
import re
from pathlib import Path

import yaml
from mlflow import MlflowClient

from orchestrator.cli.tune import main
from orchestrator.config.loader import load_job
from orchestrator.runner.driver import _start_run
from orchestrator.autotune.plan import chart
from test_tune import hot_job  # noqa: F401  (the fixture)


def test_the_tune_run_names_its_job_file_agrees_with_itself_and_the_tuned_jobs_runs_link_back(hot_job):  # noqa: F811
    job, uri = hot_job
    assert main([str(job), "tune.validate_steps=0", "--output", "tuned.yaml", "-q"]) == 0  # target: this CPU
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("tune")
    (tune,) = client.search_runs([experiment.experiment_id])
    assert re.fullmatch(r"tune-hot-\d{8}-\d{6}", tune.info.run_name), tune.info.run_name
    assert tune.data.params["tune.target"] == tune.data.tags["tune.target"] == "cpu"
    assert tune.data.tags["tune.output"] == str(Path("tuned.yaml").resolve())
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"

    written = Path("tuned.yaml").read_text()
    assert written.startswith("# Written by `ampflow tune")
    assert yaml.safe_load(written)["tracking"]["tags"] == {"tune_run_id": tune.info.run_id}
    logged = Path(client.download_artifacts(tune.info.run_id, "tune/policy.yaml")).read_text()
    assert logged == written

    # A run of the tuned job, as submit creates it (its policy given rules by hand: a CPU target lowers none).
    cfg = load_job("tuned.yaml", ["precision.rules=[{match: conv1, dtype: bfloat16}, {match: head, dtype: bfloat16}]",
                                  "precision.master_weights=true"])
    tracker = _start_run(cfg, Path("tuned.yaml"), uri, "tuned-run")
    tags = client.get_run(tracker.run_id).data.tags
    assert tags["tune_run_id"] == tune.info.run_id
    assert (tags["preset"], tags["precision_rules"], tags["master_weights"]) == \
        ("custom", "conv1=bfloat16, head=bfloat16", "true")


def row(layer, dtype, output_error, grad_error, cost, allowed=True, chosen=False):
    return {"layer": layer, "dtype": dtype, "output_error": output_error, "grad_error": grad_error, "cost_s": cost,
            "allowed": allowed, "chosen": chosen}


def bars(figure):
    """The bars drawn, by (layer, dtype, column): their heights."""
    return {tuple(patch.get_gid().split("|")): patch for axis in figure.axes for patch in axis.patches
            if patch.get_gid()}


def test_the_sensitivity_chart_draws_no_bar_for_a_dtype_never_measured_and_explains_the_chosen_cell():
    table = [row("conv1", "float32", 0.0, 0.0, 2.0, chosen=True),
             row("conv1", "bfloat16", 4e-3, 6e-3, 1.0),
             row("conv1", "float8", math.nan, math.nan, math.inf, allowed=False),  # float8 off a Linear layer
             row("fc", "float32", 0.0, 0.0, 4.0, chosen=True),
             row("fc", "bfloat16", 2.5e-3, 0.056, 1.0),  # small output error, but its gradients go over
             row("fc", "float8", 1e-2, 2e-2, 0.5, allowed=True),
             row("head", "float32", 0.0, 0.0, 1.0),
             row("head", "bfloat16", 1e-3, 1e-3, 0.5, chosen=True),
             row("head", "float8", None, None, None, allowed=False)]  # as sensitivity.json holds it
    figure = chart(table, tolerance=0.05)
    drawn = bars(figure)
    assert ("conv1", "float8", "output_error") not in drawn and ("head", "float8", "grad_error") not in drawn
    assert ("conv1", "float8", "cost_s") not in drawn and ("head", "float8", "cost_s") not in drawn
    assert ("conv1", "float32", "output_error") not in drawn  # fp32's errors are 0 by definition
    # The gradient error beside the output error: fc's bf16 cell is explained by its gradients, over the tolerance.
    assert drawn[("fc", "bfloat16", "output_error")].get_height() == 2.5e-3
    assert drawn[("fc", "bfloat16", "grad_error")].get_height() == 0.056
    assert [line.get_ydata()[0] for line in figure.axes[1].lines] == [0.05]
    # The time relative to the layer's fp32 time; the chosen cell outlined in every panel.
    assert drawn[("fc", "bfloat16", "cost_s")].get_height() == 0.25
    assert drawn[("fc", "float32", "cost_s")].get_height() == 1.0
    chosen = {key for key, patch in drawn.items() if patch.get_linewidth() == 2}
    assert {("head", "bfloat16", c) for c in ("output_error", "grad_error", "cost_s")} <= chosen
    assert ("fc", "float32", "cost_s") in chosen and ("fc", "bfloat16", "grad_error") not in chosen
    assert [axis.get_ylabel() for axis in figure.axes] == ["output error", "gradient error", "time vs fp32"]
