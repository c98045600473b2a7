"""One MLflow run per job, handled by the driver only; `RunTracker` is ampflow's only door to MLflow.

The driver creates (or, with --resume, reopens) the run with params, tags and the resolved
YAML, `orchestrator.tracking.writer` logs what the workers report, and the driver closes the run
FINISHED, FAILED or KILLED (`orchestrator.runner.records.close_run`). Workers never talk to MLflow, so
a restarted worker group cannot create a second run. The writer, the sweep and export read and write
through the small named methods here, never through an MLflow client of their own, so everything
logged is redacted in one place (`orchestrator.tracking.secrets`).

MLflow is imported inside the methods that use it, not here: it takes seconds to import, this module is on
every command's start-up path (where bad input must exit 2 at once), and the driver's first MLflow call runs on
a thread beside `ray.init`, so that the import overlaps Ray's start.
"""

import contextlib
import fcntl
import functools
import json
import logging
import os
import re
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import numpy as np
from omegaconf import DictConfig

from orchestrator.errors import BadInput
from orchestrator.tracking import run_model, summary_values
from orchestrator.tracking.plots import log_run_plots
from orchestrator.tracking.refusals import Refusals
from orchestrator.tracking.secrets import redact, redact_all, redact_figure, redact_yaml
from orchestrator.tracking.summary_values import held, summary_tags

if TYPE_CHECKING:
    from orchestrator.tracking.lineage import DatasetLineage

logger = logging.getLogger("ampflow.tracking")

# MLflow draws a tqdm "Downloading artifacts" bar on every download (a logged model loaded, a job's config read):
# noise on ampflow's console, which says what it loaded in words. Set it to true to have the bars back.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


class TrackingUnavailable(BadInput):
    """MLflow cannot be reached at the start of a job that requires it (exit 2, nothing started)."""


def quick_http_failures() -> None:
    """MLflow's HTTP client retries for minutes by default; our writer retries on its own schedule."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")


def resolve_uri(configured: Optional[str], base_dir: Path) -> str:
    """tracking.uri, else $MLFLOW_TRACKING_URI, else sqlite:///<base_dir>/mlflow.db; local paths made absolute."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str((base_dir / uri.removeprefix("sqlite:///")).resolve())
    if "://" not in uri:  # a bare directory: MLflow's file store
        return (base_dir / uri).resolve().as_uri()
    return uri


TRAINING_VIEW = "?workflowType=machine_learning"
"""What opens MLflow 3.17's UI in its model-training view: it chooses the view from the URL's `workflowType`, else
from the browser's last choice (GenAI by default); older 3.x UIs read the experiment's `mlflow.experimentKind`."""


def view_hint(uri: str, experiment_id: str, run_id: str) -> str:
    """How to look at the run: the UI URL for a server, the `mlflow ui` command for a local store."""
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}{TRAINING_VIEW}"
    return (
        f"mlflow ui --backend-store-uri {uri}\n"
        f"  then open http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{run_id}{TRAINING_VIEW}"
    )


def _git(directory: Path, *args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def standard_tags(job_path: Path, directory: Path) -> dict[str, str]:
    """The tags MLflow's own context providers give a run made by `mlflow.start_run` (`mlflow.user`,
    `mlflow.source.name` and `.type`, ...), so the UI's header fills in, with the job file as the source and
    the git commit, branch and remote of the submit directory's checkout (not of ampflow's own code)."""
    from mlflow.tracking.context.registry import resolve_tags

    tags = {k: v for k, v in resolve_tags().items() if not k.startswith("mlflow.source.git.")}
    tags.update({"mlflow.source.name": str(job_path), "mlflow.source.type": "LOCAL"})
    for key, args in (("mlflow.source.git.commit", ("rev-parse", "HEAD")),
                      ("mlflow.source.git.branch", ("rev-parse", "--abbrev-ref", "HEAD")),
                      ("mlflow.source.git.repoURL", ("config", "--get", "remote.origin.url"))):
        value = _git(directory, *args)
        if value:
            tags[key] = re.sub(r"//[^/@]+@", "//", value)  # never a token written into a remote's URL
    return tags


def policy_tags(precision) -> dict[str, str]:
    """What a run's `preset` and `compute_dtype` tags leave out of a per-layer policy (a tuned job's): its rules
    in order (`precision_rules: conv1=bfloat16, head=float16`) and fp32 master weights when kept; {} for a policy
    without rules."""
    if not precision.rules:
        return {}
    rules = ", ".join(f"{rule.match}={rule.dtype}" for rule in precision.rules)
    return {"precision_rules": rules[:5000], "master_weights": str(bool(precision.master_weights)).lower()}


@contextlib.contextmanager
def _sqlite_store_lock(uri: str):
    """Hold an exclusive lock on a local SQLite store's directory: two submits opening a new store at the same
    moment would both create its tables (MLflow fails one with "duplicate column"). Other stores: no lock."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    directory = Path(uri.removeprefix("sqlite:///")).parent
    directory.mkdir(parents=True, exist_ok=True)
    handle = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # releases the lock


EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
"""The experiment tag MLflow's UI (3.x before 3.17) reads to choose the experiment's view (its JS's
`experimentKind`); 3.17 reads the URL's `workflowType` instead (`TRAINING_VIEW`)."""

TRAINING_KIND = "custom_model_development"
"""The value that opens the model-training view (runs, metrics charts), not the GenAI one (traces, evaluations)."""


def reach(uri: str, experiment: str, anyway: str):
    """The store at `uri` answering one query: (its client, the experiment named `experiment`, or None where there
    is none yet); the first use of a local store creates its tables. TrackingUnavailable (exit 2) when it does not
    answer; `anyway`: what `tracking.required: false` does instead, as the message tells."""
    from mlflow import MlflowClient

    try:
        with _sqlite_store_lock(uri):
            client = MlflowClient(tracking_uri=uri)
            return client, client.get_experiment_by_name(experiment)
    except Exception as exc:
        raise TrackingUnavailable(
            f"tracking: MLflow at {redact(uri)} cannot be reached ({type(exc).__name__}: {redact(str(exc))[:300]}). "
            f"Start the tracking server, fix tracking.uri / MLFLOW_TRACKING_URI, or set tracking.required: false "
            f"{anyway}.") from None


def _create_experiment(client, name: str) -> str:
    """Create experiment `name`; when another submit created it a moment ago (MLflow refuses a second one with
    the same name), use that one."""
    from mlflow.exceptions import MlflowException

    try:
        return client.create_experiment(name)
    except MlflowException:
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def _log_figure(client, run_id: str, figure, artifact_path: str) -> None:
    client.log_figure(run_id, redact_figure(figure), artifact_path)


def _write(method):
    """A write to the run: one MLflow refuses is counted in the tracker's `refusals` (then raised as it was)."""

    @functools.wraps(method)
    def counted(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            self.refusals.refused(exc)
            raise

    return counted


class RunTracker:
    """Driver-side handle on the job's MLflow run."""

    def __init__(self, uri: str, experiment_id: str, run_id: str):
        from mlflow import MlflowClient

        self.uri, self.experiment_id, self.run_id = uri, experiment_id, run_id
        self._client = MlflowClient(tracking_uri=uri)
        self.refusals = Refusals()
        """Every write to the run MLflow refused, by kind (the driver shares one with the run's writer)."""
        self.artifacts_logged: set[str] = set()
        """The artifact paths this tracker logged (`missing_artifacts` checks they are still there)."""
        self.logged_models: dict[str, str] = {}
        """The id of each model this tracker logged, by name."""

    @classmethod
    def create(cls, uri: str, experiment: str, *, run_name: str, tags: dict[str, str],
               anyway: str = "to train anyway and log once it is back") -> "RunTracker":
        """A new RUNNING run in `experiment` (created when missing), its name and tags redacted: for a command whose
        run is not a job's (`tune`); TrackingUnavailable when MLflow cannot be reached (`anyway`: what
        `tracking.required: false` does instead, as `reach` tells)."""
        client, found = reach(uri, experiment, anyway)
        experiment_id = found.experiment_id if found is not None else _create_experiment(client, experiment)
        if found is None or EXPERIMENT_KIND_TAG not in found.tags:  # a kind its owner set is kept
            client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)
        run = client.create_run(experiment_id, run_name=redact(run_name), tags=redact_all(tags))
        return cls(uri, experiment_id, run.info.run_id)

    @classmethod
    def start(cls, uri: str, cfg: DictConfig, *, run_name: str, tags: dict[str, str],
              params: dict[str, str], config_yaml: str) -> "RunTracker":
        tracker = cls.create(uri, cfg.tracking.experiment, run_name=run_name, tags=tags)
        try:
            tracker.log_params(params)
            tracker.log_text(config_yaml, "config/job.yaml")
        except BaseException:
            tracker.finish("FAILED")
            raise
        return tracker

    @classmethod
    def open(cls, uri: str, run_id: str) -> "RunTracker":
        """An existing run (e.g. for export); BadInput when it is not there."""
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        try:
            run = MlflowClient(tracking_uri=uri).get_run(run_id)
        except MlflowException as exc:
            raise BadInput(f"run {run_id} not found at {redact(uri)} ({redact(exc.message)}). Pass --tracking-uri "
                           "or set MLFLOW_TRACKING_URI to the store the run is in.") from None
        return cls(uri, run.info.experiment_id, run_id)

    def reopen(self) -> None:
        """Mark a run that a dead driver left RUNNING, FAILED or KILLED as running again (--resume)."""
        self._client.update_run(self.run_id, status="RUNNING")

    def load_json(self, artifact_path: str) -> Any:
        """A JSON artifact of the run, or None when it has none at that path."""
        folder = artifact_path.rpartition("/")[0] or None
        if not any(a.path == artifact_path for a in self._client.list_artifacts(self.run_id, folder)):
            return None
        return json.loads(self.load_text(artifact_path))

    def load_text(self, artifact_path: str) -> str:
        import mlflow

        local = mlflow.artifacts.download_artifacts(run_id=self.run_id, artifact_path=artifact_path,
                                                    tracking_uri=self.uri)
        return Path(local).read_text()

    def find_text(self, artifact_path: str) -> Optional[str]:
        """The artifact's text; None where the run has no such artifact."""
        from mlflow.exceptions import MlflowException

        try:
            return self.load_text(artifact_path)
        except (MlflowException, OSError):
            return None

    def has_logged_model(self, name: str) -> bool:
        """Whether the run logged a model named `name` (an MLflow 3 LoggedModel)."""
        return bool(self._client.search_logged_models(
            [self.experiment_id], filter_string=f"source_run_id = '{self.run_id}' AND name = '{name}'"))

    def load_model(self):
        """The run's fp32 model (`model`) as logged at the end of training (`run_model.load_model`)."""
        return run_model.load_model(self)

    # -- writing ----------------------------------------------------------------------------------

    @_write
    def log_metrics(self, metrics: dict[str, float], step: int = 0, timestamp_ms: Optional[int] = None) -> None:
        """One batch of metrics at `step`; `timestamp_ms` keeps when they were measured (a backfill after
        an outage), default now."""
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        self._client.log_batch(self.run_id, metrics=[Metric(k, float(v), timestamp, step) for k, v in metrics.items()])

    @_write
    def set_tag(self, key: str, value: str) -> None:
        self._client.set_tag(self.run_id, key, redact(value))

    @_write
    def delete_tag(self, key: str) -> None:
        """Remove a tag (one that is not there: nothing to do)."""
        from mlflow.exceptions import MlflowException

        try:
            self._client.delete_tag(self.run_id, key)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise

    @_write
    def log_datasets(self, datasets: Sequence["DatasetLineage"]) -> None:
        """The run's dataset inputs (`orchestrator.tracking.lineage`): each with its context, a tensor schema
        and a profile of its size and sample shape."""
        from mlflow.data.schema import TensorDatasetSchema
        from mlflow.entities import Dataset, DatasetInput, InputTag
        from mlflow.types import Schema, TensorSpec
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        def spec(dtype: str, shape: list[int], name: Optional[str] = None) -> TensorSpec:
            return TensorSpec(np.dtype(dtype), (-1, *shape), name)

        inputs = []
        for d in datasets:
            named = len(d.inputs) > 1 or any(name is not None for name, _, _ in d.inputs)
            features = Schema([spec(dtype, shape, (name or f"input_{i}") if named else None)
                               for i, (name, dtype, shape) in enumerate(d.inputs)] or [spec("float32", [])])
            targets = Schema([spec(d.target_dtype, d.target_shape)]) if d.target_dtype is not None else None
            schema = TensorDatasetSchema(features, targets)
            profile = {"num_samples": d.num_samples, "sample_shape": d.input_shape}
            entity = Dataset(d.name, d.digest, d.source_type, redact(d.source), json.dumps(schema.to_dict()),
                             json.dumps(profile))
            inputs.append(DatasetInput(entity, tags=[InputTag(MLFLOW_DATASET_CONTEXT, d.context)]))
        self._client.log_inputs(self.run_id, datasets=inputs)

    @_write
    def log_params(self, params: dict[str, Any]) -> None:
        """More params (new keys: MLflow refuses to change a param's value)."""
        from mlflow.entities import Param

        items = [Param(key, str(value)) for key, value in redact_all(params).items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self._client.log_batch(self.run_id, params=items[i : i + 100])

    @_write
    def set_tags(self, tags: dict[str, Any]) -> None:
        """Several tags in one batch; values as text, cut to MLflow's 5000 characters."""
        from mlflow.entities import RunTag

        self._client.log_batch(self.run_id, tags=[RunTag(key, str(value)[:5000])
                                                 for key, value in redact_all(tags).items()])

    @_write
    def log_dict(self, value: Any, artifact_path: str) -> None:
        """A JSON (or YAML, by the path's suffix) artifact, replacing any at that path."""
        self._client.log_dict(self.run_id, redact_all(value), artifact_path)
        self.artifacts_logged.add(artifact_path)

    @_write
    def log_text(self, text: str, artifact_path: str) -> None:
        """A text artifact, redacted; a YAML one (by its suffix) stays a YAML document that loads."""
        masked = redact_yaml(text) if artifact_path.endswith((".yaml", ".yml")) else redact(text)
        self._client.log_text(self.run_id, masked, artifact_path)
        self.artifacts_logged.add(artifact_path)

    @_write
    def log_figure(self, figure, artifact_path: str) -> None:
        """A matplotlib figure as an image artifact, its texts redacted (the caller closes the figure)."""
        _log_figure(self._client, self.run_id, figure, artifact_path)
        self.artifacts_logged.add(artifact_path)

    def log_model(self, model, inputs, code_paths: Optional[list[str]] = None, name: str = "model") -> str:
        """Log the model as the run's MLflow model `name` (`run_model.log_model`); returns the format used."""
        return run_model.log_model(self, model, inputs, code_paths, name)

    @_write
    def describe_model(self, name: str, step: Optional[int] = None, tags: Optional[dict[str, str]] = None) -> None:
        """What MLflow's page of the logged model `name` shows besides its files: the run's `train/` and `eval/`
        metrics as they were at `step` (the checkpoint logged; default the newest), each linked to the model and
        to the dataset it was measured on (the run's `train` or `eval` input: the page's "Datasets used"), and
        `tags`."""
        from mlflow.entities import Metric
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        model_id = self.logged_models[name]
        run = self._client.get_run(self.run_id)
        datasets = {tag.value: entry.dataset for entry in (run.inputs.dataset_inputs if run.inputs else [])
                    for tag in entry.tags if tag.key == MLFLOW_DATASET_CONTEXT}
        linked = []
        for key in sorted(run.data.metrics):
            if not key.startswith(("train/", "eval/")):
                continue
            history = sorted(self.metric_history(key), key=lambda m: (m.step, m.timestamp))
            until = [m for m in history if step is None or m.step <= step]
            if not until:
                continue
            dataset = datasets.get("eval" if key.startswith("eval/") else "train")
            linked.append(Metric(key, until[-1].value, until[-1].timestamp, until[-1].step, model_id=model_id,
                                 dataset_name=dataset.name if dataset else None,
                                 dataset_digest=dataset.digest if dataset else None, run_id=self.run_id))
        if linked:
            self._client.log_batch(self.run_id, metrics=linked)
        if tags:
            self._client.set_logged_model_tags(model_id, redact_all(tags))

    # -- reading ----------------------------------------------------------------------------------

    def metric_history(self, key: str) -> list:
        """Every value logged for `key` (MLflow `Metric`s, in no promised order; [] when never logged); a value
        that never changed, kept as a summary tag (`orchestrator.tracking.summary_values`), as one at step 0."""
        from mlflow.entities import Metric

        history = list(self._client.get_metric_history(self.run_id, key))
        if history or not held(key):
            return history
        run = self._client.get_run(self.run_id)
        value = summary_tags(run.data.tags).get(key)
        return [] if value is None else [Metric(key, value, run.info.start_time, 0)]

    def metric_ends(self) -> tuple[dict[str, int], dict[str, int]]:
        """Each metric's highest logged step and newest timestamp (ms): where a resumed run's metrics go on from."""
        histories = {key: self.metric_history(key) for key in self._client.get_run(self.run_id).data.metrics}
        return ({key: max(m.step for m in history) for key, history in histories.items()},
                {key: max(m.timestamp for m in history) for key, history in histories.items()})

    def tags(self) -> dict[str, str]:
        return dict(self._client.get_run(self.run_id).data.tags)

    def run_info(self):
        """The run's MLflow `RunInfo`: status, start_time and end_time (ms), names."""
        return self._client.get_run(self.run_id).info

    def latest_metrics(self) -> dict[str, float]:
        """Each metric's newest value as the run holds it, its summary values included ({} when the store cannot
        be read)."""
        try:
            run = self._client.get_run(self.run_id)
            return summary_values.values(run.data.metrics, run.data.tags)
        except Exception:
            return {}

    def log_plots(self, policy: Optional[str]) -> None:
        """The loss-scale and memory plots (best effort: a plot never fails a run)."""

        try:
            self.artifacts_logged.update(log_run_plots(self._client, self.run_id, policy, _log_figure))
        except Exception as exc:
            kind = self.refusals.refused(exc)
            logger.warning("ampflow: could not log the plots (%s).", kind)

    @_write
    def finish(self, status: str) -> None:
        """FINISHED, FAILED or KILLED; a run is never left RUNNING."""
        self._client.set_terminated(self.run_id, status=status)

    def status(self) -> str:
        return self.run_info().status

    def missing_artifacts(self) -> Optional[list[str]]:
        """The artifacts this tracker logged that the run's artifact store no longer lists (its directory deleted
        mid-run: a local store recreates it for the next artifact, silently without the earlier ones); None when
        the store cannot be listed."""
        try:
            present = set(self._artifact_paths(None))
        except Exception:
            return None
        return sorted(self.artifacts_logged - present)

    def _artifact_paths(self, folder: Optional[str]) -> Iterator[str]:
        for info in self._client.list_artifacts(self.run_id, folder):
            if info.is_dir:
                yield from self._artifact_paths(info.path)
            else:
                yield info.path
