"""The data loader's failures end a run with their cause named, never a hang and never a bare traceback: a
DataLoader worker process killed mid-epoch, a file in an ImageFolder tree that is not an image."""

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import drill, small_job
from orchestrator.config import load_job
from orchestrator.train.batch import LoaderFailed
from orchestrator.train.data import build_rank_loaders
from orchestrator.train.vision import UnreadableImage


@pytest.fixture
def folder_with_a_corrupt_image(tmp_path):
    """root/{train,val}/class{0,1}/*.png, with one train file of garbage bytes (not among the first samples, which
    pre-flight reads) and one truncated."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for label in range(2):
            directory = tmp_path / "images" / split / f"class{label}"
            directory.mkdir(parents=True)
            for i in range(6):
                Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8), mode="L").save(directory / f"{i}.png")
    bad = tmp_path / "images" / "train" / "class1" / "3.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(64))
    return tmp_path / "images", bad


def loaders(write_job, data: dict, loader_workers: int):
    cfg = load_job(write_job(small_job(
        model={"name": "simple_cnn", "num_classes": 2, "kwargs": {"in_channels": 1, "image_size": 8}},
        data={**data, "loader_workers": loader_workers}, scaling={"num_workers": 1}, run={"batch_size": 4})))
    return build_rank_loaders(cfg, rank=0, world_size=1, device=torch.device("cpu"))


@pytest.mark.parametrize("loader_workers", [0, 2])
def test_a_corrupt_image_fails_naming_the_file_and_what_to_do_in_one_line(write_job, folder_with_a_corrupt_image,
                                                                           loader_workers):
    root, bad = folder_with_a_corrupt_image
    train, _, _ = loaders(write_job, {"name": "ImageFolder", "root": str(root), "transforms": {"grayscale": True}},
                          loader_workers)
    with pytest.raises((UnreadableImage, LoaderFailed)) as raised:
        for _ in train:
            pass
    message = str(raised.value)
    assert f"data: {bad} is not a readable image (UnidentifiedImageError" in message
    assert "remove or replace this one" in message
    assert "Traceback" not in message and "\n" not in message


def test_a_killed_loader_worker_ends_the_epoch_with_the_data_loader_named_not_a_hang(write_job):
    """Off the main thread, as in a Ray Train worker (PyTorch's SIGCHLD handler is not installed there): the loader
    notices the dead worker within its status check (5 s), and the error says what died and what to do."""
    import psutil

    # PyTorch installs its SIGCHLD handler when a loader starts on the main thread (an earlier test's did) and
    # leaves it; a Ray Train worker trains on another thread and has none.
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        train, _, _ = loaders(write_job, {"name": "digits"}, loader_workers=2)
        outcome: dict = {}
        # This process's other children (a Ray head an earlier test started, to which this process is connected)
        # must live: only the processes the loader starts are killed.
        others = {child.pid for child in psutil.Process().children()}

        def read() -> None:
            try:
                for index, _ in enumerate(train):
                    if index == 1:
                        workers = [child for child in psutil.Process().children() if child.pid not in others]
                        assert len(workers) == 2, workers
                        for child in workers:
                            os.kill(child.pid, signal.SIGKILL)
                    time.sleep(0.05)
                outcome["finished"] = True
            except Exception as exc:  # kept as text: the exception's frames hold the loader's dead iterator
                outcome["error"] = (type(exc), str(exc))

        reader = threading.Thread(target=read)
        started = time.monotonic()
        reader.start()
        reader.join(60)
        assert not reader.is_alive(), "the loader hung after its worker was killed"
        assert time.monotonic() - started < 30
    finally:
        import gc

        gc.collect()  # the dead iterator shut down, its workers unregistered, before the old handler is back
        signal.signal(signal.SIGCHLD, previous)
    kind, message = outcome.get("error", (None, outcome))
    assert kind is LoaderFailed, message
    assert "the data loader failed: " in message and "a worker process died" in message
    assert "data.loader_workers: 0" in message and "failure.max_failures" in message


@pytest.mark.slow
def test_a_loader_worker_killed_mid_epoch_fails_the_run_with_exit_1_naming_the_data_loader(
        ray_session, tmp_path, monkeypatch, write_job, mlflow_uri, capsys):
    from orchestrator.cli.submit import main
    from test_submit_e2e import only_run

    monkeypatch.chdir(tmp_path)
    job = small_job(precision={"preset": "O0"}, data={"loader_workers": 2}, run={"max_steps_per_epoch": 8},
                    tracking={"uri": mlflow_uri, "experiment": "loader"},
                    callbacks=[drill("KillLoaderWorker", at_step=3)])
    started = time.monotonic()
    rc = main([str(write_job(job))])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert time.monotonic() - started < 240  # a hang is minutes; a loaded 2-core machine takes ~2
    assert "training failed: worker rank 0 raised LoaderFailed: the data loader failed: " in err
    assert "a worker process died" in err
    _, run = only_run(mlflow_uri, "loader")
    assert run.info.status == "FAILED"
