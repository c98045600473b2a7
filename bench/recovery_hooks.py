"""The hook bench.recovery's runs train with: the run pauses at a step where the harness strikes."""

import json
import os
import time
from pathlib import Path


class PauseAt:
    def __init__(self, rank: int, at_step: int, marker: str, wait_s: float = 120.0):
        """At `at_step`, `rank` writes `{"pid", "node_id"}` to `marker` (once) and waits inside the step until its
        process gets a preemption notice or `wait_s` passes (its node is removed meanwhile)."""
        self.rank, self.at_step, self.marker, self.wait_s = rank, at_step, marker, wait_s

    def before_step(self, loop, step) -> None:
        if loop.rank != self.rank or step.number != self.at_step or Path(self.marker).exists():
            return
        import ray

        from orchestrator.train.preemption import Notice

        Path(self.marker + ".tmp").write_text(json.dumps({"pid": os.getpid(),
                                                          "node_id": ray.get_runtime_context().get_node_id()}))
        os.replace(self.marker + ".tmp", self.marker)
        deadline = time.monotonic() + self.wait_s
        while Notice.received_at is None and time.monotonic() < deadline:
            time.sleep(0.05)
