"""Dtype names as job files write them (`float16`, `fp16`, `bf16`, ...) and as ampflow writes them back
(`float16` in metrics, tags and artifacts)."""

import torch

from orchestrator.errors import BadInput

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}


def parse_dtype(name: str, where: str = "precision.compute_dtype", also: tuple[str, ...] = ()) -> torch.dtype:
    """The torch dtype a job names; BadInput naming `where` and the names it takes (with `also`: more names the key
    takes that are not torch dtypes, handled by the caller)."""
    key = _ALIASES.get(str(name), str(name))
    if key not in DTYPES:
        raise BadInput(f"{where}: unknown dtype '{name}'. Use one of {', '.join((*DTYPES, *also))} "
                       "(or fp32/fp16/bf16).")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float16` -> `float16`, the spelling used in metrics, tags and artifacts."""
    return str(dtype).removeprefix("torch.")
