"""A job file that tries to run the standard library, escape its storage, or is not a file: exit 2, nothing done.

All cases run in one fresh interpreter through `orchestrator.cli.submit.main`, exactly as the CLI calls it.
"""

import pytest
import yaml

from conftest import run_mains, small_job

MARKER = "marker-created-by-the-job-file"

CASES = {
    # An import path naming a standard-library function is refused before anything is called.
    "os_system": (small_job(model={"name": "os:system", "kwargs": {"command": f"touch {MARKER}"}}), [],
                  "model.name: 'os:system'"),
    "subprocess_run": (small_job(model={"name": "subprocess:run", "kwargs": {"args": ["touch", MARKER]}}), [],
                       "model.name: 'subprocess:run'"),
    "builtins_exec": (small_job(model={"name": "builtins:exec", "kwargs": {"source": f"open('{MARKER}', 'w')"}}), [],
                      "model.name: 'builtins:exec'"),
    # The same for the other import paths of a job: data, loss and metrics.
    "data_os_system": (small_job(data={"name": "os:system", "kwargs": {"command": f"touch {MARKER}"}}), [],
                       "data.name: 'os:system'"),
    "loss_builtins_exec": (small_job(task={"loss": "builtins:exec"}), [], "task.loss: 'builtins:exec'"),
    "metric_subprocess_run": (small_job(task={"metrics": ["accuracy", "subprocess:run"]}), [],
                              "'subprocess:run'"),
    "num_classes_negative": (small_job(), ["model.num_classes=-1"], "model.num_classes: must be >= 1"),
    "run_name_escapes_storage": (small_job(), ["run.name=../../ESCAPED"], "run.name: '../../ESCAPED'"),
    "run_name_hidden": (small_job(), ["run.name=.hidden"], "run.name: '.hidden'"),
    "run_name_slash": (small_job(run={"name": "a/b"}), [], "letters, digits, '.', '_' and '-'"),
    "model_kwargs_raise_value_error": (small_job(model={"kwargs": {"width": -3}}), [], "model.kwargs"),
    "job_file_is_a_directory": ("DIRECTORY", [], "is a directory"),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("untrusted-input")
    argvs = {}
    for name, (job, overrides, _) in CASES.items():
        path = workdir / "jobs" / f"{name}.yaml"
        path.parent.mkdir(exist_ok=True)
        if job == "DIRECTORY":
            path.mkdir()
        else:
            path.write_text(yaml.safe_dump(job))
        argvs[name] = [str(path), *overrides, f"data.root={workdir / 'data'}"]
    results = run_mains("orchestrator.cli.submit", argvs, workdir)
    results["escaped"] = sorted(p.name for p in workdir.parent.glob("ESCAPED*"))
    return results


@pytest.mark.parametrize("name", CASES)
def test_untrusted_job_file_exits_2_naming_the_key_and_does_nothing(outcomes, name):
    result = outcomes[name]
    assert result["rc"] == 2, result["stderr"]
    assert result["stderr"].startswith("error: ")
    assert "Traceback" not in result["stderr"]
    assert CASES[name][2] in result["stderr"], result["stderr"]
    assert not result["ray"], "Ray must not be started for bad input"
    assert result["files"] == ["jobs"], "no marker file, mlflow.db, ray_results, ESCAPED or data may be left behind"


def test_refusals_say_what_to_do(outcomes):
    assert outcomes["escaped"] == [], "run.name=../../ESCAPED must write nothing beside the job's directory"
    assert "standard library" in outcomes["os_system"]["stderr"]
    assert "own code" in outcomes["os_system"]["stderr"]
    assert "must not start with '.'" in outcomes["run_name_hidden"]["stderr"]
    assert "not found" not in outcomes["job_file_is_a_directory"]["stderr"]
