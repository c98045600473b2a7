"""A few numbers agreed over all ranks, in one collective each (no-ops in a single process)."""

import torch
import torch.distributed as dist


def all_reduce(values: list[float], device: torch.device, op=dist.ReduceOp.SUM) -> list[float]:
    """Reduce a few numbers over all ranks in one collective."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def per_rank(value: float, rank: int, world_size: int, device: torch.device) -> list[float]:
    """Every rank's `value`, in rank order (one all-reduce of a one-hot vector)."""
    values = [0.0] * world_size
    values[rank] = value
    return all_reduce(values, device)


def all_agree(ok: bool, device: torch.device) -> bool:
    """Whether `ok` holds on every rank."""
    return all_reduce([float(ok)], device, op=dist.ReduceOp.MIN)[0] == 1.0


def all_gather(value, world_size: int) -> list:
    """Every rank's `value` (any picklable object), in rank order; for the rare paths that need more than
    numbers (a failure's description on each rank)."""
    if not (dist.is_available() and dist.is_initialized()) or world_size == 1:
        return [value]
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, value)
    return gathered
