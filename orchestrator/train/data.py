"""Datasets by name, and the per-rank loaders the worker iterates.

`cifar10` is downloaded by torchvision where the network allows; `digits` is
scikit-learn's real 8x8 digits served as 3x32x32 so CIFAR models run unchanged;
`synthetic` is random tensors of `data.synthetic_shape`, for throughput only; `lm_text` is English text in
fixed-length blocks of token ids for a causal language model (`orchestrator.train.text`).

Two ways to feed a rank (`data.loader`): a torch DataLoader over its shard, or `DeviceLoader`, which
keeps the whole split on the worker's device and slices batches out of it (no loader processes, no
host-to-device copies per step). Both walk the same `ResumableSampler` order (an elastic run's: `ElasticSampler`),
so they give every rank the same samples in the same order.
"""

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

from orchestrator.config.imports import is_import_path, resolve_import_path
from orchestrator.config.names import TORCHVISION_DATASETS, check_dataset_name
from orchestrator.config.job import Job
from orchestrator.errors import BadInput, DataUnavailable
from orchestrator.train import cuda_defaults, text, vision
from orchestrator.train.batch import Batches, BatchLayout
from orchestrator.train.samplers import Elastic, ElasticSampler, ResumableSampler, ShardSampler, train_shard

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
DIGITS_SPLIT_SEED = 0  # the digits split is fixed, whatever the job's seed
DIGITS_TEST_FRACTION = 0.2


def _user_datasets(data_cfg) -> tuple[Dataset, Dataset]:
    """`data.name: package.module:factory`: `factory(**data.kwargs)` returns (train, eval), map-style Datasets
    yielding (input, target) pairs."""
    factory = resolve_import_path(data_cfg.name, "data.name", kind="dataset factory")
    made = factory(**data_cfg.kwargs)
    if not (isinstance(made, (tuple, list)) and len(made) == 2
            and all(hasattr(d, "__getitem__") and hasattr(d, "__len__") for d in made)):
        raise BadInput(f"data.name: {data_cfg.name} must return (train dataset, eval dataset), two map-style "
                       f"datasets (with __getitem__ and __len__); it returned {type(made).__name__}.")
    return made[0], made[1]


def _cifar_files_present(root: Path) -> bool:
    return (root / "cifar-10-batches-py" / "data_batch_1").is_file()


def _cifar_unavailable(root: Path, reason: str) -> DataUnavailable:
    return DataUnavailable(
        f"data: CIFAR-10 is not in {root} and could not be downloaded ({reason}). "
        f"On a machine with internet, run once: python -c \"import torchvision; "
        f"torchvision.datasets.CIFAR10('{root}', download=True)\"; or download "
        "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz and extract it so that "
        f"{root}/cifar-10-batches-py/data_batch_1 exists. Set data.root to use another directory."
    )


def ensure_available(data_cfg) -> None:
    """Driver-side check before Ray starts: the dataset can be had (downloading it if allowed)."""
    check_dataset_name(data_cfg.name)
    if data_cfg.name in TORCHVISION_DATASETS:
        vision.build(data_cfg)  # downloads when allowed; DataUnavailable says where to put the files
        return
    if data_cfg.name != "cifar10":
        return
    root = Path(data_cfg.root)
    if _cifar_files_present(root):
        return
    if not data_cfg.download:
        raise _cifar_unavailable(root, "data.download is false")
    from torchvision.datasets import CIFAR10  # torchvision: seconds to import, only cifar10 needs it

    try:
        CIFAR10(str(root), train=True, download=True)
    except Exception as exc:  # network errors come in many types (URLError, socket, SSL)
        raise _cifar_unavailable(root, f"{type(exc).__name__}: {exc}") from None


def _cifar10(data_cfg) -> tuple[Dataset, Dataset]:
    from torchvision import datasets, transforms  # torchvision: seconds to import, only cifar10 needs it

    root = Path(data_cfg.root)
    if not _cifar_files_present(root):
        raise _cifar_unavailable(root, "files missing on this worker's node")
    normalize = [transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)]
    augment = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()] if data_cfg.augment else []
    train = datasets.CIFAR10(str(root), train=True, transform=transforms.Compose(augment + normalize))
    test = datasets.CIFAR10(str(root), train=False, transform=transforms.Compose(normalize))
    return train, test


def _digits() -> tuple[Dataset, Dataset]:
    images, labels = digits_arrays()
    images = images / 16.0  # 0..16 -> 0..1
    # 8x8 -> 32x32 by pixel repetition, grey -> 3 channels, then standardise.
    images = images.repeat_interleave(4, dim=1).repeat_interleave(4, dim=2)
    images = images.unsqueeze(1).expand(-1, 3, -1, -1).contiguous()
    images = (images - images.mean()) / images.std()
    train_idx, test_idx = stratified_split(labels, DIGITS_TEST_FRACTION, DIGITS_SPLIT_SEED)
    return (
        TensorDataset(images[train_idx], labels[train_idx]),
        TensorDataset(images[test_idx], labels[test_idx]),
    )


def digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits: 1797 8x8 images (float32, 0..16) and their labels (int64), read from the file
    scikit-learn ships, which its `load_digits` reads too. scikit-learn itself is not imported: that takes 2-4 s,
    in every process that builds the data (the driver's pre-flight and each rank), for a 1797-line file."""
    found = importlib.util.find_spec("sklearn")  # where the package is, without running it
    path = Path(found.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz" if found else None
    if path is None or not path.is_file():
        raise DataUnavailable(f"data.name: digits is read from scikit-learn's digits.csv.gz, not found "
                              f"({path or 'scikit-learn is not installed'}). Install scikit-learn "
                              "(pip install scikit-learn) in the environment that trains.")
    table = torch.from_numpy(np.loadtxt(path, delimiter=",", dtype=np.float32))
    return table[:, :-1].reshape(-1, 8, 8).contiguous(), table[:, -1].long()


def stratified_split(labels: torch.Tensor, test_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, test) indices, each sorted: `ceil(test_fraction * n)` test samples, each class giving its share of
    them (the rounding goes to the largest remainders, the lower class on a tie), drawn by a permutation seeded
    with `seed`, so the split is the same in every process."""
    generator = torch.Generator().manual_seed(seed)
    classes, counts = labels.unique(return_counts=True)
    n_test = math.ceil(test_fraction * len(labels))
    shares = counts.double() * n_test / len(labels)
    take = shares.floor().long()
    take[torch.argsort(take - shares, stable=True)[:n_test - int(take.sum())]] += 1
    test = torch.cat([(labels == label).nonzero().flatten()[torch.randperm(int(count), generator=generator)[:k]]
                      for label, count, k in zip(classes, counts, take.tolist())])
    in_train = torch.ones(len(labels), dtype=torch.bool)
    in_train[test] = False
    return in_train.nonzero().flatten(), test.sort().values


SYNTHETIC_DISTINCT = 4096
"""Distinct random samples per `synthetic` split; a longer split repeats them. Throughput needs the shape and the
count, not new noise: a million CIFAR-sized samples would otherwise take 12 GB and seconds to generate in every
process that builds the data (pre-flight on the driver, each worker)."""


class RepeatedSamples(TensorDataset):
    """`length` samples cycling through the tensors' rows (`tensors` holds the distinct ones)."""

    def __init__(self, *tensors: torch.Tensor, length: int):
        super().__init__(*tensors)
        self.length = length

    def __getitem__(self, index: int):
        return super().__getitem__(index % len(self.tensors[0]))

    def __len__(self) -> int:
        return self.length

    def device_bytes(self) -> int:
        """Bytes of every sample held on the device (`orchestrator.train.cuda_defaults.loader`)."""
        return sum(t[0].numel() * t.element_size() for t in self.tensors) * len(self)


def _synthetic(data_cfg, num_classes: int) -> tuple[Dataset, Dataset]:
    generator = torch.Generator().manual_seed(1234)
    n_train, n_eval = data_cfg.synthetic_samples, max(data_cfg.synthetic_samples // 8, 64)
    splits = []
    for n in (n_train, n_eval):
        distinct = min(n, SYNTHETIC_DISTINCT)
        x = torch.randn(distinct, *data_cfg.synthetic_shape, generator=generator)
        y = torch.randint(0, num_classes, (distinct,), generator=generator)
        splits.append(RepeatedSamples(x, y, length=n))
    return splits[0], splits[1]


def build_datasets(data_cfg, num_classes: int) -> tuple[Dataset, Dataset]:
    check_dataset_name(data_cfg.name)
    if is_import_path(data_cfg.name):
        return _user_datasets(data_cfg)
    if data_cfg.name in TORCHVISION_DATASETS:
        return vision.build(data_cfg)
    if data_cfg.name == "cifar10":
        return _cifar10(data_cfg)
    if data_cfg.name == "digits":
        return _digits()
    if data_cfg.name == text.NAME:
        return text.lm_text(data_cfg)
    return _synthetic(data_cfg, num_classes)


def collate_fn(data_cfg, dataset: Dataset) -> Optional[Callable[[list], Any]]:
    """How a list of samples becomes a batch: `data.collate`, else the dataset's own `collate_fn` attribute, else
    None (torch's default_collate)."""
    if data_cfg.collate is not None:
        return resolve_import_path(data_cfg.collate, "data.collate", kind="collate function")
    own = getattr(dataset, "collate_fn", None)
    return own if callable(own) else None


def collate_source(data_cfg, dataset: Dataset) -> str:
    """Where the collate function of `dataset` comes from, as a message names it."""
    if data_cfg.collate is not None:
        return f"data.collate ({data_cfg.collate})"
    if collate_fn(data_cfg, dataset) is not None:
        return f"the collate_fn of data.name {data_cfg.name}'s {type(dataset).__name__}"
    return f"torch's default_collate (data.collate is null and {type(dataset).__name__} has no collate_fn)"


def build_loaders(
    train: Dataset, test: Dataset, *, batch_size: int, rank: int, world_size: int, seed: int,
    loader_workers: int, pin_memory: bool, collate: tuple[Optional[Callable], Optional[Callable]] = (None, None),
    elastic: Optional[Elastic] = None,
) -> tuple[DataLoader, DataLoader, Union[ResumableSampler, ElasticSampler]]:
    """Per-rank DataLoaders (`collate`: the train and eval sets' collate functions, None for torch's default);
    call `position.set_position(epoch, batches_done, batch_size)` each epoch. `elastic`: an elastic run's order."""
    train_sampler = train_shard(train, rank, world_size, seed, batch_size, elastic)
    # Own generators: creating an iterator must not draw from the global RNG, or a resumed run
    # would see a different global RNG state than the uninterrupted one.
    common = dict(num_workers=loader_workers, pin_memory=pin_memory,
                  persistent_workers=loader_workers > 0, generator=torch.Generator().manual_seed(seed + rank))
    if isinstance(train_sampler, ElasticSampler):  # it yields each micro-batch's indices
        train_loader = DataLoader(train, batch_sampler=train_sampler, collate_fn=collate[0], **common)
    else:
        train_loader = DataLoader(train, sampler=train_sampler, batch_size=batch_size, drop_last=False,
                                  collate_fn=collate[0], **common)
    test_loader = DataLoader(test, sampler=ShardSampler(len(test), rank, world_size), batch_size=batch_size,
                             collate_fn=collate[1], **common)
    return train_loader, test_loader, train_sampler


# -- the device-resident path (`data.loader: device`) ---------------------------------------------


@dataclass
class DeviceSplit:
    """One split as tensors: images (uint8 0..255 or float, NCHW) and labels, plus how to finish a batch."""

    images: torch.Tensor
    labels: torch.Tensor
    mean_std: Optional[tuple[Sequence[float], Sequence[float]]] = None
    """Images stored as uint8 0..255, scaled to 0..1 and normalised per channel per batch after augmentation
    (CIFAR-10's); None: the tensors are served as they are, any dtype (token ids stay int64)."""
    augment: bool = False
    """CIFAR-10's training augmentation: random crop with 4 pixels of zero padding, and horizontal flip."""

    def to(self, device: torch.device) -> "DeviceSplit":
        return DeviceSplit(self.images.to(device), self.labels.to(device), self.mean_std, self.augment)


def device_refusal(dataset: Dataset) -> Optional[str]:
    """Why `data.loader: device` cannot hold `dataset` (None when it can): it takes (inputs, targets) tensors."""
    if isinstance(dataset, TensorDataset):
        if len(dataset.tensors) == 2:
            return None
        return f"a TensorDataset of {len(dataset.tensors)} tensors (it takes two: inputs and targets)"
    from torchvision.datasets import CIFAR10  # torchvision: seconds to import; tensors never get here

    return None if isinstance(dataset, CIFAR10) else f"a {type(dataset).__name__}"


def device_split(dataset: Dataset, *, augment: bool) -> DeviceSplit:
    """The tensors behind a dataset this module built: a TensorDataset (digits, synthetic) or torchvision's CIFAR10."""
    if isinstance(dataset, RepeatedSamples):  # on the device, as many rows as samples (the loader slices them)
        rows = torch.arange(len(dataset)) % len(dataset.tensors[0])
        return DeviceSplit(dataset.tensors[0][rows], dataset.tensors[1][rows])
    if isinstance(dataset, TensorDataset) and device_refusal(dataset) is None:
        return DeviceSplit(dataset.tensors[0], dataset.tensors[1])
    from torchvision.datasets import CIFAR10  # torchvision: seconds to import; tensors never get here

    if isinstance(dataset, CIFAR10):  # .data is N x 32 x 32 x 3 uint8: kept as uint8 on the device (4x smaller)
        images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()
        return DeviceSplit(images, torch.tensor(dataset.targets, dtype=torch.long), (CIFAR_MEAN, CIFAR_STD), augment)
    raise BadInput(f"data.loader: device cannot hold {device_refusal(dataset)}; use data.loader: dataloader.")


def random_crop_flip(images: torch.Tensor, generator: torch.Generator, padding: int = 4) -> torch.Tensor:
    """Per sample: a random crop of the zero-padded image (as torchvision's RandomCrop(padding=4)) and a
    horizontal flip with probability 1/2 (RandomHorizontalFlip), all in one gather on the device."""
    n, c, h, w = images.shape
    device = images.device
    padded = F.pad(images, (padding, padding, padding, padding))
    dy = torch.randint(0, 2 * padding + 1, (n,), device=device, generator=generator)
    dx = torch.randint(0, 2 * padding + 1, (n,), device=device, generator=generator)
    flip = torch.rand(n, device=device, generator=generator) < 0.5
    rows = dy[:, None] + torch.arange(h, device=device)
    cols = dx[:, None] + torch.arange(w, device=device)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    batch = torch.arange(n, device=device)[:, None, None, None]
    channel = torch.arange(c, device=device)[None, :, None, None]
    return padded[batch, channel, rows[:, None, :, None], cols[:, None, None, :]]


class DeviceLoader:
    """Batches of one rank's shard sliced out of a device-resident split.

    Walks `sampler` (the same one the DataLoader path uses) in batches of `batch_size`, the last one
    partial. Augmentation draws from a generator seeded by (seed, rank, epoch, batch), so a batch is
    the same whether or not the run was interrupted before it.
    """

    def __init__(self, split: DeviceSplit, sampler: Sampler[int], *, batch_size: int, seed: int, rank: int):
        self.split, self.sampler, self.batch_size = split, sampler, batch_size
        self.seed, self.rank = seed, rank
        self.epoch, self.first_batch = 0, 0
        self.generator = torch.Generator(device=split.images.device)
        if split.mean_std is not None:
            mean, std = (torch.tensor(v, device=split.images.device).view(1, -1, 1, 1) for v in split.mean_std)
            self.mean, self.std = mean, std

    def set_position(self, epoch: int, batches_done: int, batch_size: int) -> None:
        """As `ResumableSampler.set_position`: the epoch, and how many of its batches were already trained on."""
        self.epoch, self.first_batch = epoch, batches_done
        self.sampler.set_position(epoch, batches_done, batch_size)

    @property
    def dataset(self) -> Dataset:
        return self.sampler.dataset

    def __len__(self) -> int:
        if isinstance(self.sampler, ElasticSampler):
            return len(self.sampler)
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        device = self.split.images.device
        if isinstance(self.sampler, ElasticSampler):  # micro-batches of indices
            for number, indices in enumerate(self.sampler, start=self.first_batch):
                yield self._batch(torch.tensor(indices, dtype=torch.long, device=device), number)
            return
        order = torch.tensor(list(self.sampler), dtype=torch.long, device=device)
        for number, start in enumerate(range(0, len(order), self.batch_size), start=self.first_batch):
            yield self._batch(order[start:start + self.batch_size], number)

    def _batch(self, indices: torch.Tensor, number: int) -> tuple[torch.Tensor, torch.Tensor]:
        images = self.split.images.index_select(0, indices)
        if self.split.mean_std is not None:
            images = images.float().div_(255)
        if self.split.augment:
            self.generator.manual_seed(hash((self.seed, self.rank, self.epoch, number)) & (2**63 - 1))
            images = random_crop_flip(images, self.generator)
        if self.split.mean_std is not None:
            images = (images - self.mean) / self.std
        return images, self.split.labels.index_select(0, indices)


def build_device_loaders(
    train: Dataset, test: Dataset, *, batch_size: int, rank: int, world_size: int, seed: int, augment: bool,
    device: torch.device, elastic: Optional[Elastic] = None,
) -> tuple[DeviceLoader, DeviceLoader, DeviceLoader]:
    """`data.loader: device`: both splits moved to `device` once; returns (train, eval, position) like build_loaders."""
    train_loader = DeviceLoader(device_split(train, augment=augment).to(device),
                                train_shard(train, rank, world_size, seed, batch_size, elastic),
                                batch_size=batch_size, seed=seed, rank=rank)
    eval_loader = DeviceLoader(device_split(test, augment=False).to(device), ShardSampler(len(test), rank, world_size),
                               batch_size=batch_size, seed=seed, rank=rank)
    return train_loader, eval_loader, train_loader


def build_rank_loaders(cfg, rank: int, world_size: int, device: torch.device) -> tuple[Batches, Batches, Any]:
    """One rank's (train batches, eval batches, position) as the job's `data` and `task` sections ask: each loader
    yields `Batch`es, and the train loader's `position.set_position(epoch, batches_done, batch_size)` starts an
    epoch where a checkpoint left off."""
    train_set, eval_set = build_datasets(cfg.data, cfg.model.num_classes)
    workers = Job.of(cfg).workers
    elastic = Elastic(cfg.run.accumulate_steps, workers.max) if workers.elastic else None
    shard = dict(batch_size=cfg.run.batch_size, rank=rank, world_size=world_size, seed=cfg.run.seed, elastic=elastic)
    if cuda_defaults.loader(cfg, (train_set, eval_set), device) == "device":  # batches are slices there: no copies
        train, evaluation, position = build_device_loaders(train_set, eval_set, augment=cfg.data.augment,
                                                           device=device, **shard)
    else:
        train, evaluation, position = build_loaders(
            train_set, eval_set, loader_workers=cfg.data.loader_workers, pin_memory=device.type == "cuda" and cfg.perf.pinned_transfers,
            collate=(collate_fn(cfg.data, train_set), collate_fn(cfg.data, eval_set)), **shard)
    layout = BatchLayout.from_task(cfg.task)
    return Batches(train, layout), Batches(evaluation, layout), position
