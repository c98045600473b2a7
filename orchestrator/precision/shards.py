"""This rank's part of a tensor, without importing torch.distributed.tensor.

torch.distributed.tensor (and through it torch.fx's symbolic shapes and sympy) takes seconds to import: a DDP or
single-process run never needs it. No DTensor exists before that module is imported, so whether a tensor is one
is asked only once it has been.
"""

import sys
from typing import Any, Optional

import torch


def is_dtensor(tensor: Any) -> bool:
    """Whether `tensor` is a DTensor (a shard under FSDP)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return tensor.to_local() if is_dtensor(tensor) else tensor
