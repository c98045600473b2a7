"""The step watchdog (`failure.step_timeout_s`): a rank that makes no progress ends its attempt, stacks saved.

Progress is any of: the loop's start (`setup`), the end of a step (`after_step`), the end of an evaluation or a
report about to be handed over (`collect`, `end_epoch`), a checkpoint staged (`on_checkpoint`). Each only stores
a timestamp. A daemon thread sleeps until the newest timestamp plus the timeout; when it wakes and nothing
moved, it writes every thread's Python stack of this process, the training thread's first, to
`diagnostics/stacks/<attempt>/rank<r>.txt` in the run's storage (`Session.write_diagnostic`), waits
`GRACE_S` so that peers blocked with it write theirs too, and ends the process with `STALLED_EXIT`:
Ray Train sees a worker failure (`failure.max_failures` restarts from the newest checkpoint).

The first line of each file is `# watchdog {json}`: the rank, the step it was in, the seconds it waited,
where the training thread was (`at`: the innermost frame outside Python's standard library) and whether it
was waiting on its peers (`in_collective`: its innermost frame is in torch.distributed, DDP, autograd's
engine or Ray Train's synchronisation). The driver (`orchestrator.runner.stalls`) names as stalled the ranks
not waiting on their peers, and the ranks that wrote nothing (stopped, dead, or holding the GIL).
"""

import json
import os
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

from orchestrator.train.hooks import Hook

STALLED_EXIT = 75
"""The exit status of a process its watchdog ended (sysexits' EX_TEMPFAIL: a retry may succeed)."""
COLLECTIVE_MARGIN_S = 60
"""The collective timeout is `step_timeout_s` plus this: a rank waiting on a stuck peer is caught by its watchdog
first, with its stack, never by a collective's own error."""
GRACE_S = 2.0
"""How long a rank whose watchdog fired waits, its stack written, before it ends: its peers' watchdogs, whose
last progress was the same step's end, fire meanwhile and write theirs before the attempt is torn down."""
STACKS = "diagnostics/stacks"
HEADER = "# watchdog "

_STDLIB = sysconfig.get_paths()["stdlib"]
_COLLECTIVE_PATHS = ("/torch/distributed/", "/torch/nn/parallel/", "/torch/autograd/",
                     "/ray/train/v2/_internal/execution/", "/ray/train/collective/", "/ray/_private/worker.py")


class StepStalled(RuntimeError):
    """A run ended by its watchdog (the Ray-free loop's error; through Ray the driver says the same)."""


def collective_timeout_s(step_timeout_s: Optional[float]) -> Optional[int]:
    """The process group's timeout for a step timeout; None (torch's default) without one."""
    return None if step_timeout_s is None else int(step_timeout_s) + 1 + COLLECTIVE_MARGIN_S


def in_collective(filename: str) -> bool:
    return any(part in filename.replace(os.sep, "/") for part in _COLLECTIVE_PATHS)


def _own_code(filename: str) -> bool:
    return not filename.startswith(_STDLIB) or "site-packages" in filename


def where(frames: traceback.StackSummary) -> Optional[str]:
    """`file:line in function` of the innermost frame outside the standard library."""
    for frame in reversed(frames):
        if _own_code(frame.filename):
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return None


def stack_text(rank: int, step: int, waited_s: float, training_thread: Optional[int]) -> str:
    """The header line, then every thread's stack (most recent call last), the training thread's first."""
    frames = sys._current_frames()
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    training = traceback.extract_stack(frames[training_thread]) if training_thread in frames else None
    header = {"rank": rank, "step": step, "waited_s": round(waited_s, 1),
              "at": where(training) if training else None,
              "in_collective": bool(training) and in_collective(training[-1].filename)}
    blocks = [HEADER + json.dumps(header)]
    ordered = sorted(frames, key=lambda ident: ident != training_thread)
    for ident in ordered:
        if ident == threading.get_ident():
            continue  # the watchdog's own thread
        role = " (training)" if ident == training_thread else ""
        blocks.append(f"\nThread {names.get(ident, ident)}{role}:\n"
                      + "".join(traceback.format_list(traceback.extract_stack(frames[ident]))))
    return "\n".join(blocks) + "\n"


def read_header(text: str) -> Optional[dict[str, Any]]:
    """The `# watchdog` line of a stack file; None when it has none."""
    first = text.split("\n", 1)[0]
    if not first.startswith(HEADER):
        return None
    try:
        return json.loads(first[len(HEADER):])
    except ValueError:
        return None


class Watchdog(Hook):
    name = "watchdog"

    def __init__(self, timeout_s: Optional[float], exit: Callable[[int], Any] = os._exit):
        """`timeout_s`: `failure.step_timeout_s` (None: no watchdog). `exit`: what ends the process."""
        self.timeout_s, self.exit = timeout_s, exit
        self.last = time.monotonic()
        self.step = 0
        self.stopped = threading.Event()
        self.thread: Optional[threading.Thread] = None

    def setup(self, loop) -> None:
        if self.timeout_s is None:
            return
        self.loop, self.training_thread = loop, threading.get_ident()
        self.last, self.step = time.monotonic(), loop.global_step
        self.thread = threading.Thread(target=self.watch, name="ampflow-watchdog", daemon=True)
        self.thread.start()

    # Progress: one timestamp each.
    def after_step(self, loop, step) -> None:
        self.last = time.monotonic()

    def collect(self, loop, report) -> None:
        self.last = time.monotonic()

    def end_epoch(self, loop, report) -> None:
        self.last = time.monotonic()

    def on_checkpoint(self, loop, directory, name) -> None:
        self.last = time.monotonic()

    def teardown(self, loop) -> None:
        self.stopped.set()

    def watch(self) -> None:
        while not self.stopped.wait(max(0.0, self.last + self.timeout_s - time.monotonic())):
            waited = time.monotonic() - self.last
            if waited >= self.timeout_s:
                self.fire(waited)
                return

    def fire(self, waited_s: float) -> None:
        loop = self.loop
        step = loop.global_step  # the step being trained (counted at its start), or the last one
        text = stack_text(loop.rank, step, waited_s, self.training_thread)
        relative = f"{STACKS}/{loop.attempt}/rank{loop.rank}.txt"
        header = read_header(text)
        print(f"ampflow watchdog: rank {loop.rank} made no progress for {waited_s:.0f} s (step {step}) at "
              f"{header['at']}; ending this attempt (stacks: {relative})", file=sys.__stderr__, flush=True)
        try:
            write = getattr(loop.session, "write_diagnostic", None)
            if write is not None:
                write(relative, text)
            else:
                sys.__stderr__.write(text)
        except Exception as exc:  # storage itself may be what is stuck: the attempt still ends
            print(f"ampflow watchdog: the stacks could not be written ({type(exc).__name__}: {exc})",
                  file=sys.__stderr__, flush=True)
        time.sleep(GRACE_S)
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                stream.flush()
            except Exception:
                pass
        self.exit(STALLED_EXIT)


def _short(at: Optional[str]) -> str:
    if not at:
        return "an unknown place"
    path, _, rest = at.partition(":")
    return f"{os.path.basename(path)}:{rest}"


@dataclass
class Stall:
    """One attempt's stacks, read back: which ranks stalled and where."""

    headers: dict[int, dict[str, Any]]
    """Each rank that wrote a stack: its `# watchdog` line."""
    world_size: int

    @classmethod
    def of(cls, texts: dict[int, str], world_size: int) -> "Stall":
        headers = {rank: header for rank, text in texts.items() if (header := read_header(text)) is not None}
        return cls(headers, world_size)

    @property
    def stalled(self) -> list[int]:
        """The ranks that wrote nothing, and those not waiting on their peers; every rank when all of them
        waited in a collective (then none can be told apart)."""
        named = [rank for rank in range(self.world_size)
                 if rank not in self.headers or not self.headers[rank]["in_collective"]]
        return named or list(range(self.world_size))

    def cause(self, stacks_at: str) -> str:
        """One line: the stalled rank(s), how long and where; e.g. `rank 1 made no progress for 30 s at
        model.py:42 in forward (stacks: diagnostics/stacks/)`."""
        waited = max((header["waited_s"] for header in self.headers.values()), default=0.0)
        parts = []
        for rank in self.stalled:
            header = self.headers.get(rank)
            if header is None:
                parts.append(f"rank {rank} made no progress and wrote no stack (stopped, killed, or holding the "
                             f"GIL) while its peers waited for it for {waited:.0f} s")
            elif header["in_collective"]:
                parts.append(f"rank {rank} waited in a collective for {header['waited_s']:.0f} s at "
                             f"{_short(header['at'])}")
            else:
                parts.append(f"rank {rank} made no progress for {header['waited_s']:.0f} s at "
                             f"{_short(header['at'])}")
        return f"{'; '.join(parts)} (stacks: {stacks_at})"
