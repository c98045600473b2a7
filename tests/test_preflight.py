"""One pre-flight for `submit` and `sweep`: the same bad input is refused the same way by both (exit 2,
the same message, no Ray, no MLflow run, nothing in storage), and what it hands on to the run is right.
"""

import pytest
import yaml

from conftest import run_mains, small_job
from orchestrator.config import load_job
from orchestrator.errors import BadInput
from orchestrator.runner import records
from orchestrator.runner.preflight import RunChoice, preflight

# name: (overrides for both commands, what the one error line must say)
CASES = {
    "lint_error": (["precision.lint=error"], "preset O3: precision lint found"),
    "callback_without_hooks": (["callbacks=[omegaconf:OmegaConf]"],
                               "callbacks[0].name: omegaconf:OmegaConf has none of the training loop's hook methods"),
    "capacity_shortfall": (["scaling.resources_per_worker.CPU=4096"], "8192 CPU (2 workers x 4096)"),
    "run_name_taken": (["run.name=taken"], "already exists in"),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Each case through `submit.main` (preset O3) and `sweep.main` (--presets O0,O3), as the CLI calls them."""
    storage = tmp_path_factory.mktemp("storage")
    for taken in ("taken", "taken-sweep-O0"):  # submit's run name, and the sweep's first child's
        records.write_record(str(storage), taken, status="FINISHED")
    results = {}
    for module, extra in (("orchestrator.cli.submit", ["precision.preset=O3"]),
                          ("orchestrator.cli.sweep", ["--presets", "O0,O3"])):
        workdir = tmp_path_factory.mktemp(module.rpartition(".")[2])
        job = workdir / "jobs" / "job.yaml"
        job.parent.mkdir()
        job.write_text(yaml.safe_dump(small_job(checkpoint={"storage_path": str(storage)})))
        argvs = {name: [str(job), *extra, *overrides] for name, (overrides, _) in CASES.items()}
        for name, result in run_mains(module, argvs, workdir).items():
            results[module.rpartition(".")[2], name] = result
    return results


@pytest.mark.parametrize("command", ["submit", "sweep"])
@pytest.mark.parametrize("name", CASES)
def test_submit_and_sweep_refuse_the_same_bad_input_before_anything_starts(outcomes, command, name):
    result = outcomes[command, name]
    assert result["rc"] == 2, result["stderr"]
    errors = [line for line in result["stderr"].splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result["stderr"]
    assert CASES[name][1] in result["stderr"]
    assert not result["ray"], "Ray must not be started for bad input"
    assert result["files"] == ["jobs"], "no mlflow.db (no MLflow run) and no ray_results may be left behind"


def test_a_sweep_lints_every_preset_and_names_the_one_it_warns_about(write_job, tmp_path, capsys):
    job = write_job(small_job(checkpoint={"storage_path": str(tmp_path / "runs")}))
    configs = [load_job(job, [f"precision.preset={preset}", "precision.lint=warn", f"run.name=s-{preset}"])
               for preset in ("O0", "O3", "O2")]
    checked = preflight(configs, job, address=None)
    err = capsys.readouterr().err
    assert "warning: preset O3: precision lint" in err and "preset O0" not in err
    assert [run.name for run in checked.runs] == ["s-O0", "s-O3", "s-O2"]
    assert not any(run.resume for run in checked.runs)
    assert sum(p.numel() for p in checked.model.parameters()) > 0  # the job's model, built on the CPU


def test_a_job_for_a_job_server_leaves_data_capacity_and_storage_to_the_cluster(write_job, tmp_path):
    # Data that is not here, more CPUs than this machine has, a run name taken in local storage: all the
    # cluster's to judge. The model and the lint are still checked here.
    storage = tmp_path / "runs"
    records.write_record(str(storage), "taken", status="FINISHED")
    job = write_job(small_job(data={"name": "cifar10", "download": False, "root": str(tmp_path / "no-cifar")},
                              scaling={"resources_per_worker": {"CPU": 4096}}, run={"name": "taken"},
                              checkpoint={"storage_path": str(storage)}))
    cfg = load_job(job)
    assert preflight([cfg], job, "http://127.0.0.1:8265").runs == []
    with pytest.raises(BadInput, match="cifar-10-batches-py"):
        preflight([cfg], job, None)
    with pytest.raises(BadInput, match="vgg99"):
        preflight([load_job(job, ["model.name=vgg99"])], job, "http://127.0.0.1:8265")


def test_resume_chooses_the_newest_interrupted_run_of_the_job_and_its_mlflow_run(write_job, tmp_path):
    storage = str(tmp_path / "runs")
    job = write_job(small_job(checkpoint={"storage_path": storage}))
    cfg = load_job(job)
    with pytest.raises(BadInput, match="--resume: no interrupted run"):
        preflight([cfg], job, None, resume=True)
    records.write_record(storage, "old", job_file=str(job.resolve()), run_id="a" * 32, status="KILLED")
    records.write_record(storage, "done", job_file=str(job.resolve()), run_id="b" * 32, status="FINISHED")
    assert preflight([cfg], job, None, resume=True).runs == [RunChoice("old", resume=True, mlflow_run_id="a" * 32)]
    new = preflight([cfg], job, None).runs[0]
    assert new.name.startswith("job-") and not new.resume  # no run.name: the job file's stem and the time
