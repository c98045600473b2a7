"""Every random number generator a rank uses, seeded, captured and restored (for exact resume).

The states are stored as plain tensors, numbers and strings so a checkpoint holding them still
loads with `torch.load(weights_only=True)`.
"""

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def capture() -> dict[str, Any]:
    version, keys, gauss = random.getstate()
    name, np_keys, position, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "keys": torch.tensor(keys, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(position),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    python = state["python"]
    random.setstate((python["version"], tuple(python["keys"].tolist()), python["gauss"]))
    np_state = state["numpy"]
    np.random.set_state((np_state["name"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
