"""How the model is spread over the ranks (`scaling.strategy`): DDP or FSDP2, each one class behind one set of methods.

Pre-flight (`check_plan`), the training build (`orchestrator.train.training`), the step (`no_sync`, `clip`), the
loop's checkpoints (`checkpoint_format`, `resume`) and the final model (`load_trained_weights`) call a strategy;
only the strategy knows whether each rank holds the whole model (`DdpStrategy`) or its shards (`FsdpStrategy`,
`orchestrator.train.fsdp_strategy`). The job's choice (`orchestrator.config.strategies`) finds its class
(`strategy_class`), and nothing else tells the two apart:

| method | DDP | FSDP |
| --- | --- | --- |
| `prepare(model, precision)` | `Precision.prepare`, then DDP (Ray Train's `prepare_model`) | `fully_shard` per unit |
| `named_optimizer_params()` | the fp32 masters where there are some, else the parameters | this rank's shards |
| `no_sync()` | DDP's `no_sync` | no reduce-scatter |
| `clip(optimizer, max_norm)` | the norm of the rank's (whole) gradients | the norm over every rank's shards |
| `checkpoint_state` | fp32 weights and the optimizer in train_state.pt | none there: the shards in `sharded/` (DCP) |
| `checkpoint_format(optimizer)` | `FullState`: rank 0 writes it whole | `DcpShards`: every rank its shards |
| `snapshot_state` (rollback, promotion) | the same | this rank's shards |
| `full_state_dict()` | the fp32 weights (any rank) | gathered to rank 0's CPU (a collective) |
| `check_plan(cfg, model, batch)` (pre-flight) | the policy kept on a CPU copy | attention blocks unsplit, the units planned |
| `resume(...)` (before the build) | the state holds weights and optimizer | the build first, then the shards |
| `load_trained_weights(directory, model)` | from train_state.pt | the shards read whole |

Each strategy object belongs to one build of the model (a rollback or promotion builds a new one).
"""

import json
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence, TypeVar

import torch
from torch import nn

from orchestrator.config.job import Job
from orchestrator.config.strategies import DDP, FSDP, StrategyChoice, manifest_strategy
from orchestrator.precision import Precision
from orchestrator.precision.blocks import apply_blocks, check_block_rules, compile_options
from orchestrator.precision.guarded_step import clip as clip_gradients
from orchestrator.precision.kept import check_policy_kept
from orchestrator.checkpoint.checkpointer import Format
from orchestrator.checkpoint.files import Candidate, load_newest_valid, manifest_file, read_checkpoint
from orchestrator.checkpoint.formats import FullState
from orchestrator.train.collectives import all_agree
from orchestrator.train.ddp import Wrap, ddp_wrap
from orchestrator.checkpoint.state import TrainState

Built = TypeVar("Built")
"""What a resume builds from the state it found (`orchestrator.train.training.Training`)."""


class IncompatibleStrategy(ValueError):
    """A checkpoint written under another `scaling.strategy` than the job's (its manifest says which)."""


class Strategy(Protocol):
    choice: StrategyChoice

    def prepare(self, model: nn.Module, precision: Precision) -> nn.Module: ...

    def named_optimizer_params(self) -> list[tuple[str, torch.Tensor]]: ...

    def no_sync(self) -> AbstractContextManager: ...

    def clip(self, optimizer: torch.optim.Optimizer, max_norm: Optional[float]) -> Optional[torch.Tensor]: ...

    def load_weights(self, model: nn.Module, state: TrainState) -> None: ...

    def load_state(self, optimizer: torch.optim.Optimizer, state: TrainState) -> None: ...

    def checkpoint_state(self, precision: Precision, optimizer: torch.optim.Optimizer
                         ) -> tuple[dict[str, Any], dict[str, Any]]: ...

    def snapshot_state(self, precision: Precision, optimizer: torch.optim.Optimizer
                       ) -> tuple[dict[str, Any], dict[str, Any]]: ...

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...

    def checkpoint_format(self, optimizer: torch.optim.Optimizer) -> Format: ...


class DdpStrategy:
    """Every rank holds the whole model: the precision policy casts it (with fp32 masters where it says so), then
    DistributedDataParallel wraps it (`wrap`: Ray Train's `prepare_model` on a Ray Train worker)."""

    choice = DDP

    def __init__(self, cfg: Any, rank: int, wrap: Optional[Wrap] = None):
        self.rank, self.wrap = rank, wrap or ddp_wrap(cfg)
        self.compile_options = compile_options(cfg.perf)
        self.model: Optional[nn.Module] = None
        self.precision: Optional[Precision] = None

    @classmethod
    def build(cls, cfg: Any, device: torch.device, rank: int, world_size: int, wrap: Optional[Wrap] = None
              ) -> "DdpStrategy":
        return cls(cfg, rank, wrap)

    # -- before the build: pre-flight, resuming, the trained model ------------------------------------------------

    @staticmethod
    def check_plan(cfg: Any, model: nn.Module, batch: Any = None) -> None:
        """Pre-flight: the policy can be kept, on a copy of the model cast and run on `batch` (the first training
        batch; nothing checked without one)."""
        if batch is not None:
            check_policy_kept(cfg, model, batch, Job.of(cfg).policy)

    @staticmethod
    def resume(candidates: Sequence[Candidate], rank: int, world_size: int, device: torch.device,
               build: Callable[[Optional[TrainState]], Built], agree: Callable[[bool], bool]
               ) -> tuple[Optional[TrainState], list[str], Built]:
        """The state holds the weights and the optimizer, and the build loads them."""
        state, warnings = load_newest_valid(candidates, rank, agree)
        return state, warnings, build(state)

    @staticmethod
    def load_trained_weights(directory: Path, model: nn.Module) -> TrainState:
        """The fp32 weights from rank 0's train_state.pt."""
        state = read_checkpoint(directory, rank=0)
        model.load_state_dict(state.model)
        return state

    # -- the built model -----------------------------------------------------------------------------------------

    def prepare(self, model: nn.Module, precision: Precision) -> nn.Module:
        """The policy's dtypes, then the rules' activation checkpointing and compilation, then DDP."""
        precision.prepare(model)
        apply_blocks(model, precision.plans, self.compile_options)
        self.precision, self.model = precision, self.wrap(model)
        return self.model

    def named_optimizer_params(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.precision.named_tensors)

    def no_sync(self) -> AbstractContextManager:
        return self.model.no_sync() if hasattr(self.model, "no_sync") else nullcontext()

    def clip(self, optimizer: torch.optim.Optimizer, max_norm: Optional[float]) -> Optional[torch.Tensor]:
        return clip_gradients(optimizer, max_norm)

    def load_weights(self, model: nn.Module, state: TrainState) -> None:
        """Before `prepare`: the fp32 weights (the masters are taken from them, then the policy casts)."""
        model.load_state_dict(state.model)

    def load_state(self, optimizer: torch.optim.Optimizer, state: TrainState) -> None:
        optimizer.load_state_dict(state.optimizer)

    def checkpoint_state(self, precision: Precision, optimizer: torch.optim.Optimizer
                         ) -> tuple[dict[str, Any], dict[str, Any]]:
        return precision.fp32_state_dict(), optimizer.state_dict()

    snapshot_state = checkpoint_state

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.precision.fp32_state_dict()

    def checkpoint_format(self, optimizer: torch.optim.Optimizer) -> FullState:
        """The full state from rank 0 (`train_state.pt`), each rank its own part."""
        return FullState(self.rank)


def strategy_class(choice: StrategyChoice) -> type:
    """The class of a `scaling.strategy` (`DdpStrategy`, `FsdpStrategy`)."""
    if choice is FSDP:
        from orchestrator.train.fsdp_strategy import FsdpStrategy  # torch's FSDP: seconds to import, FSDP runs only

        return FsdpStrategy
    return DdpStrategy


def job_strategy(cfg: Any) -> type:
    """The class of the job's `scaling.strategy`."""
    return strategy_class(Job.of(cfg).strategy)


def make_strategy(cfg: Any, device: torch.device, rank: int, world_size: int, wrap: Optional[Wrap] = None
                  ) -> Strategy:
    """The job's `scaling.strategy` for one build of the model. `wrap` (DDP only): how the cast model is wrapped."""
    return job_strategy(cfg).build(cfg, device, rank, world_size, wrap)


# -- which strategy wrote a checkpoint ------------------------------------------------------------------------

def _rank0_manifest(directory: Path) -> Any:
    """Rank 0's manifest in a checkpoint directory; None when it is missing or not JSON."""
    try:
        return json.loads((Path(directory) / manifest_file(0)).read_text())
    except (OSError, ValueError):
        return None


def written_under(directory: Path) -> Optional[str]:
    """The `scaling.strategy` a checkpoint directory was written under, from rank 0's manifest (a DDP manifest lists
    only files); None when there is no readable manifest (an incomplete checkpoint: its loader says so)."""
    manifest = _rank0_manifest(directory)
    if not isinstance(manifest, dict):
        return None
    strategy = manifest.get("strategy", DDP.name)
    return strategy if isinstance(strategy, str) else None


def _checked(where: str, open_directory: Callable[[], AbstractContextManager[str]], strategy: StrategyChoice
             ) -> Callable[[], AbstractContextManager[str]]:
    @contextmanager
    def opened() -> Iterator[str]:
        with open_directory() as directory:
            written = manifest_strategy(_rank0_manifest(Path(directory)))
            if written is not None and written is not strategy:
                raise IncompatibleStrategy(
                    f"checkpoint {where} was written under scaling.strategy {written.name}, and this job trains under "
                    f"{strategy.name}: the strategy cannot change within a run. Resume it with "
                    f"scaling.strategy={written.name}, or start the job afresh (without --resume).")
            yield directory

    return opened


# -- resuming ---------------------------------------------------------------------------------------------------

def resume(cfg: Any, candidates: Sequence[Candidate], rank: int, world_size: int, device: torch.device,
           build: Callable[[Optional[TrainState]], Built]
           ) -> tuple[Optional[TrainState], list[str], Built]:
    """The newest checkpoint every rank can read, and the training built from it (`build(state)`; afresh without
    one): (its state, a warning for each newer one skipped, the training). A collective.

    Each strategy resumes its own way (`DdpStrategy.resume`, `FsdpStrategy.resume`). A checkpoint written under
    the other strategy is refused (IncompatibleStrategy) rather than skipped: every checkpoint of the run was.
    """
    strategy = Job.of(cfg).strategy
    candidates = [(where, _checked(where, opener, strategy)) for where, opener in candidates]
    return job_strategy(cfg).resume(candidates, rank, world_size, device, build, lambda ok: all_agree(ok, device))


# -- the trained model, on the driver ------------------------------------------------------------------------------

def load_trained_weights(checkpoint: Any, model: nn.Module) -> TrainState:
    """Load a (verified) checkpoint's fp32 weights into `model`, the job's plain model built in this process (the
    driver: the logged MLflow model, the export); returns the checkpoint's train state (the inputs it trained on;
    under FSDP without the model and optimizer, which its shards hold). The strategy that wrote it reads it
    (`DdpStrategy.load_trained_weights`, `FsdpStrategy.load_trained_weights`). `checkpoint`: anything with
    `as_directory()`, as Ray Train's Checkpoint."""
    with checkpoint.as_directory() as opened:
        directory = Path(opened)
        written = manifest_strategy(_rank0_manifest(directory))
        return strategy_class(written or DDP).load_trained_weights(directory, model)


# -- pre-flight ------------------------------------------------------------------------------------------------------

def check_plan(cfg: Any, model: nn.Module, batch: Any = None) -> None:
    """Pre-flight (on the CPU model), each strategy its own: under DDP the policy kept on a cast copy of the model run
    on `batch` (the first training batch); under FSDP the units and their policies can be planned. A rule FSDP
    cannot honour, a `scaling.fsdp.wrap` glob matching no module holding parameters, a model's `fsdp_units`
    naming no submodule, or a rule that checkpoints or compiles matching no module is BadInput naming it."""
    check_block_rules(model, Job.of(cfg).policy)
    job_strategy(cfg).check_plan(cfg, model, batch)
