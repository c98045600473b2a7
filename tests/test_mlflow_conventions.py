"""Runs read like MLflow runs: the tags MLflow's context providers resolve (who, from which source, which
commit of the submit directory's checkout) and the model registry, read back with MlflowClient."""

import subprocess
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from mlflow import MlflowClient

from conftest import small_job
from orchestrator.config import load_job
from orchestrator.tracking.logged_model import ModelInputs
from orchestrator.tracking.run_model import register_model
from orchestrator.tracking.tracker import RunTracker, standard_tags


@pytest.fixture
def checkout(tmp_path):
    """A git checkout with one commit and a remote whose URL carries a token."""
    repo = tmp_path / "project"
    repo.mkdir()
    git = lambda *args: subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True)  # noqa
    git("init", "-q", "-b", "main")
    (repo / "job.yaml").write_text("model: {name: simple_cnn}\n")
    git("add", "job.yaml")
    git("-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "first")
    git("remote", "add", "origin", "https://someone:ghp_token123@example.com/team/project.git")
    return repo, git("rev-parse", "HEAD").stdout.strip()


def test_a_run_carries_mlflows_standard_tags_with_the_submit_directorys_commit(checkout, write_job, mlflow_uri,
                                                                               monkeypatch):
    from orchestrator.runner.driver import _start_run

    repo, commit = checkout
    monkeypatch.chdir(repo)
    cfg = load_job(write_job(small_job(tracking={"uri": mlflow_uri})))
    tracker = _start_run(cfg, repo / "job.yaml", mlflow_uri, "tagged")
    tags = MlflowClient(tracking_uri=mlflow_uri).get_run(tracker.run_id).data.tags
    assert tags["mlflow.user"] and tags["mlflow.source.type"] == "LOCAL"
    assert tags["mlflow.source.name"] == str(repo / "job.yaml")
    assert tags["mlflow.source.git.commit"] == commit == tags["git_commit"]
    assert tags["mlflow.source.git.branch"] == "main"
    assert tags["mlflow.source.git.repoURL"] == "https://example.com/team/project.git"  # no token
    assert tags["preset"] and tags["job_file"] == str(repo / "job.yaml")  # ampflow's own tags stay


def test_outside_a_checkout_there_is_no_git_tag(tmp_path):
    tags = standard_tags(tmp_path / "job.yaml", tmp_path)
    assert tags["mlflow.source.name"] == str(tmp_path / "job.yaml")
    assert not [key for key in tags if key.startswith("mlflow.source.git.")]


def _run_with_a_logged_model(uri: str, write_job, name: str) -> tuple[RunTracker, str]:
    cfg = load_job(write_job(small_job(tracking={"uri": uri}), f"{name}.yaml"))
    tracker = RunTracker.start(uri, cfg, run_name=name, tags={}, params={}, config_yaml="")
    tracker.log_model(torch.nn.Linear(4, 2).eval(), ModelInputs.from_shape([4]))
    return tracker, f"runs:/{tracker.run_id}/model"


def test_register_model_adds_a_version_per_run_tagged_with_the_run(write_job, mlflow_uri):
    """Versions 1 then 2, in the run's own store, and MLflow's process-wide registry URI is left unset (a later
    client in the same process, or a subprocess through the environment, would otherwise be pinned to it)."""
    import os

    import mlflow

    for expected in ("1", "2"):
        tracker, uri = _run_with_a_logged_model(mlflow_uri, write_job, f"run{expected}")
        assert register_model(tracker, uri, "digits-cnn", {"preset": "O1", "run_id": tracker.run_id,
                                                           "eval/accuracy": "0.95"}) == expected
        version = MlflowClient(tracking_uri=mlflow_uri).get_model_version("digits-cnn", expected)
        assert version.run_id == tracker.run_id and version.tags["preset"] == "O1"
        assert version.tags["eval/accuracy"] == "0.95"
    assert "MLFLOW_REGISTRY_URI" not in os.environ and mlflow.get_registry_uri() == mlflow.get_tracking_uri()


def test_a_registry_that_refuses_is_a_warning_not_a_failure(write_job, mlflow_uri, monkeypatch, capsys):
    from mlflow.exceptions import MlflowException

    tracker, uri = _run_with_a_logged_model(mlflow_uri, write_job, "refused")

    def no_registry(*args, **kwargs):
        raise MlflowException("this tracking server has no model registry")

    monkeypatch.setattr(MlflowClient, "create_model_version", no_registry)
    assert register_model(tracker, uri, "digits-cnn", {}) is None
    assert "could not register the model as 'digits-cnn'" in capsys.readouterr().err
    assert "registered_model" not in MlflowClient(tracking_uri=mlflow_uri).get_run(tracker.run_id).data.tags


def _inputs(uri: str, run_id: str) -> dict[str, tuple[str, Any]]:
    """context -> (digest, dataset) of the run's dataset inputs."""
    by_context = {}
    for item in MlflowClient(tracking_uri=uri).get_run(run_id).inputs.dataset_inputs:
        context = {tag.key: tag.value for tag in item.tags}["mlflow.data.context"]
        by_context[context] = (item.dataset.digest, item.dataset)
    return by_context


def test_the_run_lists_its_train_and_eval_sets_with_digests_sizes_and_shapes(write_job, mlflow_uri, monkeypatch,
                                                                            tmp_path):
    """Pre-flight describes the data it builds anyway; the run created from it lists both sets. The digest is the
    same for the same data (random augmentation included) and changes with the data."""
    import json

    from orchestrator.runner.driver import plan_run
    from orchestrator.runner.preflight import preflight

    monkeypatch.chdir(tmp_path)
    job = write_job(small_job(tracking={"uri": mlflow_uri}, checkpoint={"storage_path": str(tmp_path / "runs")}))

    def planned(*overrides):
        cfg = load_job(job, list(overrides))
        return plan_run(cfg, job, None, preflight([cfg], job, None).runs[0])

    run_id = planned().tracker.run_id
    inputs = _inputs(mlflow_uri, run_id)
    assert sorted(inputs) == ["eval", "train"]
    train, evaluation = inputs["train"][1], inputs["eval"][1]
    assert train.name == evaluation.name == "digits" and train.digest != evaluation.digest
    assert json.loads(train.profile) == {"num_samples": 1437, "sample_shape": [3, 32, 32]}
    assert json.loads(evaluation.profile)["num_samples"] == 360
    assert json.loads(train.schema)["mlflow_tensorspec"]["features"]  # a tensor schema the UI shows

    assert _inputs(mlflow_uri, planned("run.name=again").tracker.run_id)["train"][0] == train.digest
    other = _inputs(mlflow_uri, planned("run.name=other", "data.name=synthetic", "data.synthetic_samples=512").
                    tracker.run_id)
    assert other["train"][0] != train.digest and json.loads(other["train"][1].profile)["num_samples"] == 512


def test_a_randomly_augmented_set_has_one_digest():
    from torch.utils.data import Dataset

    from orchestrator.tracking.lineage import describe

    class Flipping(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, index):
            x = torch.arange(16.0).reshape(1, 4, 4) + index
            return (x.flip(-1) if torch.rand(()) < 0.5 else x), index

    data_cfg = SimpleNamespace(name="tests_data:flipping", root="data")
    first, second = describe(data_cfg, [("train", Flipping())]), describe(data_cfg, [("train", Flipping())])
    assert first[0].digest == second[0].digest and first[0].input_shape == [1, 4, 4]
    assert first[0].source_type == "code"
