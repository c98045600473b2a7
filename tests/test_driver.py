"""The driver closes the MLflow run it created whatever fails after it (here: Ray cannot be reached)."""

from mlflow import MlflowClient

from orchestrator.run import driver
from orchestrator.run.preflight import RunChoice
from orchestrator.config import load_job

from conftest import small_job


def test_ray_unreachable_closes_the_run_failed_and_says_what_to_do(write_job, tmp_path, monkeypatch, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = write_job(small_job(tracking={"uri": uri, "experiment": "unreachable"},
                              checkpoint={"storage_path": str(tmp_path / "ray_results")}))
    plan = driver.plan_run(load_job(job), job, "10.255.255.1:6379", RunChoice("unreachable"))

    def no_cluster(address, module_source):
        raise ConnectionError(f"could not connect to {address}")

    monkeypatch.setattr(driver, "init_ray", no_cluster)
    assert driver.execute(plan) == driver.EXIT_FAILED
    run = MlflowClient(tracking_uri=uri).get_run(plan.tracker.run_id)
    assert run.info.status == "FAILED"
    err = capsys.readouterr().err
    assert "10.255.255.1:6379" in err and "--address" in err
