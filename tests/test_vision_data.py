"""Data beyond 3x32x32: a torchvision-format image folder of 1x28x28 images trains a 1-channel model, its
shape travels to the checkpoint (the logged model's example input), and a model that cannot take the data,
or whose classes do not match it, is refused in pre-flight naming both; a torchvision dataset that cannot be
downloaded says where to put it."""

import numpy as np
import pytest
from omegaconf import OmegaConf
from PIL import Image

from conftest import small_job
from orchestrator.config import load_job
from orchestrator.errors import BadInput, DataUnavailable
from orchestrator.runner.preflight import preflight
from orchestrator.checkpoint.files import load_newest_valid, local_candidates
from orchestrator.train.local import spawn


@pytest.fixture
def folder(tmp_path):
    """root/train/<class>/*.png and root/val/<class>/*.png: 3 classes of 28x28 grey images (bright bars)."""
    rng = np.random.default_rng(0)
    for split, count in (("train", 12), ("val", 4)):
        for label in range(3):
            directory = tmp_path / "images" / split / f"class{label}"
            directory.mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 60, (28, 28), dtype=np.uint8)
                pixels[label * 9:(label + 1) * 9] = 250
                Image.fromarray(pixels, mode="L").save(directory / f"{i}.png")
    return tmp_path / "images"


def folder_job(write_job, folder, **model):
    return load_job(write_job(small_job(
        model={"name": "simple_cnn", "num_classes": 3, "kwargs": {"in_channels": 1, "image_size": 28}, **model},
        data={"name": "ImageFolder", "root": str(folder), "transforms": {"grayscale": True}},
        scaling={"num_workers": 1}, run={"batch_size": 6, "epochs": 1})))


@pytest.mark.slow  # trains in processes of its own
def test_an_image_folder_of_1x28x28_trains_a_one_channel_model_logged_with_that_signature(write_job, folder,
                                                                                           tmp_path, mlflow_uri):
    import mlflow
    from ray.train import Checkpoint

    from orchestrator.runner.outputs import log_trained_model
    from orchestrator.tracking.tracker import RunTracker

    cfg = folder_job(write_job, folder)
    preflight([cfg], tmp_path / "job.yaml", None)  # the model takes the data
    reports = spawn(OmegaConf.to_container(cfg, resolve=True), world_size=1, directory=tmp_path / "run")["reports"]
    assert any("eval/accuracy" in r.metrics for r in reports)
    final = sorted((tmp_path / "run" / "checkpoints").glob("checkpoint_0*"))[-1]
    state, _ = load_newest_valid(local_candidates(tmp_path / "run" / "checkpoints"), rank=0)
    assert state.sample_shape == [1, 28, 28] and state.model["features.0.weight"].shape[1] == 1

    tracker = RunTracker.start(mlflow_uri, cfg, run_name="folder", tags={}, params={}, config_yaml="")
    uri = log_trained_model(cfg, Checkpoint.from_directory(str(final)), tracker)  # as the driver logs it
    (spec,) = mlflow.models.get_model_info(uri).signature.inputs.inputs
    assert tuple(spec.shape) == (-1, 1, 28, 28)


def test_a_model_that_cannot_take_the_data_is_refused_in_preflight_naming_both(write_job, folder, tmp_path):
    cfg = folder_job(write_job, folder, kwargs={"in_channels": 3, "image_size": 28})
    with pytest.raises(BadInput, match=r"data.name: ImageFolder gives samples of shape 1x28x28, which model.name "
                                       r"simple_cnn cannot take"):
        preflight([cfg], tmp_path / "job.yaml", None)
    cfg = folder_job(write_job, folder, num_classes=10)
    with pytest.raises(BadInput, match=r"model.num_classes: model simple_cnn gives 10 class scores, but data "
                                       r"ImageFolder has 3 classes"):
        preflight([cfg], tmp_path / "job.yaml", None)


def test_a_torchvision_dataset_that_cannot_be_had_says_where_to_put_it(write_job, tmp_path):
    from orchestrator.train.data import ensure_available

    cfg = load_job(write_job(small_job(data={"name": "FashionMNIST", "root": str(tmp_path / "data"),
                                             "download": False})))
    with pytest.raises(DataUnavailable, match=r"FashionMNIST is not in .*torchvision.datasets.FashionMNIST\("):
        ensure_available(cfg.data)
