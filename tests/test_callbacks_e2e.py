"""The job's own callbacks through submit (2 Ray workers, real MLflow): what they add to the reports reaches the
MLflow run as metrics, tags and artifacts; a rank-0-only callback runs on rank 0 alone; and one that raises ends
the run promptly, FAILED, naming it and its line, while the other rank waits in a collective."""

import json
import shutil
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, small_job
from test_submit_e2e import only_run

pytestmark = pytest.mark.slow


class RankZeroNotes:
    """Rank 0 alone: leaves a file naming the rank it ran on, and reports a metric, a tag and a table."""

    rank_zero_only = True

    def __init__(self, directory: str):
        self.directory, self.steps = Path(directory), []

    def setup(self, loop):
        (self.directory / f"ran_on_rank_{loop.rank}").touch()

    def after_step(self, loop, step):
        self.steps.append(step.number)

    def collect(self, loop, report):
        report.metrics["notes/steps_seen"] = float(len(self.steps))
        report.tags["notes.world_size"] = str(loop.world_size)
        report.tables["notes/steps"] = {"steps": self.steps}


def test_what_callbacks_add_reaches_mlflow_and_the_weight_average_example_runs(ray_session, tmp_path, monkeypatch):
    """examples/callbacks (an average of the weights, on every rank, with a collective) beside a rank-0-only
    callback of the test's."""
    from orchestrator.cli.submit import main

    example = tmp_path / "callbacks"
    shutil.copytree(REPO / "examples" / "callbacks", example)
    monkeypatch.chdir(example)  # as a user runs it: from the example's directory
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = yaml.safe_load((example / "job.yaml").read_text())
    job["callbacks"].append({"name": "test_callbacks_e2e:RankZeroNotes", "kwargs": {"directory": str(tmp_path)}})
    job["run"].update(epochs=1, max_steps_per_epoch=4)
    job["tracking"].update(uri=uri, log_every_n_steps=2)
    (example / "job.yaml").write_text(yaml.safe_dump(job))
    assert main(["job.yaml"]) == 0

    client, run = only_run(uri, "callbacks")
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "notes/steps_seen")}
    assert history == {2: 2.0, 4: 4.0}
    assert run.data.tags["notes.world_size"] == "2"
    steps = json.loads(Path(client.download_artifacts(run.info.run_id, "notes/steps.json")).read_text())
    assert steps == {"steps": [1, 2, 3, 4]}
    assert sorted(p.name for p in tmp_path.glob("ran_on_rank_*")) == ["ran_on_rank_0"]

    metrics = run.data.metrics
    assert {"ema/eval/loss", "ema/eval/accuracy", "eval/loss", "eval/accuracy"} <= set(metrics)
    assert metrics["ema/eval/loss"] != metrics["eval/loss"]


class Crash:
    """Rank 0 alone raises after step 2 (noting when); rank 1 goes on into step 3 and waits there for rank 0."""

    rank_zero_only = True

    def __init__(self, marker: str):
        self.marker = Path(marker)

    def after_step(self, loop, step):
        if step.number == 2:
            self.marker.write_text(str(time.time()))
            raise KeyError("no such layer: 'head'")


def test_a_rank_zero_callback_that_raises_ends_the_run_promptly_failed_naming_it(
        ray_session, tmp_path, write_job, mlflow_uri, monkeypatch, capsys):
    from orchestrator.cli.submit import main

    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "raised_at"
    job = write_job(small_job(run={"max_steps_per_epoch": 8},
                              tracking={"uri": mlflow_uri, "experiment": "crash", "log_every_n_steps": 4},
                              checkpoint={"storage_path": str(tmp_path / "ray_results")},
                              callbacks=[{"name": "test_callbacks_e2e:Crash", "kwargs": {"marker": str(marker)}}]))
    assert main([str(job)]) == 1
    ended = time.time() - float(marker.read_text())
    err = capsys.readouterr().err

    client, run = only_run(mlflow_uri, "crash")
    assert run.info.status == "FAILED"
    assert ("training failed: worker rank 0 raised CallbackFailed: callback callbacks[0] test_callbacks_e2e:Crash "
            "raised in after_step: KeyError: \"no such layer: 'head'\" (at ") in err
    raise_line = next(n for n, line in enumerate(Path(__file__).read_text().splitlines(), 1)
                      if "raise KeyError" in line)
    assert f"{__file__}:{raise_line}" in err
    # Ray Train sees rank 0 fail at its next health check (every 0.5 s here, 2 s by default) and stops rank 1
    # where it waits; what remains is closing the MLflow run and Ray's shutdown.
    assert ended < 30, f"the run took {ended:.0f}s to end after the callback raised"
