"""Where the training loop takes and finds its checkpoints: `Checkpointer.save(step, state)`, `load()`, `newest()`.

    checkpointer = Checkpointer(session.checkpoints, attempt)
    state, warnings, training = checkpointer.load(resume)   # the newest checkpoint every rank can read
    checkpointer.save(step, Saved.of(own, state, shapes), strategy.checkpoint_format(optimizer), publish)

What a checkpoint holds is `Saved`: this rank's own part, and on rank 0 the shared train state and the facts the
driver checks a resume against. How it is written is the strategy's format (`FullState`, DDP's full state from rank
0; `DcpShards`, FSDP2's DCP shards, `orchestrator.checkpoint.formats`). `publish(directory, name)` hands the staged
directory over (Ray Train's report, or the Ray-free session's copy): a checkpoint is the newest only once it has
been published whole.
"""

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Sequence, TypeVar

from orchestrator.checkpoint.files import Candidate, dir_name
from orchestrator.checkpoint.resume import CheckpointFacts
from orchestrator.checkpoint.state import RankState, TrainState

Loaded = TypeVar("Loaded")


@dataclass
class Saved:
    """One rank's part of a checkpoint as it is written."""

    own: dict[str, Any]
    """This rank's own part (`RankState`): `rank<r>.pt`."""
    shared: Optional[dict[str, Any]] = None
    """Rank 0: the shared train state (`train_state.pt`); None on the other ranks."""
    facts: Optional[dict[str, Any]] = None
    """Rank 0: what the driver checks a resume against (`ampflow_checkpoint.json`); None on the other ranks."""

    @classmethod
    def of(cls, own: RankState, state: Optional[TrainState] = None,
           model_shapes: Optional[dict[str, list[int]]] = None) -> "Saved":
        """This rank's part; with `state` (rank 0), the shared state and its facts. A state without weights (FSDP:
        they are in the shards) takes its model's whole shapes from `model_shapes`."""
        if state is None:
            return cls(asdict(own))
        facts = CheckpointFacts.of_state(state)
        if not state.model and model_shapes is not None:
            facts.model_shapes = model_shapes
        return cls(asdict(own), state.to_files()[0], facts.to_json())


class Format(Protocol):
    """How a strategy writes its checkpoints (`FullState`, `DcpShards`)."""

    def staged(self, saved: Saved, step: int) -> Any:
        """A context manager: this rank's part written to a staging directory, yielded (a collective under FSDP);
        CheckpointWriteError when it cannot be written, and nothing of it kept."""


class Checkpointer:
    """The run's checkpoints as one rank takes and finds them. `candidates()`: the run's checkpoint directories,
    newest first (the session's); `attempt`: this attempt's number, part of each new directory's name."""

    def __init__(self, candidates: Callable[[], list[Candidate]], attempt: int):
        self.candidates, self.attempt = candidates, attempt
        self.newest_name: Optional[str] = None

    def save(self, step: int, saved: Saved, format: Format, publish: Callable[[Path, str], None]) -> str:
        """Write this rank's part of the checkpoint of `step` and `publish(directory, name)` it; returns its name."""
        name = dir_name(step, self.attempt)
        with format.staged(saved, step) as directory:
            publish(Path(directory), name)
        self.newest_name = name
        return name

    def load(self, resume: Callable[[Sequence[Candidate]], Loaded]) -> Loaded:
        """What `resume` (the strategy's: `orchestrator.train.strategy.resume`) makes of the run's checkpoints."""
        return resume(self.candidates())

    def newest(self) -> Optional[str]:
        """The name of the newest checkpoint this rank saved and published whole in this attempt (None before its
        first)."""
        return self.newest_name
