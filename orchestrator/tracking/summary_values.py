"""Values a run page shows as one line, not as a chart: counters that stayed put and values set once.

MLflow charts every metric, so a counter that stays 0 all run (`amp/nan_loss_steps`), a value reported once
(`perf/time_to_first_step_s`) or one that never changes (`system/world_size`, `memory/params_bytes`) is a chart
of one dot or a flat line that says less than a number would. The writer (`orchestrator.tracking.writer`) holds
back the keys named here (`held`): while a key keeps its first value nothing is logged; meanwhile it is a run
tag of the same name (`amp/nan_loss_steps: 0`), written with its first report, which MLflow's run overview lists.
Once it changes, the tag goes, and its held value (at its first and its last step before the change) and every
later value are logged as the metric, under the same name, so a counter that moves is charted as before; memory
reads in MiB there (`memory/params_bytes: 1.02 MiB (1074600 B)`), and a memory metric that is charted gets a
`..._mib` twin beside its `..._bytes`.

`values(metrics, tags)` gives a run's numbers either way: its metrics, and its summary values read back.
"""

import math
import re
from typing import Mapping, Optional

HELD_KEYS = frozenset({
    "amp/growth_events", "amp/nan_loss_steps", "amp/nonfinite_grad_steps", "amp/rank_disagreements",
    "amp/skipped_steps", "amp/consecutive_skips", "amp/skip_rate", "perf/time_to_first_step_s", "system/world_size",
})
"""Counters and values set once: charted only once they change."""

HELD_PREFIXES = ("memory/",)
"""Whole families held the same way (memory by dtype is mostly fixed for a run; its peaks move)."""

MIB = 2**20


def held(key: str) -> bool:
    return key in HELD_KEYS or key.startswith(HELD_PREFIXES)


def mib_key(key: str) -> Optional[str]:
    """The MiB twin of a memory metric in bytes (`memory/peak_bytes` -> `memory/peak_mib`), else None."""
    if key.startswith("memory/") and key.endswith("_bytes"):
        return key.removesuffix("_bytes") + "_mib"
    return None


def with_mib(metrics: dict[str, float]) -> dict[str, float]:
    """`metrics` and, for each memory metric in bytes, its value in MiB."""
    twins = {mib_key(key): value / MIB for key, value in metrics.items() if mib_key(key) is not None}
    return {**metrics, **twins}


def tag_text(key: str, value: float) -> str:
    """How a summary value reads as a tag: the number (an integer without `.0`), memory with its MiB."""
    number = f"{value:.0f}" if math.isfinite(value) and value == int(value) else f"{value:.6g}"
    if mib_key(key) is not None:  # the readable part first: the run page cuts a long tag short
        return f"{readable_bytes(value)} ({number} B)"
    return number


def readable_bytes(value: float) -> str:
    """Bytes as a person reads them: MiB, or KiB below a hundredth of one (`1284` -> `1.3 KiB`)."""
    return f"{value / MIB:.2f} MiB" if abs(value) >= MIB / 100 else f"{value / 1024:.1f} KiB"


def tag_value(text: str) -> Optional[float]:
    """The number a summary tag holds (`tag_text` read back: the bytes of a memory value), or None when the text
    is not one."""
    exact = re.search(r"\(([^ ]+) B\)$", text)
    try:
        return float(exact.group(1) if exact else text.split(" ", 1)[0])
    except (ValueError, IndexError):
        return None


def summary_tags(tags: Mapping[str, str]) -> dict[str, float]:
    """The summary values among a run's tags, as numbers."""
    found = {key: tag_value(text) for key, text in tags.items() if held(key)}
    return {key: value for key, value in found.items() if value is not None}


def values(metrics: Mapping[str, float], tags: Mapping[str, str]) -> dict[str, float]:
    """A run's latest numbers: its metrics, and its summary values (a metric of the same name wins)."""
    return {**summary_tags(tags), **metrics}


class Held:
    """The writer's account of the held keys of one run."""

    def __init__(self) -> None:
        self.first: dict[str, tuple[int, int, float]] = {}
        """Each held key not yet logged: (step, timestamp ms, value) of its first report."""
        self.last: dict[str, tuple[int, int]] = {}
        """(step, timestamp ms) of its newest report with that same value."""
        self.moved: set[str] = set()
        """Held keys that changed: logged as metrics from then on."""
        self.tagged: set[str] = set()
        """The held keys whose summary tag the run has (written with the key's first report, or left by an earlier
        attempt): removed once their key moves."""

    def copy(self) -> "Held":
        other = Held()
        other.first, other.last, other.moved = dict(self.first), dict(self.last), set(self.moved)
        other.tagged = set(self.tagged)
        return other

    def resume(self, metric_keys, tags: Mapping[str, str]) -> None:
        """A resumed run: its held keys already charted stay charted, its summary values are held again."""
        self.moved.update(key for key in metric_keys if held(key))
        for key, value in summary_tags(tags).items():
            if key not in self.moved:
                self.tagged.add(key)
                self.first[key] = (0, 0, value)
                self.last[key] = (0, 0)

    def split(self, step: int, timestamp: int, metrics: dict[str, float]) -> list[tuple[int, int, dict[str, float]]]:
        """The batches to log for one report's fresh `metrics`: (step, timestamp, metrics), oldest first (a
        held key that just changed brings its held value at its first and last step before this one)."""
        now: dict[str, float] = {}
        earlier: dict[tuple[int, int], dict[str, float]] = {}
        for key, value in metrics.items():
            if not held(key) or key in self.moved:
                now[key] = value
                continue
            if key not in self.first:
                self.first[key], self.last[key] = (step, timestamp, value), (step, timestamp)
                continue
            first_step, first_time, first_value = self.first[key]
            if value == first_value or (math.isnan(value) and math.isnan(first_value)):
                self.last[key] = (step, timestamp)
                continue
            self.moved.add(key)
            del self.first[key]
            last = self.last.pop(key)
            earlier.setdefault((first_step, first_time), {})[key] = first_value
            if last != (first_step, first_time):
                earlier.setdefault(last, {})[key] = first_value
            now[key] = value
        batches = [(s, t, with_mib(m)) for (s, t), m in sorted(earlier.items())]
        if now:
            batches.append((step, timestamp, with_mib(now)))
        return batches

    def constants(self) -> dict[str, str]:
        """The held keys that never changed, as summary tags."""
        return {key: tag_text(key, value) for key, (_, _, value) in sorted(self.first.items())}

    def untagged(self) -> dict[str, str]:
        """The summary tags to write: held keys not tagged yet (a tag is written with a key's first report, so
        that a report counted as logged has all of its values in the run, held ones included)."""
        return {key: text for key, text in self.constants().items() if key not in self.tagged}

    def stale(self) -> list[str]:
        """Summary tags whose key has moved since: the chart tells it now."""
        return sorted(self.tagged & self.moved)
