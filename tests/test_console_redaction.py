"""No secret reaches the console: not in `--dry-run`, not in MLflow's own "View run" line, not in a log record."""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, small_job
from mlflow_server import MlflowServer


def test_dry_run_masks_a_short_secret_from_the_environment(write_job, tmp_path, monkeypatch, capsys):
    from orchestrator.cli.submit import main

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "pw123")
    monkeypatch.chdir(tmp_path)
    rc = main([str(write_job(small_job())), "--dry-run", "tracking.experiment=pw123"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "experiment: ***" in out
    assert "pw123" not in out


CONSOLE_SCRIPT = textwrap.dedent("""
    import logging, sys
    from mlflow import MlflowClient
    from orchestrator.tracking.secrets import install_console_redaction

    uri = sys.argv[1]
    early = logging.getLogger("early")  # a handler made before the redaction was installed
    early.addHandler(logging.StreamHandler(sys.stderr))
    install_console_redaction()
    install_console_redaction()  # idempotent: the driver and the CLI may both call it
    client = MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("console"))
    client.set_terminated(run.info.run_id)  # MLflow prints its own "View run ... at: <uri>" here
    print("password", "pw123", "in pieces")
    sys.stdout.write("uri=" + uri[:10])
    sys.stdout.write(uri[10:] + "\\n")
    logging.getLogger("mlflow").warning("tracking at %s with %s", uri, "pw123")
    early.warning("early handler: %s", uri)
    try:
        raise RuntimeError(f"cannot reach {uri}")
    except RuntimeError:
        early.exception("failed")
    raise SystemExit(f"exit with {uri}")
""")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-console")).start()
    yield server
    server.stop()


def test_mlflows_own_view_run_line_and_log_records_are_redacted(server, tmp_path):
    uri = server.url.replace("http://", "http://ampflow:s3cret@")
    env = {**os.environ, "PYTHONPATH": str(REPO), "AMPFLOW_TEST_PASSWORD": "pw123"}
    env.pop("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", None)
    out = subprocess.run([sys.executable, "-c", CONSOLE_SCRIPT, uri], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    console = out.stdout + out.stderr
    assert out.returncode == 1, console
    assert "View run" in out.stdout and "http://ampflow:***@127.0.0.1" in out.stdout, console
    assert "password *** in pieces" in out.stdout and "uri=http://ampflow:***@" in out.stdout
    assert "tracking at http://ampflow:***@" in out.stderr and "with ***" in out.stderr
    assert "early handler: http://ampflow:***@" in out.stderr and "cannot reach http://ampflow:***@" in out.stderr
    assert "exit with http://ampflow:***@" in out.stderr
    assert "s3cret" not in console and "pw123" not in console


def test_export_never_prints_the_tracking_uri_s_password(server, tmp_path):
    """`export` against a store with a password in its URI: the run-not-found error names the store, masked."""
    uri = server.url.replace("http://", "http://ampflow:s3cret@")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "orchestrator.export", "0" * 32, "--dtype", "float16",
                          "--tracking-uri", uri], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    console = out.stdout + out.stderr
    assert out.returncode == 2, console
    assert "not found at http://ampflow:***@127.0.0.1" in out.stderr, console
    assert "s3cret" not in console


def test_credentials_not_named_like_tokens_never_reach_the_runs_params_tags_config_or_the_console(
        write_job, tmp_path, monkeypatch, capsys, mlflow_uri):
    """A URL's bare token, a connection string's AccountKey / SharedAccessSignature / Password, and variables named
    `*_KEY`, `*_DSN`, `*_CONNECTION_STRING`, `*_CREDENTIALS`: `***` in the MLflow run the driver creates and in
    `--dry-run`."""
    from mlflow import MlflowClient

    from orchestrator.cli.submit import main
    from orchestrator.config import load_job
    from orchestrator.runner.driver import _start_run

    secrets = {"url_token": "ghp_0123456789abcdef", "account_key": "QWNjb3VudEtleQ+/==", "sas_sig": "c2lnbmF0dXJl",
               "sql_password": "hunter2-sql", "STORAGE_KEY": "env-key-value", "SENTRY_DSN": "env-dsn-value",
               "AZURE_STORAGE_CONNECTION_STRING": "env-conn-value", "GCP_CREDENTIALS": "env-cred-value"}
    for name in ("STORAGE_KEY", "SENTRY_DSN", "AZURE_STORAGE_CONNECTION_STRING", "GCP_CREDENTIALS"):
        monkeypatch.setenv(name, secrets[name])
    monkeypatch.chdir(tmp_path)
    kwargs = {
        "source": f"https://{secrets['url_token']}@data.example.com/digits.tar",
        "blob": f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={secrets['account_key']};"
                "EndpointSuffix=core.windows.net",
        "sas": f"BlobEndpoint=https://acct.blob.core.windows.net/;SharedAccessSignature=sv=2022&sig={secrets['sas_sig']}",
        "sql": f"Server=tcp:db;User ID=ml;Password={secrets['sql_password']};Encrypt=yes",
        "env": "${oc.env:STORAGE_KEY}/${oc.env:SENTRY_DSN}/${oc.env:AZURE_STORAGE_CONNECTION_STRING}"
               "/${oc.env:GCP_CREDENTIALS}",
    }
    job = write_job(small_job(data={"kwargs": kwargs}))

    assert main([str(job), "--dry-run"]) == 0
    console = capsys.readouterr().out
    assert "https://***@data.example.com" in console and "AccountKey=***" in console and "***/***/***/***" in console

    tracker = _start_run(load_job(job, []), job, mlflow_uri, "redacted")
    tracker.finish("FINISHED")
    run = MlflowClient(tracking_uri=mlflow_uri).get_run(tracker.run_id)
    config = tracker.load_text("config/job.yaml")
    assert run.data.params["data.kwargs.source"] == "https://***@data.example.com/digits.tar"
    assert "AccountKey=***;" in run.data.params["data.kwargs.blob"] and "AccountKey=***;" in config
    logged = repr([run.data.params, run.data.tags]) + config
    for name, value in secrets.items():
        assert value not in logged, f"{name} reached the run"
        assert value not in console, f"{name} reached the console"
