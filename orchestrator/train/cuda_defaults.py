"""The fast defaults on CUDA, resolved per run from the job and the device (docs/performance.md, "Defaults").

Each is a key whose null (or `auto`) value means "on where it is safe and measured to help": on a CUDA device,
never on the CPU (where each either does not apply or was measured slower), and each can be turned off:

- `perf.channels_last: null`: NHWC activations and convolution weights for a model with 2-D convolutions
  (cuDNN's tensor-core kernels are NHWC); off under FSDP, whose shards must be contiguous.
- `optim.implementation: auto`: the fused kernel for the built-in optimizers (sgd, adam, adamw) under DDP, which
  also takes GradScaler's found-inf flag into the kernel: no host read at all in a step.
- `perf.cudnn_benchmark: null`: cuDNN times its convolution algorithms once per input shape and keeps the fastest.
- `data.loader: auto`: a dataset of (inputs, targets) tensors (digits, synthetic, a TensorDataset of yours) is held
  on the device when it takes at most `DEVICE_DATA_SHARE` of the free device memory, with no loader processes,
  collate function or named inputs asked for; else a DataLoader.
- `perf.pinned_transfers: true`: a DataLoader's batches are pinned and copied without blocking.
"""

from typing import Any, Optional

import torch
from torch import nn

from orchestrator.config.optim import OPTIMIZERS
from orchestrator.config.strategies import strategy_named

DEVICE_DATA_SHARE = 0.25
"""`data.loader: auto` holds a dataset on the device when it takes at most this share of the free device memory."""


def cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def channels_last(cfg: Any, model: nn.Module, device: torch.device) -> bool:
    """`perf.channels_last`, null resolved: on CUDA, for a model with a 2-D convolution, not under FSDP."""
    if cfg.perf.channels_last is not None:
        return bool(cfg.perf.channels_last)
    return (cuda(device) and not strategy_named(cfg.scaling.strategy).shards
            and any(isinstance(module, nn.Conv2d) for module in model.modules()))


def fused_optimizer(cfg: Any, device: torch.device) -> bool:
    """Whether `optim.implementation: auto` means the fused kernel: on CUDA, a built-in optimizer, under DDP, and
    no `foreach`/`fused` in `optim.kwargs`."""
    optim = cfg.optim
    return (optim.implementation == "auto" and cuda(device) and optim.name in OPTIMIZERS
            and not strategy_named(cfg.scaling.strategy).shards and not {"fused", "foreach"} & set(optim.kwargs))


def set_cudnn_benchmark(cfg: Any, device: torch.device) -> None:
    """`perf.cudnn_benchmark`, null resolved: on for CUDA (this process's cuDNN setting)."""
    if cuda(device):
        setting = cfg.perf.cudnn_benchmark
        torch.backends.cudnn.benchmark = True if setting is None else bool(setting)


def tensor_bytes(dataset: Any) -> Optional[int]:
    """Bytes of the tensors behind a dataset of (inputs, targets) tensors; None for any other dataset. A dataset that
    says how many it holds on the device says it (`device_bytes()`: `orchestrator.train.data.RepeatedSamples`)."""
    from torch.utils.data import TensorDataset

    if callable(getattr(dataset, "device_bytes", None)):
        return dataset.device_bytes()
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        return sum(t.numel() * t.element_size() for t in dataset.tensors)
    return None


def loader(cfg: Any, datasets: tuple[Any, Any], device: torch.device) -> str:
    """`data.loader`, `auto` resolved: `device` on CUDA for tensor datasets that fit (see the module), else
    `dataloader`."""
    data = cfg.data
    if data.loader != "auto":
        return data.loader
    if not cuda(device) or data.loader_workers or data.collate is not None or cfg.task.inputs \
            or cfg.task.target is not None:
        return "dataloader"
    sizes = [tensor_bytes(dataset) for dataset in datasets]
    if any(size is None for size in sizes):
        return "dataloader"
    free, _ = torch.cuda.mem_get_info(device)
    return "device" if sum(sizes) <= DEVICE_DATA_SHARE * free else "dataloader"
