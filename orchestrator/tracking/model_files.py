"""A logged model loaded without unpickling anything: its pt2 program only, checked by MLflow to be pickle-free.

MLflow's own `mlflow.pytorch.load_model` prefers a `data/model.pth` to the `data/model.pt2` beside it and
unpickles it (running whatever it holds); before that it puts the model's `code/` directory first on
`sys.path` and imports the module `data/pickle_module_info.txt` names. Anyone who can write a run's
artifacts could plant those files. So the model is downloaded once, its files are checked here (a pt2
program, no pickle file), its code directory is dropped from the download (a pt2 program needs no code; the
one ampflow logs holds the pyfunc loader and the job's own modules for other loaders), and only then is it
handed to MLflow's loader with
`MLFLOW_ALLOW_PICKLE_DESERIALIZATION=false`, under which MLflow refuses a pt2 archive any of whose records
is not plain data before `torch.export.load` reads it.
"""

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import mlflow
import yaml
from mlflow.exceptions import MlflowException

from orchestrator.errors import BadInput

PICKLE_FILES = ("model.pth", "pickle_module_info.txt")
"""What MLflow's PyTorch flavour writes for a pickled model; found beside a pt2 program, it was planted."""


def load_pt2_model(model_uri: str, what: str):
    """The `torch.nn.Module` of the pt2 program logged at `model_uri` (on the CPU). BadInput, naming `what` (e.g.
    "run RUN_ID's model 'model'"), when the model is not a pickle-free pt2 program."""
    with tempfile.TemporaryDirectory(prefix="ampflow-model-") as downloaded:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=downloaded))
        _check_files(local, what)
        _drop_code(local)
        # the pyfunc's own binding of the forward's names (imported here: it imports mlflow.pytorch, over a second)
        from orchestrator.tracking.ampflow_pyfunc import accept_keywords

        try:
            with _pickle_refused():
                return accept_keywords(mlflow.pytorch.load_model(str(local)))
        except MlflowException as exc:
            raise BadInput(f"{what} was refused: {exc.message} ampflow loads models only without unpickling "
                           "them.") from None


def _check_files(local: Path, what: str) -> None:
    refuse = f"{what} cannot be loaded without unpickling it, and ampflow never unpickles a model"
    try:
        flavor = (yaml.safe_load((local / "MLmodel").read_text()) or {})["flavors"]["pytorch"]
        data = (local / flavor["model_data"]).resolve()
    except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
        raise BadInput(f"{what} is not an MLflow PyTorch model ({type(exc).__name__}: {exc}).") from None
    if not data.is_relative_to(local.resolve()):
        raise BadInput(f"{what} is not an MLflow PyTorch model: its model_data points outside it ({data}).")
    planted = [name for name in PICKLE_FILES if (data / name).exists()]
    if planted:
        raise BadInput(f"{refuse}: it holds {', '.join(planted)} (a pickled model, which MLflow would load in "
                       "preference to a pt2 program). A model ampflow logs as a pt2 program never holds one; if "
                       "the run's model was logged pickled because it did not export to pt2, set `export.dtype` "
                       "in the job to export at the end of training, from its checkpoint.")
    if not (data / "model.pt2").is_file():
        raise BadInput(f"{refuse}: it has no pt2 program ({data.name}/model.pt2).")


def _drop_code(local: Path) -> None:
    """Remove the downloaded model's code directory and the flavour's mention of it: MLflow's loader would put it
    first on sys.path, where a planted module would shadow any import."""
    mlmodel = yaml.safe_load((local / "MLmodel").read_text())
    code = mlmodel["flavors"]["pytorch"].pop("code", None)
    if code:
        shutil.rmtree(local / code, ignore_errors=True)
        (local / "MLmodel").write_text(yaml.safe_dump(mlmodel))


@contextlib.contextmanager
def _pickle_refused() -> Iterator[None]:
    """MLflow's loaders refuse pickles meanwhile; `sys.path` is as it was afterwards."""
    previous, path = os.environ.get("MLFLOW_ALLOW_PICKLE_DESERIALIZATION"), list(sys.path)
    os.environ["MLFLOW_ALLOW_PICKLE_DESERIALIZATION"] = "false"
    try:
        yield
    finally:
        sys.path[:] = path
        if previous is None:
            os.environ.pop("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", None)
        else:
            os.environ["MLFLOW_ALLOW_PICKLE_DESERIALIZATION"] = previous
