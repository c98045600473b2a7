"""What to train and on what: the `model` and `data` sections."""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING


@dataclass
class ModelSection:
    name: str = MISSING
    """Registry name (`simple_cnn`, `resnet18`, `three_conv`, `transformer_lm`) or an import path
    `package.module:Name`."""
    num_classes: int = 10
    """Size of the classifier's output layer (>= 1)."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed to the model's constructor."""


@dataclass
class TransformsSection:
    grayscale: bool = False
    """Convert images to one channel (ImageFolder reads every image as RGB)."""
    resize: Optional[int] = None
    """Resize images so the shorter side is this many pixels (null: as they are)."""
    crop: Optional[int] = None
    """Crop to this square size: a random crop for training (with `data.augment`), the centre for evaluation."""
    crop_padding: int = 0
    """Pixels of padding around a random training crop (4 with crop 32 is CIFAR's recipe)."""
    flip: bool = False
    """Random horizontal flips for training (with `data.augment`)."""
    mean: Optional[List[float]] = None
    """Per-channel mean to normalise with (with `std`); null: no normalisation."""
    std: Optional[List[float]] = None
    """Per-channel standard deviation to normalise with."""


@dataclass
class DataSection:
    name: str = MISSING
    """Dataset: `cifar10` (torchvision, with CIFAR's own recipe), `digits` (scikit-learn, offline), `synthetic`,
    `lm_text` (English text in blocks of token ids for a causal LM, offline; its settings in `kwargs`: docs/lm.md),
    a torchvision dataset by name (`MNIST`, `FashionMNIST`, `CIFAR100`, `SVHN`, ...), `ImageFolder` (over
    `root/train` and `root/val`), or an import path `package.module:factory` to your own function returning
    (train dataset, eval dataset)."""
    root: str = "data"
    """Where datasets are stored or downloaded to; relative paths are taken from submit's directory."""
    download: bool = True
    """Download CIFAR-10 into `root` when it is not there yet (needs internet)."""
    augment: bool = True
    """Training augmentation (random crop + horizontal flip for CIFAR-10)."""
    loader_workers: int = 0
    """DataLoader worker processes per Ray worker (0 loads in the training process)."""
    synthetic_samples: int = 4096
    """Number of training samples for `synthetic` (throughput runs only): 4096 distinct random ones, repeated."""
    synthetic_shape: List[int] = field(default_factory=lambda: [3, 32, 32])
    """Shape of one `synthetic` sample (channels, height, width, or any other); CIFAR's by default."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for an import-path dataset factory, or `lm_text`'s settings (`path`, `tokenizer`,
    `vocab_size`, `block_size`, `eval_fraction`)."""
    transforms: TransformsSection = field(default_factory=TransformsSection)
    """Image transforms for torchvision datasets and ImageFolder (ToTensor always)."""
    loader: str = "auto"
    """`auto` (`device` on a CUDA device for a dataset of (inputs, targets) tensors taking at most a quarter of the
    free device memory, with no loader processes, collate function or named inputs; `dataloader` otherwise),
    `dataloader` (torch DataLoader, `loader_workers` processes) or `device`: the whole dataset resident on the
    worker's device, each rank taking its shard, augmentation on the device, no loader processes. `device` holds
    (inputs, targets) tensors of any dtype (a TensorDataset, the built-in datasets); samples that need a collate
    function (`data.collate`) or a batch of named parts (`task.inputs`) need `dataloader`."""
    collate: Optional[str] = None
    """Import path `package.module:fn` to the collate function that turns a list of samples into a batch (e.g.
    padding variable-length sequences), for the training and evaluation loaders and pre-flight; null: each
    dataset's own `collate_fn` attribute when it has one, else torch's default_collate."""
