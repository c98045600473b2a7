"""`predict` and `export` held to submit's standard: a user's mistake (inputs the logged model does not take, a file
that holds nothing, an output that cannot be written, a GPU that is not there, a run ampflow did not make or that
has no model) ends the command with exit 2 and one line saying what was expected, before the model runs, never a
traceback; a dataset is batched as the run batched its data (`data.collate`)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, run_mains, small_job
from test_predict import logged_tagger
from orchestrator.errors import BadInput

IMAGES = "float32 [N, 3, 32, 32]"
"""What the trained simple_cnn takes, as its logged signature says it."""


def command(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m orchestrator.<name> ARGS`, as a user runs it."""
    return subprocess.run([sys.executable, "-m", f"orchestrator.{name}", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})


def refused(out: subprocess.CompletedProcess, *says: str) -> str:
    """Assert exit 2 with one line, `error: ...`, holding each of `says`; returns the line."""
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in out.stderr, out.stderr
    for text in says:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def trained(ray_session, tmp_path_factory, _mlflow_template):
    """One run of a small digits job trained through submit, its model logged as every run logs it (the signature
    from its first training batch). Returns (directory, tracking URI, run id)."""
    import yaml
    from mlflow import MlflowClient

    from orchestrator.cli.submit import main

    directory = tmp_path_factory.mktemp("hostile-predict")
    shutil.copyfile(_mlflow_template, directory / "mlflow.db")
    uri = f"sqlite:///{directory / 'mlflow.db'}"
    job = directory / "job.yaml"
    job.write_text(yaml.safe_dump(small_job(
        precision={"preset": "O0"}, scaling={"num_workers": 1}, run={"name": "hostile", "max_steps_per_epoch": 2},
        tracking={"uri": uri, "experiment": "hostile", "log_model": True},
        checkpoint={"storage_path": str(directory / "ray_results")})))
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(directory)
        assert main([str(job)]) == 0
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("hostile").experiment_id])
    return directory, uri, run.info.run_id


CASES = {
    "dict_key": ("dict.pt", []), "int64": ("int64.pt", []), "float64": ("float64.npy", []),
    "shape": ("shape.pt", []), "dims": ("dims.pt", []), "empty": ("empty.pt", []),
    "proc": ("rows.pt", ["--output", "/proc/predictions.pt"]), "missing_dir": ("rows.pt", ["--output", "missing/o.pt"]),
    "file_as_dir": ("rows.pt", ["--output", "a_file/o.pt"]), "cuda": ("rows.pt", ["--device", "cuda"]),
    "rows": ("rows.pt", []), "named": ("named.pt", []),
}
"""Each `ampflow predict` of the trained run: its --data file, and other arguments (default --output out_<case>.pt)."""


@pytest.fixture(scope="module")
def predicted(trained, tmp_path_factory):
    """Every case of `CASES` through the command's `main`, in one fresh interpreter in a directory of its own (its
    start-up is the slow part): {case: its exit code, stderr and the files left}. A traceback fails the fixture."""
    directory, uri, run_id = trained
    work = tmp_path_factory.mktemp("predict-cases")
    rows = torch.rand(4, 3, 32, 32)
    torch.save({"pixels": rows}, work / "dict.pt")
    torch.save((rows * 255).long(), work / "int64.pt")
    np.save(work / "float64.npy", rows.double().numpy())
    torch.save(rows[:, :, :16, :16].contiguous(), work / "shape.pt")
    torch.save(rows[:, 0], work / "dims.pt")
    (work / "empty.pt").write_bytes(b"")
    (work / "a_file").write_text("")
    torch.save(rows, work / "rows.pt")
    torch.save({"x": rows}, work / "named.pt")
    argvs = {}
    for case, (data, extra) in CASES.items():
        output = [] if "--output" in extra else ["--output", f"out_{case}.pt"]
        argvs[case] = [run_id, "--data", data, *output, *extra, "--tracking-uri", uri]
    return work, run_mains("orchestrator.cli.predict", argvs, work)


def one_line(result: dict, *says: str) -> str:
    """Assert a `run_mains` case exited 2 with one line, `error: ...`, holding each of `says`; returns the line."""
    lines = result["stderr"].strip().splitlines()
    assert result["rc"] == 2 and len(lines) == 1 and lines[0].startswith("error: "), result
    for text in says:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.mark.slow
def test_inputs_the_logged_model_does_not_take_are_refused_in_one_line_before_it_runs(predicted):
    """A dict with a key the model has no input of, int64, float64 (.npy), a wrong size and a wrong number of dims,
    where the model takes one float32 `[N, 3, 32, 32]` tensor named `x` (its forward's parameter): each is said
    against the signature the run logged, and nothing is written; float32 rows of that shape, or a dict of them
    under `x`, predict."""
    _, results = predicted
    expected = f"the model takes one tensor, x {IMAGES}"
    one_line(results["dict_key"], expected, "'pixels', which it does not take")
    one_line(results["int64"], expected, "int64 [4, 3, 32, 32], not float32", ".to(torch.float32)")
    one_line(results["float64"], expected, "float64 [4, 3, 32, 32], not float32", "astype('float32')")
    one_line(results["shape"], expected, "float32 [4, 3, 16, 16] (dim 2 is 16, not 32)")
    one_line(results["dims"], expected, "float32 [4, 32, 32] (3 dims, not 4)")
    for case in ("dict_key", "int64", "float64", "shape", "dims"):
        assert f"out_{case}.pt" not in results[case]["files"]
    for case in ("rows", "named"):
        assert results[case]["rc"] == 0 and f"out_{case}.pt" in results[case]["files"], results[case]


@pytest.mark.slow
def test_an_empty_file_an_unwritable_output_and_a_missing_gpu_are_refused_before_the_model_runs(predicted):
    work, results = predicted
    one_line(results["empty"], "--data: empty.pt is empty (0 bytes)", "a tensor or a dict of tensors")
    one_line(results["proc"], "--output /proc/predictions.pt: cannot write in the directory /proc")
    one_line(results["missing_dir"], "--output missing/o.pt: the directory missing does not exist")
    one_line(results["file_as_dir"], "--output a_file/o.pt: the directory a_file is not a directory")
    assert not (work / "missing").exists() and not any(name.startswith(".ampflow") for name in os.listdir(work))
    if not torch.cuda.is_available():
        one_line(results["cuda"], "--device cuda: this machine has no GPU")
        assert "out_cuda.pt" not in results["cuda"]["files"]


@pytest.mark.slow
def test_the_command_itself_exits_2_with_one_line(trained, predicted):
    """`python -m orchestrator.predict` as a user runs it: exit 2 and the one line, no traceback.

    Long: under load, a fresh interpreter importing torch and MLflow and loading the model takes a minute."""
    directory, uri, run_id = trained
    work, _ = predicted
    out = command("predict", run_id, "--data", "int64.pt", "--output", "out.pt", "--tracking-uri", uri, cwd=work)
    refused(out, f"the model takes one tensor, x {IMAGES}; the data is int64")


@pytest.mark.slow
def test_the_python_call_refuses_the_same_inputs(trained):
    """`orchestrator.predict(run_id, batch)` says the same (BadInput), for a batch and for a dataset's batches."""
    from torch.utils.data import TensorDataset

    from orchestrator import predict
    from orchestrator.errors import BadInput

    directory, uri, run_id = trained
    with pytest.raises(BadInput, match=r"takes one tensor, x float32 \[N, 3, 32, 32\]; the data is float64"):
        predict(run_id, torch.rand(2, 3, 32, 32, dtype=torch.float64), tracking_uri=uri)
    with pytest.raises(BadInput, match=r"the data is int64 \[3, 3, 32, 32\], not float32"):
        predict(run_id, TensorDataset(torch.zeros(5, 3, 32, 32, dtype=torch.long)), batch_size=3, tracking_uri=uri)
    with pytest.raises(BadInput, match="--device cuda:7: this machine has"):
        predict(run_id, torch.rand(2, 3, 32, 32), device="cuda:7", tracking_uri=uri)
    assert predict(run_id, TensorDataset(torch.rand(5, 3, 32, 32)), batch_size=3, tracking_uri=uri).shape == (5, 10)


def test_a_dataset_is_batched_with_the_runs_collate(tmp_path, monkeypatch, new_store, write_job):
    """Variable-length text: `orchestrator.predict(run_id, dataset)` pads it with the run's `data.collate`, as
    `orchestrator.predict(run_id, "eval")` does, and gives the same outputs for the same samples (torch's default
    collate ended in `stack expects each tensor to be equal size`)."""
    from orchestrator import predict

    uri, run_id, _, eval_set, _, _ = logged_tagger(tmp_path, monkeypatch, new_store, write_job)
    expected = predict(run_id, "eval", batch_size=6, tracking_uri=uri)
    assert torch.equal(predict(run_id, eval_set, batch_size=6, tracking_uri=uri), expected)


@pytest.fixture
def runs(mlflow_uri):
    """A bare MLflow run (no job: not made by ampflow) and ampflow runs without a model, by how they ended."""
    import mlflow

    from orchestrator.config import flatten, load_job, to_yaml
    from orchestrator.tracking.tracker import RunTracker

    made = {}
    for name, overrides, status in (("failed", [], "FAILED"), ("killed", [], "KILLED"), ("running", [], None),
                                    ("no_log_model", ["tracking.log_model=false"], "FINISHED")):
        cfg = load_job(REPO / "jobs" / "quickstart.yaml", [*overrides, f"tracking.uri={mlflow_uri}"])
        tracker = RunTracker.start(mlflow_uri, cfg, run_name=name, tags={}, params=flatten(cfg),
                                   config_yaml=to_yaml(cfg))
        if status is not None:
            tracker.finish(status)
        made[name] = tracker.run_id
    mlflow.set_tracking_uri(mlflow_uri)
    with mlflow.start_run() as bare:
        mlflow.log_param("lr", 0.1)
    made["bare"] = bare.info.run_id
    return made


def test_a_run_ampflow_did_not_make_is_refused_by_export_and_predict(runs, mlflow_uri, tmp_path, capsys):
    """A bare MLflow run (no `config/job.yaml`): export and predict say it is not an ampflow run, in one line.

    Long: under load, `python -m orchestrator.export` as a command of its own (importing torch and MLflow) takes
    up to a minute."""
    from orchestrator.cli.predict import main

    bare = runs["bare"]
    refused(command("export", bare, "--dtype", "float16", "--tracking-uri", mlflow_uri, cwd=tmp_path),
            f"run {bare} is not an ampflow run", "config/job.yaml")
    assert main([bare, "--output", str(tmp_path / "out.pt"), "--tracking-uri", mlflow_uri]) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"error: run {bare} is not an ampflow run") and said.count("\n") == 1, said


def test_a_run_without_a_model_says_why_by_how_it_ended(runs, mlflow_uri, tmp_path, capsys):
    """A FAILED, KILLED or RUNNING run has no model for that reason (tracking.log_model is not the question); only
    a FINISHED one that trained with tracking.log_model false is told so. Through each command's `main`."""
    from orchestrator.cli import export, predict

    def err(main, *args: str) -> str:
        assert main([*args, "--tracking-uri", mlflow_uri]) == 2
        said = capsys.readouterr().err
        assert said.startswith("error: ") and said.count("\n") == 1, said
        return said

    for name, says in (("failed", "FAILED, so it has no model"), ("killed", "was KILLED, so it has no model"),
                       ("running", "is still RUNNING, so it has no model"),
                       ("no_log_model", "has no model: it trained with tracking.log_model: false")):
        for said in (err(export.main, runs[name], "--dtype", "float16"),
                     err(predict.main, runs[name], "--output", str(tmp_path / "out.pt"))):
            assert said.startswith(f"error: run {runs[name]} {says}"), said
            assert ("log_model" in said) == (name == "no_log_model"), said
    assert "--resume" in err(export.main, runs["failed"], "--dtype", "float16")


@pytest.mark.parametrize("output, says", [
    ("/proc/predictions.pt", "--output /proc/predictions.pt: cannot write in the directory /proc"),
    ("missing/o.pt", "--output missing/o.pt: the directory missing does not exist"),
    ("a_file/o.pt", "--output a_file/o.pt: the directory a_file is not a directory"),
    (".", "--output .: is a directory; give the file to write, e.g. --output predictions.pt"),
])
def test_an_output_that_cannot_be_written_is_refused_before_any_work_naming_why(output, says, tmp_path, monkeypatch):
    """The check predict and tune make of `--output` before they load or tune anything."""
    from orchestrator.cli.program import check_output_file

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(BadInput) as refused:
        check_output_file(Path(output), "predictions.pt")
    assert str(refused.value).startswith(says)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # the probe left nothing behind
