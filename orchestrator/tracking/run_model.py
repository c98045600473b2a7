"""A run's model in MLflow: logged at the end of training (`log_model`: pt2, else the pickled module, both with
ampflow's pyfunc), loaded back without unpickling (`load_model`) and registered as a version of a name
(`register_model`, `tracking.register_model`). Each takes the run's `RunTracker` (`orchestrator.tracking.tracker`),
whose `log_model` and `load_model` call these."""

import sys
import warnings
from typing import Any, Optional

import torch

from orchestrator.errors import BadInput
from orchestrator.tracking import logged_model
from orchestrator.tracking.secrets import redact, redact_all

def log_model(tracker, model, inputs, code_paths: Optional[list[str]] = None,
              name: str = "model") -> str:
    """Log the model as the run's MLflow model `name`, taking `inputs` (`logged_model.ModelInputs`: names,
    dtypes and an example from a real batch); returns the format used.

    pt2 (torch.export, loads without unpickling code) when the model exports; otherwise the
    pickled module with its custom code shipped alongside. Both with ampflow's pyfunc.
    """
    import mlflow
    import torchvision  # only for its version, in the model's requirements

    mlflow.set_tracking_uri(tracker.uri)
    requirements = [f"torch=={torch.__version__.split('+')[0]}",
                    f"torchvision=={torchvision.__version__.split('+')[0]}"]
    ended = tracker._client.get_run(tracker.run_id).info
    try:
        with warnings.catch_warnings(), mlflow.start_run(run_id=tracker.run_id):
            warnings.simplefilter("ignore")  # signature inference chatter
            model_format, tracker.logged_models[name] = logged_model.log_model(model, inputs, name, code_paths,
                                                                               requirements)
            return model_format
    finally:
        if ended.end_time:  # a finished run's export: MLflow's end_run would make now its end, not training's
            tracker._client.set_terminated(tracker.run_id, status=ended.status, end_time=ended.end_time)


def load_model(tracker):
    """The run's fp32 model (`model`) as logged at the end of training: its pt2 program, loaded without
    unpickling anything (`orchestrator.tracking.model_files`); BadInput when it has none."""
    import mlflow

    from orchestrator.tracking.model_files import load_pt2_model  # it imports MLflow at its top

    mlflow.set_tracking_uri(tracker.uri)  # `models:/` URIs resolve through the global tracking URI
    models = tracker._client.search_logged_models([tracker.experiment_id],
                                                  filter_string=f"source_run_id = '{tracker.run_id}'")
    fp32 = [m for m in models if m.name == "model"]
    if not fp32:
        raise BadInput(f"run {tracker.run_id} has no logged model 'model' (was tracking.log_model false?).")
    return load_pt2_model(fp32[0].model_uri, f"run {tracker.run_id}'s logged model 'model'")


def register_model(tracker, model_uri: str, name: str, tags: dict[str, Any]) -> Optional[str]:
    """`tracking.register_model`: the logged model (`runs:/RUN/NAME` or `models:/ID`) as a new version of `name`
    in the run's own store, tagged; its version, or None with a warning when the registry refuses (the run stands
    either way). Through a client of its own: MLflow's global tracking and registry URIs (and their environment
    variables, which subprocesses inherit) are left as they were."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        client = MlflowClient(tracking_uri=tracker.uri, registry_uri=tracker.uri)
        model_id = _logged_model_id(client, model_uri)
        try:
            client.create_registered_model(name)
        except MlflowException as exc:
            if exc.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
                raise
        version = client.create_model_version(name, source=f"models:/{model_id}", run_id=tracker.run_id,
                                              tags=redact_all({k: str(v) for k, v in tags.items()}),
                                              model_id=model_id)
        tracker.set_tag("registered_model", f"{name}/{version.version}")
        return str(version.version)
    except Exception as exc:
        print(f"warning: could not register the model as '{name}' ({type(exc).__name__}: {redact(str(exc))[:300]}); "
              "the run and its logged model are kept.", file=sys.stderr)
        return None


def _logged_model_id(client, model_uri: str) -> str:
    """The id of the logged model a `models:/ID` or `runs:/RUN/NAME` URI names (the newest of that name)."""
    if model_uri.startswith("models:/"):
        return model_uri.removeprefix("models:/")
    run_id, _, name = model_uri.removeprefix("runs:/").partition("/")
    outputs = client.get_run(run_id).outputs
    logged = [client.get_logged_model(output.model_id) for output in (outputs.model_outputs if outputs else [])]
    named = [model for model in logged if model.name == name]
    if not named:
        raise ValueError(f"run {run_id} has no logged model named '{name}'")
    return max(named, key=lambda model: model.creation_timestamp).model_id
