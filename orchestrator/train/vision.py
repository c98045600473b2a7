"""torchvision datasets by name (`data.name: MNIST`, `FashionMNIST`, `CIFAR100`, `SVHN`, ...) and `ImageFolder`
over `data.root/train` and `data.root/val`, with the transforms `data.transforms` asks for.

Downloads go to `data.root` when `data.download` is on and the network allows; where it does not, the
error says where to put the files, as for CIFAR-10.
"""

from pathlib import Path

from PIL import Image
from torch.utils.data import Dataset

from orchestrator.config.names import IMAGE_FOLDER, TORCHVISION_SPLIT_BY as SPLIT_BY
from orchestrator.errors import DataUnavailable

SPLIT_NAMES = {"SVHN": ("train", "test"), "STL10": ("train", "test"), "Flowers102": ("train", "val"),
               "DTD": ("train", "val"), "GTSRB": ("train", "test")}


def unavailable(name: str, root: Path, reason: str) -> DataUnavailable:
    """The one message for a torchvision dataset that is not there and cannot be downloaded."""
    return DataUnavailable(
        f"data: {name} is not in {root} and could not be downloaded ({reason}). On a machine with internet, run "
        f"once: python -c \"import torchvision; torchvision.datasets.{name}('{root}', download=True)\" and copy "
        f"{root} here, or set data.root to where the files are (data.download: true downloads them when the "
        "network allows).")


class UnreadableImage(ValueError):
    """A file of an ImageFolder tree that is not a readable image (truncated, garbage bytes): named, with what to
    do, instead of PIL's traceback."""


def read_image(path: str):
    """An ImageFolder image as RGB (torchvision's own loader does the same), or UnreadableImage naming the file."""
    try:
        with open(path, "rb") as handle:
            return Image.open(handle).convert("RGB")
    except (OSError, ValueError, SyntaxError) as exc:  # PIL: UnidentifiedImageError, truncated data, bad headers
        raise UnreadableImage(
            f"data: {path} is not a readable image ({type(exc).__name__}: {exc}). ImageFolder reads every file under "
            f"data.root/train and data.root/val as an image: remove or replace this one, then run the job again (or "
            f"--resume it).") from None


def transforms_for(cfg, train: bool):
    from torchvision import transforms as T  # torchvision: seconds to import; train.data imports this module always

    t = cfg.transforms
    steps = [T.Grayscale(1)] if t.grayscale else []
    steps += [T.Resize(t.resize)] if t.resize else []
    if t.crop:
        steps.append(T.RandomCrop(t.crop, padding=t.crop_padding) if train and cfg.augment else T.CenterCrop(t.crop))
    if t.flip and train and cfg.augment:
        steps.append(T.RandomHorizontalFlip())
    steps.append(T.ToTensor())
    if t.mean is not None:
        steps.append(T.Normalize(list(t.mean), list(t.std)))
    return T.Compose(steps)


def build(cfg) -> tuple[Dataset, Dataset]:
    """(train, eval) for a torchvision `data.name` (`config.names.TORCHVISION_DATASETS`); DataUnavailable when
    the files are not there."""
    from torchvision import datasets  # torchvision: seconds to import; train.data imports this module always

    root, name = Path(cfg.root), cfg.name
    train_tf, eval_tf = transforms_for(cfg, train=True), transforms_for(cfg, train=False)
    if name == IMAGE_FOLDER:
        missing = [str(root / part) for part in ("train", "val") if not (root / part).is_dir()]
        if missing:
            raise DataUnavailable(f"data: ImageFolder needs {root}/train and {root}/val, one sub-directory per class "
                                  f"(missing: {', '.join(missing)}). Set data.root to the directory that holds them.")
        return (datasets.ImageFolder(str(root / "train"), transform=train_tf, loader=read_image),
                datasets.ImageFolder(str(root / "val"), transform=eval_tf, loader=read_image))
    cls = getattr(datasets, name)
    try:
        if SPLIT_BY[name] == "train":
            return (cls(str(root), train=True, transform=train_tf, download=cfg.download),
                    cls(str(root), train=False, transform=eval_tf, download=cfg.download))
        train_split, eval_split = SPLIT_NAMES[name]
        return (cls(str(root), split=train_split, transform=train_tf, download=cfg.download),
                cls(str(root), split=eval_split, transform=eval_tf, download=cfg.download))
    except RuntimeError as exc:  # torchvision: "Dataset not found. You can use download=True to download it"
        raise unavailable(name, root, str(exc) if not cfg.download else f"{type(exc).__name__}: {exc}") from None
    except OSError as exc:  # the download itself failed (URLError, socket, SSL errors are OSErrors)
        raise unavailable(name, root, f"{type(exc).__name__}: {exc}") from None

