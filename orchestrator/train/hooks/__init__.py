"""Hooks: everything around the training step that is not the step itself.

A hook is an object with any of the methods of `Hook`; the loop calls them on every rank, in the order the
hooks were given (built-in ones first, the job's `callbacks` last):

    setup(loop)                       once, before the first step (after a resume)
    before_step(loop, step)           at the start of each optimizer step (`step`: `orchestrator.train.step.Step`)
    after_backward(loop, step)        after the step's backward passes, before the optimizer step: the
                                      gradients are there, `step.loss` is what the step decides on
    after_step(loop, step)            after the optimizer step, taken or skipped (`step.outcome`)
    end_epoch(loop, report)           the epoch's last report, after evaluation
    collect(loop, report)             every report, just before it is handed over
    on_checkpoint(loop, directory, name)  this rank's part of a checkpoint is staged in `directory`, to be
                                      stored as `name`: add files, or look at it
    state_dict() / load_state_dict(state)  what the hook keeps in this rank's part of checkpoints (plain
                                      types and tensors)
    teardown(loop)                    once, when training ends, also when it fails

A hook that makes a collective call (an all-reduce) must run on every rank and make it at the same point:
the built-in memory hook does (peaks over ranks). `rank_zero_only = True` runs a hook on rank 0 alone.
The loop's own attributes a hook may read: `loop.training` (model, optimizer, precision), `loop.cfg`,
`loop.rank`, `loop.world_size`, `loop.device`, `loop.global_step`, `loop.steps_per_epoch`, `loop.total_steps`,
`loop.eval_loader` (docs/own-code.md#callbacks).
"""

import sys
from pathlib import Path
from typing import Any, Iterable, Optional

from orchestrator.common.report import Report

TrainingLoop = Any
"""The `orchestrator.train.loop.TrainingLoop` calling a hook (not imported: the loop imports the hooks)."""
Step = Any
"""The optimizer step a hook is called around (`orchestrator.train.step.Step`)."""

class Hook:
    """A base class with every hook method doing nothing; subclass it and override what you need (or write a
    class with only the methods you need: the loop calls what a hook has)."""

    rank_zero_only: bool = False
    """Run on rank 0 only (it must then make no collective call)."""

    def setup(self, loop: TrainingLoop) -> None: ...

    def before_step(self, loop: TrainingLoop, step: Step) -> None: ...

    def after_backward(self, loop: TrainingLoop, step: Step) -> None: ...

    def after_step(self, loop: TrainingLoop, step: Step) -> None: ...

    def end_epoch(self, loop: TrainingLoop, report: Report) -> None: ...

    def collect(self, loop: TrainingLoop, report: Report) -> None: ...

    def on_checkpoint(self, loop: TrainingLoop, directory: Path, name: str) -> None: ...

    def state_dict(self) -> Optional[dict[str, Any]]:
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def teardown(self, loop: TrainingLoop) -> None: ...


def hook_name(hook: Any) -> str:
    """A hook's name in checkpoints and messages: `name` if it has one, else its class's qualified name."""
    return getattr(hook, "name", None) or f"{type(hook).__module__}.{type(hook).__qualname__}"


class Hooks:
    """The hooks of one loop, called in order; a method a hook lacks is skipped."""

    def __init__(self, hooks: Iterable[Any], rank: int):
        self.hooks = [hook for hook in hooks if rank == 0 or not getattr(hook, "rank_zero_only", False)]

    def call(self, method: str, *args: Any) -> None:
        for hook in self.hooks:
            function = getattr(hook, method, None)
            if function is not None:
                function(*args)

    def call_every(self, method: str, *args: Any) -> None:
        """Call `method` on every hook even when one raises (teardown after a failure); what they raise is
        printed, not raised: the failure that got here is the one the run reports."""
        for hook in self.hooks:
            function = getattr(hook, method, None)
            try:
                if function is not None:
                    function(*args)
            except Exception as exc:
                print(f"warning: {hook_name(hook)} also raised in {method}: {type(exc).__name__}: {exc}",
                      file=sys.stderr)

    def state_dicts(self) -> dict[str, Any]:
        """Each hook's checkpoint state, by hook name (hooks without state are left out)."""
        states = {}
        for hook in self.hooks:
            state = hook.state_dict() if hasattr(hook, "state_dict") else None
            if state is not None:
                states[hook_name(hook)] = state
        return states

    def load_state_dicts(self, states: dict[str, Any]) -> None:
        for hook in self.hooks:
            if hook_name(hook) in states and hasattr(hook, "load_state_dict"):
                hook.load_state_dict(states[hook_name(hook)])
