"""A job that holds secrets in every place a job can: no command writes one in clear.

The job below carries a literal `hf_token` and `password` in `model.kwargs`, a literal `api_key` in `data.kwargs`, a
`user:password@` URI in each kwargs, its MLflow tracking URI and its checkpoint storage (a bucket), and a variable
named like a token (`AMPFLOW_HOSTILE_TOKEN`) through `${oc.env:...}`. For submit, tune, sweep, predict, export and
summary, every param, tag, dataset input, artifact (each downloaded from the real MLflow store, the logged models'
included) and console line is searched for each secret. The tune's job file written for the user keeps them: it is
their job.
"""

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import REPO, own_ray_env
from mlflow_server import MlflowServer

SECRETS = {
    "model.kwargs.hf_token": "hf_HostileLiteral0001",
    "model.kwargs.password": "HostilePass0002",
    "model.kwargs.source (URI password)": "HostileUriPass0003",
    "data.kwargs.api_key": "HostileApiKey0004",
    "data.kwargs.url (URI password)": "HostileUriPass0005",
    "$AMPFLOW_HOSTILE_TOKEN via ${oc.env:...}": "HostileEnvToken0006",
    "tracking.uri (URI password)": "HostileTrackPass0007",
    "checkpoint.storage_path (URI password)": "HostileStorePass0008",
}
ENV_TOKEN = "AMPFLOW_HOSTILE_TOKEN"

HOSTILE_NETS = '''
import logging
import os

import torch
from torch import nn
from torch.utils.data import TensorDataset


class KeyedNet(nn.Module):
    """A small model built with credentials, as one pulled from a hub is: it says where it comes from."""

    def __init__(self, num_classes=10, hf_token=None, password=None, source=None):
        super().__init__()
        assert hf_token and password and source, "the job's credentials reach the model"
        print(f"KeyedNet from {source}")
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.ReLU(), nn.Linear(16, num_classes))

    def forward(self, x):
        return self.layers(x)


class ChattyNet(KeyedNet):
    """A model whose library prints the token it found in the environment and logs its mirror's URI."""

    def __init__(self, num_classes=10):
        token = os.environ.get("AMPFLOW_HOSTILE_TOKEN")
        print(f"authenticated to the hub with token {token}")
        logging.getLogger("hub").warning("mirror: https://ampflow:%s@hub.example.com/chatty", token)
        super().__init__(num_classes, "hf", "pw", "https://hub.example.com/chatty")


def keyed_data(api_key=None, url=None, header=None, password=None):
    """64 random 3x8x8 samples of 10 classes, read with credentials (the api_key, the url's password, a header)."""
    assert api_key and url and header, "the job's credentials reach the data"
    generator = torch.Generator().manual_seed(0)
    inputs, targets = torch.randn(64, 3, 8, 8, generator=generator), torch.randint(0, 10, (64,), generator=generator)
    return TensorDataset(inputs[:48], targets[:48]), TensorDataset(inputs[48:], targets[48:])
'''


def hostile_job(tracking_uri: str, experiment: str, storage_path: str) -> dict:
    return {
        "model": {"name": "hostile_nets:KeyedNet", "kwargs": {
            "hf_token": SECRETS["model.kwargs.hf_token"], "password": SECRETS["model.kwargs.password"],
            "source": f"https://ampflow:{SECRETS['model.kwargs.source (URI password)']}@hub.example.com/keyed"}},
        "data": {"name": "hostile_nets:keyed_data", "kwargs": {
            "api_key": SECRETS["data.kwargs.api_key"],
            "url": f"s3://AKIDHOSTILE:{SECRETS['data.kwargs.url (URI password)']}@data-bucket/keyed",
            "header": f"Bearer ${{oc.env:{ENV_TOKEN}}}"}},
        "scaling": {"num_workers": 1},
        "run": {"epochs": 1, "batch_size": 16, "max_steps_per_epoch": 2},
        "tracking": {"uri": tracking_uri, "experiment": experiment, "log_every_n_steps": 1, "log_model": True,
                     "system_metrics_interval_s": 0},
        "checkpoint": {"storage_path": storage_path},
        "tune": {"batches": 1, "validate_steps": 2},
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real MLflow server; jobs reach it with a password in its URI (it takes any)."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-hostile")).start()
    yield server
    server.stop()


@pytest.fixture
def hostile(tmp_path, server, monkeypatch):
    """The job's directory (the models beside it, importable), the environment's token set, and `write(...)`:
    the hostile job written there for an experiment and storage path."""
    (tmp_path / "hostile_nets.py").write_text(HOSTILE_NETS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(ENV_TOKEN, SECRETS["$AMPFLOW_HOSTILE_TOKEN via ${oc.env:...}"])
    uri = server.url.replace("http://", f"http://ampflow:{SECRETS['tracking.uri (URI password)']}@")

    def write(experiment: str, storage_path: str = str(tmp_path / "ray_results"), name: str = "hostile.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(hostile_job(uri, experiment, storage_path), sort_keys=False))
        return path

    write.uri = uri
    return write


def everything_logged(uri: str, experiment: str) -> dict[str, str]:
    """Every run of `experiment` and every model logged there, as text: info, params, tags, dataset inputs, and the
    content of each artifact (downloaded); by where it was found."""
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment}"
    logged: dict[str, str] = {}

    def download(where: str, root: str) -> None:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=root, tracking_uri=uri))
        for path in ([local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())):
            logged[f"{where} artifact {path.relative_to(local.parent)}"] = path.read_bytes().decode("latin-1")

    runs = client.search_runs([found.experiment_id])
    assert runs, f"no run in {experiment}"
    for run in runs:
        where = f"run {run.info.run_name}"
        logged[f"{where} info, params, tags, inputs"] = repr((run.info, run.data.params, run.data.tags, run.inputs))
        if client.list_artifacts(run.info.run_id):
            download(where, run.info.artifact_uri)
    for model in client.search_logged_models([found.experiment_id]):
        logged[f"model {model.name}"] = repr(model)
        download(f"model {model.name}", model.artifact_location)
    return logged


def assert_no_secret(what: str, texts: dict[str, str]) -> None:
    leaks = [f"{name} in {where}" for where, text in texts.items() for name, value in SECRETS.items()
             if value in text]
    assert not leaks, f"{what}: secrets in clear: {leaks}"


def test_tune_writes_the_users_job_as_it_is_and_nothing_in_clear_to_mlflow_or_the_console(hostile, capsys):
    from orchestrator.cli.tune import main

    job = hostile("hostile-tune")
    assert main([str(job), "tune.target=h100", "--output", "tuned.yaml"]) == 0
    out = capsys.readouterr()
    logged = everything_logged(hostile.uri, "hostile-tune")
    assert_no_secret("tune", {"console": out.out + out.err, **logged})
    policy = next(text for where, text in logged.items() if where.endswith("tune/policy.yaml"))
    masked = yaml.safe_load(policy)  # the job, masked, still a YAML document
    assert masked["model"]["kwargs"]["hf_token"] == "***" and "rules" in masked["precision"]
    assert masked["tracking"]["uri"].startswith("http://ampflow:***@127.0.0.1")

    tuned = yaml.safe_load(open("tuned.yaml"))  # the user's file: their own values, their interpolation
    assert tuned["model"]["kwargs"]["hf_token"] == SECRETS["model.kwargs.hf_token"]
    assert tuned["data"]["kwargs"]["header"] == f"Bearer ${{oc.env:{ENV_TOKEN}}}"
    assert tuned["tracking"]["uri"] == hostile.uri


def test_submit_dry_run_and_summary_print_no_secret(hostile, capsys, caplog):
    from orchestrator.cli.submit import main as submit
    from orchestrator.cli.summary import main as summary

    job = hostile("hostile-dry-run", storage_path=f"s3://AKIDHOSTILE:{SECRETS['checkpoint.storage_path (URI password)']}"
                                                 "@bucket/runs")
    assert submit([str(job), "--dry-run"]) == 0
    dry_run = capsys.readouterr()
    assert "storage_path: s3://AKIDHOSTILE:***@bucket/runs" in dry_run.out, dry_run.out
    # summary has no job: what its model's library prints and logs (the environment's token, a URI's password)
    assert summary(["hostile_nets:ChattyNet", "--input", "3,8,8", "--no-activations"]) == 0
    chatter = capsys.readouterr()
    assert "authenticated to the hub with token ***" in chatter.out and "https://ampflow:***@hub" in caplog.text
    assert_no_secret("submit --dry-run and summary", {"dry run": dry_run.out + dry_run.err,
                                                       "summary": chatter.out + chatter.err + caplog.text})


@pytest.mark.parametrize("command", ["submit", "sweep", "jobs", "summary", "export", "predict", "tune"])
def test_every_command_redacts_its_console_before_it_reads_its_arguments(command, monkeypatch):
    """Each command of `ampflow` (a new one included: they are read from its list) wraps stdout and stderr in the
    redaction first thing, so nothing it, MLflow or a library prints is missed, `--help` included."""
    import importlib

    from orchestrator.cli.ampflow import COMMANDS
    from orchestrator.tracking.secrets import RedactingStream

    assert set(COMMANDS) == {"submit", "sweep", "jobs", "summary", "export", "predict", "tune"}, \
        "a command was added: add it to the parameters above"
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with pytest.raises(SystemExit):
        importlib.import_module(f"orchestrator.cli.{command}").main(["--help"])
    assert isinstance(sys.stdout, RedactingStream) and isinstance(sys.stderr, RedactingStream), command


def test_a_sweeps_secret_values_never_name_its_runs_or_fill_its_table():
    from orchestrator.cli.sweep_grid import point_labels

    labels = point_labels([("data.kwargs.password", ["HostileSwept0009", "HostileSwept0010"]),
                           ("model.kwargs.source", ["https://u:HostileUriPass0003@hub/x"])])
    assert list(labels) == ["password-sourcehttps_u_hub_x-1", "password-sourcehttps_u_hub_x-2"]
    assert [point["data.kwargs.password"] for point in labels.values()] == ["HostileSwept0009", "HostileSwept0010"]


def test_a_jobs_own_secrets_are_masked_wherever_they_show_once_remembered():
    """A table or a library's message shows a value without its key: the job's secrets, once the job is read,
    are masked as the environment's are (a short one only where its key or URI shows it)."""
    from orchestrator.tracking.secrets import redact, remember_secrets

    remember_secrets({"data": {"kwargs": {"password": "HostileRemembered0011", "token": "abc", "use_token": False},
                               "url": "s3://AKID:HostileUriPass0012@b/x"}})
    assert redact("| 1 | HostileRemembered0011 | HostileUriPass0012 | abc | False |") == \
        "| 1 | *** | *** | abc | False |"


def test_a_figures_every_text_is_redacted(monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    from orchestrator.tracking.secrets import redact_figure

    monkeypatch.setenv(ENV_TOKEN, "HostileEnvToken0006")
    figure, axis = plt.subplots()
    axis.bar(["HostileEnvToken0006", "https://u:HostileUriPass0003@h/x"], [1, 2], label="token=HostilePass0002")
    axis.set_title("run HostileEnvToken0006")
    axis.legend()
    texts = [text.get_text() for text in redact_figure(figure).findobj(Text)]
    plt.close(figure)
    assert "run ***" in texts and "token=***" in texts and "https://u:***@h/x" in texts
    assert not [text for text in texts if "Hostile" in text], texts


def test_checkpoints_in_a_bucket_are_named_by_their_full_uri():
    from orchestrator.runner.records import storage_uri

    assert storage_uri("s3://AKID:pw@bucket/runs", "bucket/runs/job-1") == "s3://bucket/runs/job-1"
    assert storage_uri("gs://bucket/runs/", "bucket/runs/job-1") == "gs://bucket/runs/job-1"
    assert storage_uri("hdfs://namenode:8020/runs", "/runs/job-1") == "hdfs://namenode:8020/runs/job-1"
    assert storage_uri("/data/ray_results", "/data/ray_results/job-1") == "/data/ray_results/job-1"


def _command(args: list[str], env: dict, cwd: Path, timeout: int = 300) -> str:
    out = subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=timeout)
    console = out.stdout + out.stderr
    assert out.returncode == 0, f"{' '.join(args[:2])} exited {out.returncode}:\n{console[-4000:]}"
    return console


@pytest.mark.slow
def test_submit_predict_and_export_write_no_secret_to_mlflow_or_the_console(hostile, tmp_path, ray_tmpdir):
    """One trained run with checkpoints in a bucket (moto's S3, reached with a password in the storage URI), then
    predict and export on it: the run's params, tags, inputs, artifacts and logged models (the exported one
    included), and the three commands' consoles, hold no secret; the console names the checkpoints by their
    s3:// URI.

    Long: a submit on a Ray of its own, then predict and export, each a process of its own."""
    from s3_server import S3Server

    with S3Server() as s3:
        storage = f"s3://AKIDHOSTILE:{SECRETS['checkpoint.storage_path (URI password)']}@{s3.bucket}/runs"
        job = hostile("hostile-submit", storage_path=storage)
        env = own_ray_env(ray_tmpdir, **s3.env, **{ENV_TOKEN: os.environ[ENV_TOKEN]})
        env["PYTHONPATH"] = f"{REPO}{os.pathsep}{tmp_path}"
        consoles = {"submit": _command(["orchestrator.submit", str(job)], env, tmp_path)}
        assert f"Checkpoints: s3://{s3.bucket}/runs/" in consoles["submit"], consoles["submit"]
        assert any(key.startswith("runs/") for key in s3.keys())
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=hostile.uri)
        (run,) = client.search_runs([client.get_experiment_by_name("hostile-submit").experiment_id])
        consoles["predict"] = _command(["orchestrator.predict", run.info.run_id, "--output", "out.pt",
                                        "--tracking-uri", hostile.uri], env, tmp_path)
        consoles["export"] = _command(["orchestrator.export", run.info.run_id, "--dtype", "bfloat16",
                                       "--max-accuracy-drop", "1", "--tracking-uri", hostile.uri], env, tmp_path)
    logged = everything_logged(hostile.uri, "hostile-submit")
    assert any("model_bfloat16" in where for where in logged)
    job_yaml = yaml.safe_load(next(text for where, text in logged.items() if where.endswith("config/job.yaml")))
    assert job_yaml["model"]["kwargs"]["hf_token"] == run.data.params["model.kwargs.hf_token"] == "***"
    assert_no_secret("submit, predict and export", {**{f"{name} console": text for name, text in consoles.items()},
                                                    **logged})


@pytest.mark.slow
def test_a_sweep_over_a_secret_writes_none_of_its_values(hostile, tmp_path, ray_tmpdir):
    """A grid over `data.kwargs.password` (two values) beside the job's own secrets: the parent's params, tags and
    comparison (JSON, Markdown, chart), the children's runs, their names and the console hold no secret.

    Long: two trainings on a Ray of its own."""
    swept = {"sweep value 1": "HostileSwept0009", "sweep value 2": "HostileSwept0010"}
    job = hostile("hostile-sweep")
    env = own_ray_env(ray_tmpdir, **{ENV_TOKEN: os.environ[ENV_TOKEN]})
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{tmp_path}"
    console = _command(["orchestrator.sweep", str(job), "--grid", f"data.kwargs.password={','.join(swept.values())}",
                        "tracking.log_model=false"], env, tmp_path, timeout=600)
    logged = everything_logged(hostile.uri, "hostile-sweep")
    assert sum("run " in where and "info" in where for where in logged) == 3  # the parent and two children
    assert any(where.endswith("sweep/comparison.md") for where in logged)
    SECRETS.update(swept)
    try:
        assert_no_secret("sweep", {"console": console, **logged})
    finally:
        for name in swept:
            SECRETS.pop(name)
