"""`python -m orchestrator.export RUN` loads the run's logged model without unpickling anything: files planted
beside its pt2 program (a pickled `model.pth`, a module for MLflow to import) are refused, never run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO

MARKER = "marker-created-by-a-planted-file"


class _CreatesTheMarker:
    def __reduce__(self):  # unpickling calls open(MARKER, "w") in the working directory
        return open, (MARKER, "w")


TINY_NET = """
import torch.nn as nn

class Net(nn.Sequential):
    def __init__(self, num_classes=10):
        super().__init__(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))
"""


@pytest.fixture
def logged_run(tmp_path, mlflow_uri, monkeypatch):
    """A run of the quickstart job (with a one-layer model of the user's, to be quick) with its fp32 model logged
    as ampflow logs it (a pt2 program); returns its id and the logged model's artifact directory."""
    from mlflow import MlflowClient

    from orchestrator.config import flatten, load_job, to_yaml
    from orchestrator.tracking.logged_model import ModelInputs
    from orchestrator.tracking.tracker import RunTracker
    from orchestrator.train.models import build_model

    (tmp_path / "planted_nets.py").write_text(TINY_NET)
    monkeypatch.chdir(tmp_path)
    cfg = load_job(REPO / "jobs" / "quickstart.yaml", ["precision.preset=O0", "model.name=planted_nets:Net"])
    tracker = RunTracker.start(mlflow_uri, cfg, run_name="planted", tags={}, params=flatten(cfg),
                               config_yaml=to_yaml(cfg))
    assert tracker.log_model(build_model(cfg.model).eval(), ModelInputs.from_shape((3, 32, 32))) == "pt2"
    tracker.finish("FINISHED")
    logged = MlflowClient(tracking_uri=mlflow_uri).search_logged_models([tracker.experiment_id])[0]
    return tracker.run_id, Path(logged.artifact_location.removeprefix("file://"))


def export(run_id: str, uri: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.export", run_id, "--dtype", "bfloat16",
                           "--max-accuracy-drop", "1", "--tracking-uri", uri], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_pickled_model_planted_beside_the_pt2_program_is_refused_never_unpickled(logged_run, tmp_path, mlflow_uri):
    """A pickle planted beside the logged pt2 program is refused by `orchestrator.export`, and never unpickled.

    Long: `orchestrator.export` runs twice as a command of its own (the clean program, then the planted one), each
    importing torch and MLflow and exporting in bfloat16."""
    run_id, model_dir = logged_run
    assert export(run_id, mlflow_uri, tmp_path).returncode == 0  # the pt2 program alone exports

    torch.save(_CreatesTheMarker(), model_dir / "data" / "model.pth")
    (model_dir / "data" / "pickle_module_info.txt").write_text("pickle")
    out = export(run_id, mlflow_uri, tmp_path)
    assert out.returncode == 2, out.stderr
    assert not (tmp_path / MARKER).exists(), "the planted pickle was unpickled"
    assert "model.pth" in out.stderr and "never unpickles" in out.stderr and "Traceback" not in out.stderr


def test_a_planted_code_directory_and_pickle_module_are_never_imported(logged_run, tmp_path, mlflow_uri):
    """MLflow's loader puts a model's code directory on sys.path and imports the pickle module it names before
    anything else: a module planted there would run.

    Long: `orchestrator.export` runs twice as a command of its own (the planted directory, then the program without
    it), each importing torch and MLflow and exporting in bfloat16."""
    run_id, model_dir = logged_run
    (model_dir / "code").mkdir(exist_ok=True)  # ampflow logs its pyfunc loader there
    (model_dir / "code" / "planted_module.py").write_text(f"open({MARKER!r}, 'w')\n")
    mlmodel = yaml.safe_load((model_dir / "MLmodel").read_text())
    mlmodel["flavors"]["pytorch"]["code"] = "code"
    (model_dir / "MLmodel").write_text(yaml.safe_dump(mlmodel))
    torch.save({"weight": torch.zeros(1)}, model_dir / "data" / "model.pth")
    (model_dir / "data" / "pickle_module_info.txt").write_text("planted_module")
    out = export(run_id, mlflow_uri, tmp_path)
    assert out.returncode == 2, out.stderr
    assert not (tmp_path / MARKER).exists(), "the planted module was imported"
    assert "never unpickles" in out.stderr and "Traceback" not in out.stderr

    (model_dir / "data" / "model.pth").unlink()  # the code directory alone: the pt2 program loads without it
    (model_dir / "data" / "pickle_module_info.txt").unlink()
    assert export(run_id, mlflow_uri, tmp_path).returncode == 0
    assert not (tmp_path / MARKER).exists(), "the planted module was imported"
