"""`from orchestrator import run`: bad input raises the CLI's clear errors as exceptions (no exit, nothing
started), for a job given as a path, a dict or a DictConfig; a DictConfig runs as its dict would."""

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


def test_a_dictconfig_job_is_planned_and_run_as_the_same_dict(tmp_path, monkeypatch):
    """A DictConfig (interpolations left for the job loader) reaches the driver as the job its dict would make;
    the run's result is what `run()` returns and its temporary job file is gone afterwards. The driver itself is
    faked: `test_own_code_e2e` trains a dict job through it."""
    from types import SimpleNamespace

    from orchestrator import run
    from orchestrator.runner import driver

    monkeypatch.chdir(tmp_path)
    planned = []

    def plan(cfg, job_path, address, choice):
        planned.append(SimpleNamespace(cfg=cfg, job_file=job_path.read_text(), job_path=job_path, result=None))
        return planned[-1]

    def execute(plan):
        plan.result = "the run's result"
        return 0

    monkeypatch.setattr(driver, "plan_run_as_ray_starts", plan)
    monkeypatch.setattr(driver, "execute", execute)
    job = small_job(run={"epochs": 3, "name": "api-${run.epochs}"})
    assert run(OmegaConf.create(job)) == "the run's result"
    assert run(job) == "the run's result"
    from_config, from_dict = planned
    assert from_config.cfg == from_dict.cfg and from_config.cfg.run.name == "api-3"
    assert "${run.epochs}" in from_config.job_file  # interpolations resolved by the loader, not before
    assert not from_config.job_path.exists() and not from_dict.job_path.exists()
