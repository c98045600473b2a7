"""A run whose records MLflow did not take is never a success, through submit (2 Ray workers, a real SQLite
MLflow store): exit 1 with one line saying what is missing, where the run's data is and how to recover; the run
not FINISHED; MLflow's repeated tracebacks summarised, one line per kind with a count."""

import os
import subprocess

import pytest

from conftest import drill, small_job
from drills import make_read_only
from test_submit_e2e import only_run

pytestmark = pytest.mark.slow


def submit(tmp_path, monkeypatch, write_job, uri, experiment, *args, **sections) -> int:
    from orchestrator.cli.submit import main

    monkeypatch.chdir(tmp_path)
    sections["tracking"] = {"uri": uri, "experiment": experiment, "log_every_n_steps": 1, "flush_timeout_s": 4,
                            **sections.get("tracking", {})}
    job = write_job(small_job(precision={"preset": "O0"}, **sections), f"{experiment}.yaml")
    return main([str(job), *args])


def read_only_possible(directory) -> bool:
    """Whether this machine lets a test make a file read-only for the process itself (root: `chattr +i`)."""
    probe = directory / "probe"
    probe.write_text("")
    try:
        make_read_only([str(probe)], True)
        try:
            probe.open("a").close()
            return False
        except OSError:
            return True
    except (OSError, subprocess.CalledProcessError):
        return False
    finally:
        try:
            make_read_only([str(probe)], False)
        except (OSError, subprocess.CalledProcessError):
            pass


def test_a_store_made_read_only_mid_run_is_exit_1_the_run_not_finished_and_resume_logs_what_it_lacked(
        ray_session, tmp_path, monkeypatch, write_job, capsys):
    """A store made read-only mid-run: exit 1, the run never FINISHED, and `--resume` logs what it lacked.

    Long: two runs through submit, the failing one and its resume."""
    store = tmp_path / "store"
    store.mkdir()
    if not read_only_possible(store):
        pytest.skip("files cannot be made read-only here (root without chattr)")
    db = store / "mlflow.db"
    uri = f"sqlite:///{db}"
    job = dict(run={"max_steps_per_epoch": 8}, callbacks=[drill("ReadOnlyPath", paths=[str(db), str(store)],
                                                                   at_step=3)])
    try:
        rc = submit(tmp_path, monkeypatch, write_job, uri, "readonly", **job)
        err = capsys.readouterr().err
    finally:
        make_read_only([str(db), str(store)], False)
    assert rc == 1, err
    assert "Traceback" not in err  # MLflow logs one per refused write
    refused = [line for line in err.splitlines() if line.startswith("MLflow refused ")]
    assert refused and all(" write(s): " in line and "(first at step " in line for line in refused), err
    assert int(refused[0].split()[2]) > 3  # every refused write counted, shown once
    (cause,) = [line for line in err.splitlines() if line.startswith("error: run readonly-")]
    assert "trained to the end, but MLflow did not record" in cause and "metric values" in cause
    assert "left RUNNING (its store refuses writes)" in cause and "the replay outbox" in cause
    (run_dir,) = tmp_path.glob("ray_results/readonly-*")
    assert str(run_dir) in cause and "--resume" in cause
    assert "Run finished" not in capsys.readouterr().out + err

    # The store never took a write again: its record still says RUNNING, and the console said it could not be
    # changed. The run record in storage says FAILED, so `--resume` finds the run: it logs what MLflow lacked.
    client, run = only_run(uri, "readonly")
    assert run.info.status == "RUNNING"
    assert "could not be marked FAILED and still shows RUNNING" in err
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) < 8
    assert submit(tmp_path, monkeypatch, write_job, uri, "readonly", "--resume", **job | {"callbacks": []}) == 0
    _, run = only_run(uri, "readonly")
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == list(range(1, 9))


def test_the_artifact_directory_deleted_mid_run_is_exit_1_the_run_failed_and_tagged_naming_the_checkpoint(new_store, 
        ray_session, tmp_path, monkeypatch, write_job, capsys):
    uri = new_store(tmp_path)
    artifacts = tmp_path / "mlruns"  # the local artifact root of a SQLite store opened in tmp_path
    rc = submit(tmp_path, monkeypatch, write_job, uri, "noartifacts",
                callbacks=[drill("RemovePath", path=str(artifacts), at_step=2)])
    err = capsys.readouterr().err
    assert rc == 1, err
    _, run = only_run(uri, "noartifacts")
    assert run.info.status == "FAILED"
    why = run.data.tags["tracking_incomplete"]
    assert "gone from its artifact store" in why and "config/job.yaml" in why
    (cause,) = [line for line in err.splitlines() if line.startswith("error: run noartifacts-")]
    assert "config/job.yaml" in cause and "marked FAILED (tag tracking_incomplete)" in cause
    (checkpoint,) = tmp_path.glob("ray_results/noartifacts-*/checkpoint_0*")
    assert str(checkpoint) in cause
    assert os.path.exists(checkpoint / "train_state.pt")
