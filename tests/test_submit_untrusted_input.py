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
    # A known deserialiser of an installed package, given a pickle that would create the marker when loaded.
    "numpy_load_allow_pickle": (small_job(model={"name": "numpy:load",
                                                 "kwargs": {"file": "jobs/payload.npy", "allow_pickle": True}}), [],
                                "model.name: 'numpy:load' is refused"),
    "data_joblib_load": (small_job(data={"name": "joblib:load", "kwargs": {"filename": "jobs/payload.pkl"}}), [],
                         "data.name: 'joblib:load' is refused"),
    "loss_torch_load": (small_job(task={"loss": "torch:load"}), [], "task.loss: 'torch:load' is refused"),
    "metric_pandas_read_pickle": (small_job(task={"metrics": ["pandas:read_pickle"]}), [],
                                  "task.metrics[0].name: 'pandas:read_pickle' is refused"),
    "num_classes_negative": (small_job(), ["model.num_classes=-1"], "model.num_classes: must be >= 1"),
    "run_name_escapes_storage": (small_job(), ["run.name=../../ESCAPED"], "run.name: '../../ESCAPED'"),
    "run_name_hidden": (small_job(), ["run.name=.hidden"], "run.name: '.hidden'"),
    "run_name_slash": (small_job(run={"name": "a/b"}), [], "letters, digits, '.', '_' and '-'"),
    "model_kwargs_raise_value_error": (small_job(model={"kwargs": {"width": -3}}), [], "model.kwargs"),
    "job_file_is_a_directory": ("DIRECTORY", [], "is a directory"),
}


class _CreatesTheMarker:
    def __reduce__(self):  # unpickling calls open(MARKER, "w") in the working directory
        return open, (MARKER, "w")


def _write_pickles(directory):
    import joblib
    import numpy as np

    np.save(directory / "payload.npy", np.array([_CreatesTheMarker()], dtype=object), allow_pickle=True)
    joblib.dump(_CreatesTheMarker(), directory / "payload.pkl")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("untrusted-input")
    (workdir / "jobs").mkdir()
    _write_pickles(workdir / "jobs")
    argvs = {}
    for name, (job, overrides, _) in CASES.items():
        path = workdir / "jobs" / f"{name}.yaml"
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
