"""Datasets, per-rank sharding and the model registry."""

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from orchestrator.config.schema import DataSection, ModelSection
from orchestrator.train import data
from orchestrator.train.data import build_datasets, build_loaders, digits_arrays, ensure_available, stratified_split
from orchestrator.train.samplers import ShardSampler
from orchestrator.errors import BadInput, DataUnavailable
from orchestrator.train.models import build_model


def test_digits_are_real_3x32x32_with_a_fixed_stratified_split():
    train, test = build_datasets(DataSection(name="digits"), num_classes=10)
    assert len(train) + len(test) == 1797
    assert len(test) == 360
    x, y = train[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    # Stratified: every class is in the test split in about its share.
    counts = Counter(int(test[i][1]) for i in range(len(test)))
    assert set(counts) == set(range(10)) and min(counts.values()) >= 34
    # Fixed: a second build gives the same split.
    again, _ = build_datasets(DataSection(name="digits"), num_classes=10)
    assert torch.equal(train.tensors[0], again.tensors[0])
    # Disjoint: no test image is also a training image.
    train_rows = {row.numpy().tobytes() for row in train.tensors[0][:, 0, ::4, ::4]}
    assert not any(row.numpy().tobytes() in train_rows for row in test.tensors[0][:, 0, ::4, ::4])


def test_the_digits_are_scikit_learns_read_without_importing_it():
    """The same images and labels as `sklearn.datasets.load_digits`; building the data in a fresh process (as the
    driver's pre-flight and each rank do) leaves scikit-learn unimported."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images, labels = digits_arrays()
    assert torch.equal(images, torch.tensor(digits.images, dtype=torch.float32))
    assert torch.equal(labels, torch.tensor(digits.target, dtype=torch.long))
    script = ("import sys\nfrom orchestrator.config.schema import DataSection\n"
              "from orchestrator.train.data import build_datasets\n"
              "train, test = build_datasets(DataSection(name='digits'), num_classes=10)\n"
              "print(len(train), len(test), 'sklearn' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[1])
    assert done.stdout.split() == ["1437", "360", "False"], done.stderr[-2000:]


def test_the_stratified_split_gives_each_class_its_share_with_the_rounding_to_the_largest_remainders():
    labels = torch.tensor([0] * 5 + [1] * 3 + [2] * 2)  # 4 test samples: shares 2.0, 1.2, 0.8
    train, test = stratified_split(labels, 0.4, seed=0)
    assert Counter(labels[test].tolist()) == {0: 2, 1: 1, 2: 1}
    assert sorted(train.tolist() + test.tolist()) == list(range(10))
    assert torch.equal(test, stratified_split(labels, 0.4, seed=0)[1])
    assert any(not torch.equal(test, stratified_split(labels, 0.4, seed=seed)[1]) for seed in range(1, 5))


def test_digits_without_scikit_learn_is_data_unavailable_saying_what_to_install(monkeypatch):
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataUnavailable, match=r"pip install scikit-learn"):
        digits_arrays()


def test_each_rank_trains_on_its_own_shard_and_eval_covers_every_sample_once():
    train, test = build_datasets(DataSection(name="digits"), num_classes=10)
    seen_train, seen_eval = [], []
    for rank in range(2):
        train_loader, eval_loader, sampler = build_loaders(
            train, test, batch_size=64, rank=rank, world_size=2, seed=0, loader_workers=0, pin_memory=False,
        )
        sampler.set_epoch(0)
        seen_train.append(set(sampler))
        seen_eval.extend(eval_loader.sampler)
    # Disjoint shards of equal size; the odd sample left over is dropped (a different one each epoch), never repeated.
    assert len(train) % 2 == 1 and not seen_train[0] & seen_train[1]
    assert len(seen_train[0]) == len(seen_train[1]) == len(train) // 2
    assert sorted(seen_eval) == list(range(len(test)))


def test_shard_sampler_splits_without_padding():
    shards = [list(ShardSampler(7, rank, 3)) for rank in range(3)]
    assert shards == [[0, 3, 6], [1, 4], [2, 5]]


def test_cifar_missing_without_download_says_where_to_put_it(tmp_path):
    with pytest.raises(DataUnavailable) as info:
        ensure_available(DataSection(name="cifar10", root=str(tmp_path), download=False))
    message = str(info.value)
    assert str(tmp_path) in message and "cifar-10-batches-py" in message and "data.root" in message


def test_synthetic_data_has_the_asked_size():
    train, test = build_datasets(DataSection(name="synthetic", synthetic_samples=128), num_classes=10)
    assert len(train) == 128 and train[0][0].shape == (3, 32, 32)


def test_a_long_synthetic_set_cycles_through_a_bounded_pool_of_distinct_samples():
    """A million samples keep their count, but hold (and cost the time of) SYNTHETIC_DISTINCT; the device path
    still gets one row per sample."""
    from orchestrator.train.data import SYNTHETIC_DISTINCT, device_split

    train, test = build_datasets(DataSection(name="synthetic", synthetic_samples=1_000_000), num_classes=10)
    assert len(train) == 1_000_000 and len(test) == 125_000
    assert train.tensors[0].shape[0] == SYNTHETIC_DISTINCT
    last = len(train) - 1
    assert torch.equal(train[last][0], train[last % SYNTHETIC_DISTINCT][0])
    assert not torch.equal(train[0][0], train[1][0])
    small, _ = build_datasets(DataSection(name="synthetic", synthetic_samples=5000), num_classes=10)
    split = device_split(small, augment=False)
    assert split.images.shape[0] == 5000 and torch.equal(split.images[4999], small[4999][0])


def test_synthetic_samples_take_the_asked_shape():
    train, test = build_datasets(DataSection(name="synthetic", synthetic_samples=64, synthetic_shape=[1, 28, 28]),
                                 num_classes=10)
    assert train[0][0].shape == (1, 28, 28) and test[0][0].shape == (1, 28, 28)


@pytest.mark.parametrize("name, params", [("simple_cnn", 268_650), ("resnet18", 11_173_962)])
def test_registry_models_take_32x32_and_give_logits(name, params):
    model = build_model(ModelSection(name=name, num_classes=10))
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert sum(p.numel() for p in model.parameters()) == params


@pytest.mark.parametrize("name, kwargs", [("simple_cnn", {"in_channels": 1, "image_size": 28}),
                                          ("resnet18", {"in_channels": 1})])
def test_registry_models_take_one_channel_28x28_through_their_kwargs(name, kwargs):
    model = build_model(ModelSection(name=name, num_classes=7, kwargs=kwargs))
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 7)


def test_import_path_model_from_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "mynets_local.py").write_text(
        "import torch.nn as nn\n"
        "def Tiny(num_classes, hidden=8):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, hidden), nn.Linear(hidden, num_classes))\n"
    )
    monkeypatch.chdir(tmp_path)
    model = build_model(ModelSection(name="mynets_local:Tiny", num_classes=4, kwargs={"hidden": 5}))
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 4)
    assert model[1].out_features == 5


def test_model_kwargs_that_do_not_fit_are_bad_input():
    with pytest.raises(BadInput, match="model.kwargs"):
        build_model(ModelSection(name="simple_cnn", kwargs={"depth": 3}))


@pytest.mark.parametrize("total_steps", [1, 2, 3, 4, 5, 8, 1000])
def test_onecycle_schedule_runs_for_any_number_of_steps(total_steps):
    from orchestrator.config.schema import OptimSection
    from orchestrator.train.optim import build_scheduler

    param = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scheduler = build_scheduler(OptimSection(schedule="onecycle", lr=0.1), optimizer, total_steps)
    rates = []
    for _ in range(total_steps):
        optimizer.step()
        scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
    if total_steps >= 4:  # warms up to the peak, then anneals below where it started
        assert max(rates) == pytest.approx(0.1) and rates[-1] < rates[0]
