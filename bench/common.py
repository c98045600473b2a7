"""What every harness shares: its command line, interleaved timing, the printed table, the JSON record.

Imports only the standard library and torch, so every harness (the GPU one included) can use it on
a machine without Ray or MLflow.
"""

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch


def parser(harness: str, description: str) -> argparse.ArgumentParser:
    """The options every harness has: --smoke (tiny, CPU, for CI) and --json PATH."""
    cli = argparse.ArgumentParser(prog=f"python -m bench.{harness}", description=description)
    cli.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (seconds, for CI): checks it runs, "
                                                          "not the figures")
    cli.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    return cli


def with_device(cli: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `--device cpu|cuda` (for harnesses that run in one process)."""
    cli.add_argument("--device", default="cpu", help="cpu or cuda")
    return cli


def chosen_device(args: argparse.Namespace) -> Optional[torch.device]:
    """The `--device` asked for; None (after saying why on stderr) when it is CUDA and torch sees none."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return None
    return device


def command_line(harness: str) -> str:
    return " ".join([f"python -m bench.{harness}", *sys.argv[1:]])


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    threads = torch.get_num_threads()
    return f"cpu: {platform.processor() or platform.machine()}, torch threads {threads}"


def synchronize(device: torch.device) -> Callable[[], None]:
    """What makes a wall-clock reading mean "the work is done" on `device`."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def interleaved(candidates: dict[str, Callable[[], None]], *, warmup: int, repeats: int, steps: int,
                sync: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """Seconds per step of each candidate, one figure per repeat.

    Every candidate first runs `warmup` untimed steps. Then each of `repeats` rounds runs every
    candidate for `steps` steps in turn, the order rotated each round so that no candidate always
    follows the same one (caches, allocator, clock boost): slow drift of the machine hits all of them.
    """
    for step in candidates.values():
        for _ in range(warmup):
            step()
    sync()
    names = list(candidates)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            step = candidates[name]
            sync()
            started = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            times[name].append((time.perf_counter() - started) / steps)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: list[float]) -> float:
    """(max - min) / median of the repeats: how far apart the repeats were."""
    if len(values) < 2:
        return 0.0
    middle = median(values)
    return (max(values) - min(values)) / middle if middle else float("nan")


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def meets(value: float, target: str) -> Optional[bool]:
    """Whether `value` meets a target written as '>= 0.97' or '<= 1.03'; None when it cannot say."""
    op, _, bound = target.partition(" ")
    if not finite(value):
        return None
    return value >= float(bound) if op == ">=" else value <= float(bound)


def print_table(columns: list[str], rows: list[list[Any]]) -> None:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in text)) if text else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in text:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def finish(harness: str, *, device: str, config: dict[str, Any], figures: dict[str, Any],
           ratios: dict[str, float], targets: dict[str, str], json_path: Optional[str]) -> dict[str, Any]:
    """Print the ratio lines (with their targets) and write the JSON record when asked."""
    for name, value in ratios.items():
        target = targets.get(name)
        verdict = ""
        if target is not None:
            ok = meets(value, target)
            verdict = f"  (target {target}: {'met' if ok else 'MISSED' if ok is not None else 'n/a'})"
        print(f"ratio {name} = {value:.4f}{verdict}")
    record = {"harness": harness, "device": device, "torch": torch.__version__, "config": config,
              "figures": figures, "ratios": ratios, "targets": targets, "command": command_line(harness)}
    if json_path:
        write_json(json_path, record)
    return record


def write_json(path: str, record: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=2, default=str) + "\n")


def job_config(job: dict, overrides: Sequence[str] = ()):
    """A job dict (plus `key=value` overrides) resolved through the loader `submit` uses: presets, schema, checks."""
    import yaml

    from orchestrator.config import load_job

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.yaml"
        path.write_text(yaml.safe_dump(job, sort_keys=False))
        return load_job(path, overrides, base_dir=Path(tmp))


class LoopStepper:
    """The worker's training loop (`orchestrator.train.loop.TrainingLoop`, one process, no Ray) stepped on batches
    the harness chooses: `step(inputs, targets)` is exactly what the loop does per optimizer step (its hooks, the
    schedule, the loss window, compilation once audited), `report()` what it does per report up to handing it
    over (the window read, every hook's `collect`). Its system-metrics hook runs, sampling every
    `tracking.system_metrics_interval_s`."""

    def __init__(self, cfg, device: torch.device):
        from orchestrator.train.local import LocalSession
        from orchestrator.train.loop import TrainingLoop

        self.directory = tempfile.TemporaryDirectory(prefix="bench-loop-")
        session = LocalSession(0, 1, device, Path(self.directory.name))  # nothing is checkpointed
        self.loop = TrainingLoop(cfg, session)
        self.loop.hooks.call("setup", self.loop)
        self.training = self.loop.training

    def step(self, inputs: torch.Tensor, targets: torch.Tensor):
        from orchestrator.train.batch import Batch
        from orchestrator.train.step import Step

        loop = self.loop
        loop.global_step += 1
        return loop.train_step(Step(loop.global_step, 0, loop.global_step - 1, [Batch.pair(inputs, targets)]))

    def report(self):
        loop = self.loop
        loop.training.precision.settle()  # as the loop does before a report: every step's flags read
        report = loop.new_report(0)
        report.metrics.update(loop.read_window())
        loop.seq += 1
        report.seq = loop.seq
        loop.hooks.call("collect", loop, report)
        return report

    def close(self) -> None:
        self.loop.hooks.call("teardown", self.loop)
        self.directory.cleanup()
