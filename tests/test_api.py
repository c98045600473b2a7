"""`from orchestrator import run`: bad input raises the CLI's clear errors as exceptions (no exit, nothing
started), for a job given as a path, a dict or a DictConfig."""

import pytest
from omegaconf import OmegaConf

from conftest import small_job
from orchestrator.errors import BadInput


def test_run_is_the_python_api_not_the_runner_package():
    from orchestrator import run

    assert callable(run)
    import orchestrator.runner.driver  # noqa: F401  (importing the package beside it changes nothing)
    from orchestrator import run as again

    assert again is run


@pytest.mark.parametrize("form", ["path", "dict", "DictConfig"])
def test_bad_input_raises_badinput_naming_the_key_and_starts_nothing(form, write_job, tmp_path, monkeypatch):
    from orchestrator import run

    monkeypatch.chdir(tmp_path)
    job = small_job(run={"epoch": 2})  # a typo: run.epochs
    given = {"path": lambda: write_job(job), "dict": lambda: job, "DictConfig": lambda: OmegaConf.create(job)}[form]()
    with pytest.raises(BadInput, match="run.epochs"):
        run(given)
    with pytest.raises(BadInput, match="optim.lr"):
        run(small_job() if form != "path" else write_job(small_job(), "ok.yaml"), ["optim.lr=nan"])
    assert sorted(p.name for p in tmp_path.iterdir()) == (["job.yaml", "ok.yaml"] if form == "path" else [])


def test_a_job_server_address_is_for_the_cli():
    from orchestrator import run

    with pytest.raises(BadInput, match="job server"):
        run(small_job(), address="http://127.0.0.1:8265")
