"""A few numbers agreed over all ranks, in one collective each (no-ops in a single process, and in a process group
of one rank)."""

import torch
import torch.distributed as dist


def spans_ranks() -> bool:
    """Whether a collective has other ranks to agree with: a process group of more than one rank.

    A group of one (a single-GPU Ray Train worker, `orchestrator.train.local.spawn` on one rank) makes no collective:
    on a GPU the first NCCL collective builds a communicator (seconds), and each one after it is a kernel and a
    wait that a single-GPU script never pays."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce(values: list[float], device: torch.device, op=dist.ReduceOp.SUM) -> list[float]:
    """Reduce a few numbers over all ranks in one collective."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if spans_ranks():
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
    if world_size == 1 or not spans_ranks():
        return [value]
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, value)
    return gathered
