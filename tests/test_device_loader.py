"""`data.loader: device`: the same samples per epoch per rank as the DataLoader path, on the device."""

import pickle

import numpy as np
import pytest
import torch
from torchvision import datasets

from orchestrator.config.schema import DataSection
from orchestrator.train.data import (
    CIFAR_MEAN, CIFAR_STD, DeviceLoader, build_datasets, build_device_loaders, build_loaders, random_crop_flip,
)

CPU = torch.device("cpu")


def epoch_batches(loader, position, epoch, batches_done=0, batch_size=32):
    position.set_position(epoch, batches_done, batch_size)
    return [(x.clone(), y.clone()) for x, y in loader]


@pytest.fixture(scope="module")
def digits():
    return build_datasets(DataSection(name="digits"), num_classes=10)


def loaders(train, test, rank, kind, world_size=2, batch_size=32, augment=False):
    shard = dict(batch_size=batch_size, rank=rank, world_size=world_size, seed=3)
    if kind == "device":
        return build_device_loaders(train, test, augment=augment, device=CPU, **shard)
    return build_loaders(train, test, loader_workers=0, pin_memory=False, **shard)


def test_device_path_gives_each_rank_the_dataloader_batches_and_no_sample_twice(digits):
    train, test = digits
    for epoch in (0, 1):
        seen = []
        for rank in (0, 1):
            reference = epoch_batches(*loaders(train, test, rank, "dataloader")[::2], epoch)
            device_loader, _, position = loaders(train, test, rank, "device")
            batches = epoch_batches(device_loader, position, epoch)
            assert len(batches) == len(reference) == len(device_loader)
            for (x, y), (ref_x, ref_y) in zip(batches, reference):
                assert torch.equal(x, ref_x) and torch.equal(y, ref_y)
            seen.append(torch.cat([x.flatten(1) for x, _ in batches]))
        # No overlap between ranks: no image row appears in both shards; together they cover all but the tail.
        rows = [{row.numpy().tobytes() for row in shard} for shard in seen]
        assert not rows[0] & rows[1]
        assert len(train) - 1 <= len(rows[0]) + len(rows[1]) <= len(train)
    # A different epoch is a different order.
    first, second = (epoch_batches(*loaders(train, test, 0, "device")[::2], e)[0][1] for e in (0, 1))
    assert not torch.equal(first, second)


def test_device_eval_loader_scores_every_eval_sample_once(digits):
    train, test = digits
    labels = torch.cat([y for rank in (0, 1) for _, y in loaders(train, test, rank, "device")[1]])
    assert len(labels) == len(test)
    assert torch.equal(labels.sort().values, test.tensors[1].sort().values)


def test_a_resumed_epoch_continues_with_the_same_augmented_batches(digits):
    train, test = digits
    loader, _, position = loaders(train, test, 1, "device", augment=True)
    loader.split.augment = True  # digits has no augmentation of its own: force it to check the seeding
    whole = epoch_batches(loader, position, 2)
    resumed = epoch_batches(loader, position, 2, batches_done=5)
    assert len(resumed) == len(whole) - 5
    for (x, y), (ref_x, ref_y) in zip(resumed, whole[5:]):
        assert torch.equal(x, ref_x) and torch.equal(y, ref_y)
    assert not torch.equal(whole[0][0], train.tensors[0][:32])


def test_random_crop_flip_is_a_crop_of_the_zero_padded_image_possibly_mirrored():
    images = torch.rand(64, 3, 8, 8)
    out = random_crop_flip(images, torch.Generator().manual_seed(0), padding=2)
    assert out.shape == images.shape
    padded = torch.nn.functional.pad(images, (2, 2, 2, 2))
    offsets, flips = set(), 0
    for i in range(len(images)):
        matches = [(dy, dx, flip) for dy in range(5) for dx in range(5) for flip in (False, True)
                   if torch.equal(out[i], (lambda c: c.flip(2) if flip else c)(padded[i, :, dy:dy + 8, dx:dx + 8]))]
        assert matches, f"sample {i} is not a crop of its padded image"
        offsets.add(matches[0][:2])
        flips += matches[0][2]
    assert len(offsets) > 5 and 10 < flips < 54  # random offsets, about half mirrored


def fake_cifar(root, n_train=40, n_test=20):
    """A tiny dataset in CIFAR-10's on-disk format (the test bypasses torchvision's md5 checks)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, n in [*((f"data_batch_{i}", n_train // 5) for i in range(1, 6)), ("test_batch", n_test)]:
        batch = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), "labels": rng.integers(0, 10, n).tolist()}
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [str(i) for i in range(10)]}))


def test_cifar_on_the_device_is_normalised_like_torchvision_and_augmented_on_the_device(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.cifar, "check_integrity", lambda *args, **kwargs: True)
    fake_cifar(tmp_path)
    cfg = DataSection(name="cifar10", root=str(tmp_path), augment=False)
    train, test = build_datasets(cfg, num_classes=10)
    reference = epoch_batches(*loaders(train, test, 0, "dataloader", batch_size=8)[::2], 0)
    device_loader, _, position = loaders(train, test, 0, "device", batch_size=8)
    assert device_loader.split.images.dtype == torch.uint8  # held as bytes, normalised per batch
    for (x, y), (ref_x, ref_y) in zip(epoch_batches(device_loader, position, 0), reference):
        torch.testing.assert_close(x, ref_x, atol=1e-5, rtol=1e-5)
        assert torch.equal(y, ref_y)

    augmented, _, position = loaders(train, test, 0, "device", batch_size=8, augment=True)
    x, _ = epoch_batches(augmented, position, 0)[0]
    plain = epoch_batches(device_loader, position, 0)[0][0]
    assert x.shape == plain.shape and not torch.equal(x, plain)
    # Padding is black before normalisation: padded pixels read -mean/std, as torchvision's RandomCrop gives.
    black = torch.tensor([-m / s for m, s in zip(CIFAR_MEAN, CIFAR_STD)])

    def has_black_border(image):
        edges = [image[:, 0, :], image[:, -1, :], image[:, :, 0], image[:, :, -1]]
        return any(torch.allclose(edge, black[:, None].expand_as(edge), atol=1e-5) for edge in edges)

    assert any(has_black_border(image) for image in x)
    assert not any(has_black_border(image) for image in plain)


def test_device_loader_rejects_a_dataset_it_cannot_hold():
    from orchestrator.errors import BadInput

    class Listy(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.zeros(3, 32, 32), 0

    with pytest.raises(BadInput, match="data.loader: device"):
        build_device_loaders(Listy(), Listy(), batch_size=2, rank=0, world_size=1, seed=0, augment=False, device=CPU)
    assert DeviceLoader  # the class is public API for custom loops
