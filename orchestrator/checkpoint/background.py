"""Saves in the background, the parts the training loop's asynchronous checkpoints are built from:

- `to_host(state)`: a copy of a checkpoint's state that training may go on changing under: every tensor copied to
  host memory (pinned where it comes from CUDA, so the copy is asynchronous and waited for once), the rest
  deep-copied. It is all the step that checkpoints has to pay for.
- `BackgroundSaves`: one thread that writes (and hashes, and copies to storage) what `to_host` copied, at most one
  save in flight: a second save first waits for the one before, and says how long it waited. A save that failed
  is raised, with its own exception (the cause), at the next `check()` (the next step) or `wait()`.
"""

import copy
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch


def to_host(value: Any) -> Any:
    """`value` (dicts, lists and tuples of tensors and plain values) with every tensor copied to host memory and
    every other leaf deep-copied: nothing in it is shared with the live state."""
    copies: list[torch.Tensor] = []

    def copied(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            if item.device.type == "cuda":
                host = torch.empty(item.shape, dtype=item.dtype, device="cpu", pin_memory=True)
                host.copy_(item.detach(), non_blocking=True)
                copies.append(host)
                return host
            return item.detach().clone()
        if isinstance(item, dict):
            return type(item)((key, copied(entry)) for key, entry in item.items())
        if isinstance(item, (list, tuple)) and not hasattr(item, "_fields"):
            return type(item)(copied(entry) for entry in item)
        return copy.deepcopy(item)

    result = copied(value)
    if copies:
        torch.cuda.synchronize()  # every asynchronous copy from the GPU has landed
    return result


class BackgroundSaves:
    """At most one save in flight, on a thread of its own."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ampflow-checkpoint")
        self.pending: Optional[Future] = None
        self.lock = threading.Lock()

    def submit(self, save: Callable[[], Any]) -> float:
        """Run `save` in the background once the previous save is done; returns the seconds spent waiting for it
        (`time/checkpoint_s` counts them). A failure of the previous save is raised here instead."""
        waited = self.wait()
        with self.lock:
            self.pending = self.pool.submit(save)
        return waited

    def check(self) -> None:
        """Raise the failure of a save that has ended failed (its own exception); nothing while one runs."""
        with self.lock:
            pending = self.pending
        if pending is not None and pending.done():
            self._settle(pending)

    def wait(self) -> float:
        """Wait for the save in flight (raising its failure); returns the seconds waited."""
        with self.lock:
            pending = self.pending
        if pending is None:
            return 0.0
        began = time.perf_counter()
        try:
            pending.result()
        except BaseException:
            pass  # raised below, once
        waited = time.perf_counter() - began
        self._settle(pending)
        return waited

    def close(self) -> None:
        """Wait for every save (raising a failure), then stop the thread."""
        try:
            self.wait()
        finally:
            self.pool.shutdown(wait=True)

    def _settle(self, pending: Future) -> None:
        with self.lock:
            if self.pending is pending:
                self.pending = None
        failure = pending.exception()
        if failure is not None:
            raise failure
