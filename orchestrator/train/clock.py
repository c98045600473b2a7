"""Where a logging window's wall time went: `time/data_s`, `time/compute_s`, `time/comm_s`, `time/eval_s`,
`time/checkpoint_s` and `time/other_s`, which add up to the window's wall time.

A window is the time between two reads of the loss window (a report with `train/loss`; the first starts when
training does). Its parts:

- `data`: the host waiting for the next batch from the loader;
- `compute`: the optimizer steps (forward, backward, the optimizer), with the gradients' all-reduce or
  reduce-scatter that DDP and FSDP overlap with backward, and its exposed part;
- `comm`: the loop's own exchanges between ranks outside the step: the window's reduction and a report's hand-off
  to the runtime;
- `eval`, `checkpoint`: evaluation, and staging and handing over a checkpoint;
- `other`: the rest (hooks, the first step's audit and FLOP count, logging).

On a CPU every part is timed on the host, where the work runs. On CUDA the host runs ahead of the device, so the
steps are timed by CUDA events recorded on the stream around each step, read when the window is read (the
window's reduction has waited for the device by then): no step waits for the device to be timed. A wait for the
next batch counts as `data` only as far as the device sat idle for it (the gap between the events of the steps
around it); where the host waits for the device inside another part (the window's reduction), that time is the
device's compute and is taken off that part.
"""

import time
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional, TypeVar

import torch

PARTS = ("data", "compute", "comm", "eval", "checkpoint")
"""The measured parts; `other` is what is left of the wall time."""

T = TypeVar("T")


class WindowClock:
    def __init__(self, device: torch.device) -> None:
        self.events = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self.opened = time.perf_counter()
        self.host = dict.fromkeys(PARTS, 0.0)
        self.waits: list[float] = []
        """(CUDA) each step's wait for its batches, in step order."""
        self.steps: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        """(CUDA) each step's start and end events."""
        self.before_first: Optional[torch.cuda.Event] = None
        """(CUDA) the end of the last step of the window before: the device's gap before this window's first step."""

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.host[name] += time.perf_counter() - began

    def batches(self, groups: Iterable[T]) -> Iterator[T]:
        """`groups` as they come, each wait for the next one timed as `data`."""
        iterator = iter(groups)
        while True:
            began = time.perf_counter()
            try:
                group = next(iterator)
            except StopIteration:
                return
            waited = time.perf_counter() - began
            self.host["data"] += waited
            if self.events:
                self.waits.append(waited)
            yield group

    @contextmanager
    def step(self) -> Iterator[None]:
        """One optimizer step: timed on the host (a CPU), or between two events on the stream (CUDA)."""
        if not self.events:
            with self.part("compute"):
                yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            self.steps.append((start, end))

    def read(self) -> dict[str, float]:
        """The window's parts in seconds (`time/<part>_s`, adding up to its wall time), then a new window."""
        wall = time.perf_counter() - self.opened
        parts = dict(self.host)
        if self.events and self.steps:
            parts["compute"] = sum(start.elapsed_time(end) for start, end in self.steps) / 1000
            # The device's idle gap before each step: a wait for data counts as far as it left the device idle.
            previous = [self.before_first, *(end for _, end in self.steps[:-1])]
            gaps = [prior.elapsed_time(start) / 1000 if prior is not None else wait  # the first: no step before
                    for prior, (start, _), wait in zip(previous, self.steps, self.waits)]
            parts["data"] = sum(min(wait, gap) for wait, gap in zip(self.waits, gaps))
            excess = sum(parts.values()) - wall
            for name in ("comm", "data"):  # the host waited for the device there: that was compute
                taken = min(max(excess, 0.0), parts[name])
                parts[name] -= taken
                excess -= taken
            if excess > 0:
                parts["compute"] -= excess
        parts["other"] = max(wall - sum(parts.values()), 0.0)
        last = self.steps[-1][1] if self.steps else self.before_first
        self.reset()
        self.before_first = last
        return {f"time/{name}_s": seconds for name, seconds in parts.items()}
