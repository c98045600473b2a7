"""A loaded job with the parts built from it: its precision policy (`Policy`), its workers (`Workers`), its
strategy (`orchestrator.config.strategies`) and how it walks its data (`layout`, once the training samples are
known).

Each part is built once per config, the first time something asks (`Job.of(cfg)`): the driver's pre-flight,
the MLflow run, the launch, and each worker's own copy of the config (it travels to the workers as a plain
dict) read them from here, never by parsing a section again.
"""

import weakref
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from orchestrator.config.layout import Layout
from orchestrator.config.strategies import StrategyChoice, strategy_named
from orchestrator.config.workers import Workers
from orchestrator.precision.policy import Policy


@dataclass(frozen=True)
class Job:
    """A validated job config (`orchestrator.config.loader.load_job`) and its built parts."""

    cfg: Any
    """The job's config (a read-only DictConfig)."""
    policy: Policy
    """The `precision` section, parsed (`Policy.from_config`)."""
    workers: Workers
    """`scaling.num_workers`: a fixed count, or an elastic `[min, max]`."""
    strategy: StrategyChoice
    """`scaling.strategy` (its training class: `orchestrator.train.strategy.strategy_class`)."""

    @classmethod
    def of(cls, cfg: Any) -> "Job":
        """The parts of `cfg` (a validated job config), built the first time they are asked for and kept as long as
        the config is."""
        built = _BUILT.get(id(cfg))
        if built is None:
            built = (Policy.from_config(cfg.precision), Workers.of(cfg.scaling), strategy_named(cfg.scaling.strategy))
            if isinstance(cfg, DictConfig) and OmegaConf.is_readonly(cfg):  # a read-only config, kept while it lives
                _BUILT[id(cfg)] = built
                weakref.finalize(cfg, _BUILT.pop, id(cfg), None)
        return cls(cfg, *built)

    def layout(self, train_samples: int, world_size: int, total_steps: Optional[int] = None) -> Layout:
        """How the job walks `train_samples` on `world_size` ranks (`total_steps`: a run from the start by default)."""
        return Layout.of(self.cfg, train_samples, world_size, total_steps, workers=self.workers)


_BUILT: dict[int, tuple[Policy, Workers, StrategyChoice]] = {}
"""Each live config's built parts, by the config's id."""
