"""Checkpoints in a bucket: a run whose `checkpoint.storage_path` is `s3://...`, with the endpoint and credentials
from the standard AWS variables (here a local S3 server, moto's), survives the SIGKILL of its driver: `--resume`
finds the run in the bucket and finishes the same MLflow run, every step logged once."""

import subprocess
import sys
import time

import pytest

from orchestrator.checkpoint.stored import newest

from conftest import own_ray_env, small_job
from s3_server import S3Server
from test_resume_e2e import _kill_tree_of, each_step_once
from test_submit_e2e import only_run

pytestmark = pytest.mark.slow


def _newest_complete_step(s3: S3Server) -> int:
    """The step of the newest checkpoint in the bucket that a resume would take (0 if none is complete yet): a
    checkpoint's first key appears before its last file is uploaded, and a resume rightly skips it until then."""
    run_dirs = {key.split("/")[1] for key in s3.keys("runs/") if "/checkpoint_" in key}
    steps = [stored.facts.global_step for run_name in run_dirs
             for stored in [newest(f"s3://{s3.bucket}/runs", run_name)] if stored is not None]
    return max(steps, default=0)


def test_a_driver_killed_mid_run_resumes_from_its_checkpoints_in_a_bucket_in_the_same_run(
        tmp_path, ray_tmpdir, write_job, new_store, monkeypatch):
    """The driver (and its Ray) SIGKILLed once a complete checkpoint of step 4 is in the bucket: `--resume` reads the run's
    record and checkpoints from the bucket, resumes from step 4 or later, and the run ends FINISHED with steps 1-8
    logged once; nothing is written to local disk for the run.

    Long: two submits, each starting a Ray of its own, the first killed mid-run."""
    uri = new_store(tmp_path)
    with S3Server() as s3:
        for name, value in s3.env.items():  # this process reads the bucket as the driver does
            monkeypatch.setenv(name, value)
        job = write_job(small_job(
            run={"epochs": 1, "max_steps_per_epoch": 8},
            tracking={"log_every_n_steps": 1, "uri": uri, "experiment": "bucket"},
            checkpoint={"every_n_steps": 2, "storage_path": f"s3://{s3.bucket}/runs"}))
        env = own_ray_env(ray_tmpdir, **s3.env)
        driver = subprocess.Popen([sys.executable, "-m", "orchestrator.submit", str(job)], cwd=tmp_path, env=env,
                                  start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 240
            while _newest_complete_step(s3) < 4:
                assert driver.poll() is None, "the driver ended before it could be killed"
                assert time.monotonic() < deadline, "no checkpoint of step 4 appeared in the bucket"
                time.sleep(0.2)
        finally:
            _kill_tree_of(driver, str(ray_tmpdir))
        client, run = only_run(uri, "bucket")
        assert run.info.status == "RUNNING"  # what a dead driver leaves behind

        resumed = subprocess.run([sys.executable, "-m", "orchestrator.submit", str(job), "--resume"], cwd=tmp_path,
                                 env=env, capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        assert f"Resuming {run.info.run_id}" in resumed.stderr
        keys = s3.keys("runs/")
    client, run = only_run(uri, "bucket")  # the same run, not a second one
    assert run.info.status == "FINISHED" and int(run.data.tags["resumed_from_step"]) >= 4
    assert each_step_once(client, run.info.run_id, "train/loss") == list(range(1, 9))
    assert any("/checkpoint_000000008_" in key for key in keys) and any(k.endswith("ampflow_run.json") for k in keys)
    assert not (tmp_path / "ray_results").exists()
