"""Per-rank system metrics, sampled off the training thread and sent with the rank's next report.

A daemon thread samples the rank's process (CPU %, resident memory) and, on CUDA, its GPU (utilisation,
memory used, power; NVML through `torch.cuda`) every `tracking.system_metrics_interval_s`, sooner while the
rank is young: the wait is a tenth of the time sampled so far, at least `FLOOR_S` and at most the configured
interval, so a run of 11 s draws a line of ~15 points instead of none, and a long run samples as configured. The
loop's
system-metrics hook (`orchestrator.train.hooks.system`) takes the samples at each report (`take`) into the
report's `system_samples`, every rank alike; the controller's relay callback gathers all ranks'
and the driver logs each sample at its own time. Names follow MLflow's system metrics with the rank as
the node (`system/rank_1/cpu_utilization_percentage`), so MLflow's System metrics tab shows them.

The training thread pays one attribute store per step (`step`, the step a sample is logged at).
"""

import logging
import os
import threading
import time
from typing import Any, Optional

import psutil
import torch

logger = logging.getLogger("ampflow.system")

FLOOR_S = 0.5
"""The shortest wait between two samples (unless `tracking.system_metrics_interval_s` asks for shorter)."""

SAMPLES_PER_RUN = 10
"""At least this many samples in any run longer than `SAMPLES_PER_RUN * FLOOR_S`."""


def wait_s(interval_s: float, elapsed_s: float) -> float:
    """The wait before the next sample, `elapsed_s` after sampling began."""
    return min(interval_s, max(FLOOR_S, elapsed_s / SAMPLES_PER_RUN))

def metric_prefix(rank: int) -> str:
    return f"system/rank_{rank}/"


class SystemSampler:
    def __init__(self, rank: int, device: torch.device, interval_s: float):
        self.rank, self.device, self.interval_s = rank, device, interval_s
        self.step = 0
        """The training step samples are logged at (the loop sets it)."""
        self._process = psutil.Process(os.getpid())
        self._process.cpu_percent(None)  # the first call starts the measuring interval and returns 0.0
        self._gpu = self._nvml = device.type == "cuda"
        self._samples: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ampflow-system-metrics", daemon=True)

    def start(self) -> "SystemSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=5)

    def take(self) -> list[dict[str, Any]]:
        """The samples since the last call, oldest first."""
        with self._lock:
            samples, self._samples = self._samples, []
        return samples

    def _run(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(wait_s(self.interval_s, time.monotonic() - started)):
            try:
                sample = {"t": int(time.time() * 1000), "step": self.step, "m": self.sample()}
            except Exception as exc:  # a sensor that fails must never reach training
                logger.warning("ampflow: system metrics of rank %d could not be read (%s); sampling stops.",
                               self.rank, exc)
                return
            with self._lock:
                self._samples.append(sample)

    def sample(self) -> dict[str, float]:
        """One reading, with its MLflow names."""
        with self._process.oneshot():
            values = {"cpu_utilization_percentage": self._process.cpu_percent(None),
                      "memory_rss_megabytes": self._process.memory_info().rss / 1e6}
        if self._gpu:
            values.update(self._gpu_values())
        prefix = metric_prefix(self.rank)
        return {prefix + name: float(value) for name, value in values.items()}

    def _gpu_values(self) -> dict[str, float]:
        free, total = torch.cuda.mem_get_info(self.device)
        values = {"gpu_memory_usage_megabytes": (total - free) / 1e6,
                  "gpu_memory_usage_percentage": 100.0 * (total - free) / total}
        if self._nvml:  # NVML (nvidia-ml-py): utilisation and power; without it, memory only
            try:
                values["gpu_utilization_percentage"] = torch.cuda.utilization(self.device)
                values["gpu_power_usage_watts"] = torch.cuda.power_draw(self.device) / 1000
            except Exception as exc:  # no nvidia-ml-py, no NVML driver, a GPU without the sensor
                logger.warning("ampflow: GPU utilisation and power of rank %d are not sampled (%s).", self.rank, exc)
                self._nvml = False
        return values


def start_sampler(rank: int, device: torch.device, interval_s: float) -> Optional[SystemSampler]:
    """A running sampler, or None when `interval_s` is 0 (off)."""
    return SystemSampler(rank, device, interval_s).start() if interval_s > 0 else None
