"""The strategies `scaling.strategy` names, each defined once: DDP (every rank holds the whole model) and FSDP2
(each rank holds shards of it).

What a strategy rules out in the rest of the job is its own (`refusals`), checked when the job is loaded
(`orchestrator.config.validate`). How it wraps, audits, clips, checkpoints and resumes the model is its training
object's (`orchestrator.train.strategy`), found from the choice here, never from the name.
"""

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class StrategyChoice:
    """A value of `scaling.strategy`."""

    name: str
    """What the job file and a checkpoint's manifest call it."""
    shards: bool
    """Each rank holds shards of the model (its parameters, gradients and optimizer state), not the whole of it."""

    def refusals(self, cfg: Any) -> list[tuple[str, str]]:
        """(key, why) for each setting of the job this strategy cannot honour."""
        return []


class Ddp(StrategyChoice):
    """DistributedDataParallel: each rank the whole model, gradients all-reduced."""


class Fsdp(StrategyChoice):
    """torch's FSDP2 (`fully_shard`): each rank a shard of each unit, gathered while the unit computes."""

    def refusals(self, cfg: Any) -> list[tuple[str, str]]:
        refused = []
        if cfg.ddp.comm_hook != "none":
            refused.append(("ddp.comm_hook", (
                f"'{cfg.ddp.comm_hook}' compresses DDP's all-reduce, which scaling.strategy fsdp does not use: FSDP "
                "reduce-scatters gradients in precision.reduce_dtype. Set ddp.comm_hook: none (and "
                "precision.reduce_dtype: bfloat16 to halve the bytes sent).")))
        if cfg.perf.channels_last:
            refused.append(("perf.channels_last", (
                "torch's FSDP2 shards contiguous parameters only, and channels-last convolution weights are not: "
                "with scaling.strategy fsdp set perf.channels_last: false.")))
        return refused


DDP = Ddp("ddp", shards=False)
FSDP = Fsdp("fsdp", shards=True)
STRATEGIES: dict[str, StrategyChoice] = {choice.name: choice for choice in (DDP, FSDP)}
"""Every `scaling.strategy`, by name; the first is the default."""


def strategy_named(name: Any) -> StrategyChoice:
    """The strategy `name` names (KeyError for none: a loaded job's `scaling.strategy` was checked to be one)."""
    return STRATEGIES[name]


def manifest_strategy(manifest: Any) -> Optional[StrategyChoice]:
    """The strategy a checkpoint's manifest says it was written under (`{"strategy": NAME, ...}`; a DDP manifest
    lists only its files); None for a manifest that is not one, or names no strategy ampflow has."""
    if not isinstance(manifest, dict):
        return None
    name = manifest.get("strategy", DDP.name)
    return STRATEGIES.get(name) if isinstance(name, str) else None
