"""A callback of the job that raises, through submit (2 Ray workers, real MLflow): the run ends promptly, FAILED,
naming it and its line, while the other rank waits in a collective. (What callbacks add reaching MLflow, and
examples/callbacks, run in `test_logged_model_e2e.py`'s scored-checkpoint run: one submit for both.)"""

import time
from pathlib import Path

import pytest

from conftest import small_job
from test_submit_e2e import only_run

pytestmark = pytest.mark.slow


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
