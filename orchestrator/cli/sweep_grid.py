"""What a sweep runs: `--presets` and `--grid KEY=V1,V2` into the labelled points of a grid.

A grid is its swept keys with their values in the order given (`--presets P,Q` is the key
`precision.preset`, first; a value in brackets, a list, is one value); its points are their cartesian product. A point's label names its child
run, its Ray run directory and its `sweep/<label>/...` metrics.
"""

import itertools
import re
from typing import Optional, Sequence

from orchestrator.config.loader import resolve_preset
from orchestrator.errors import BadInput
from orchestrator.tracking.secrets import redact

PRESET_KEY = "precision.preset"


def parse_presets(text: str, flag: str = "--presets") -> list[str]:
    """Canonical preset names, in order; BadInput for an empty list, unknown names and duplicates."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise BadInput(f"{flag}: no preset given. List them comma-separated, e.g. --presets O0,O1,bf16-mixed.")
    canonical: dict[str, str] = {}
    for name in names:
        try:
            preset = resolve_preset(name)
        except BadInput as exc:
            raise BadInput(f"{flag}: {exc}") from None
        if preset in canonical:
            same = f"'{canonical[preset]}' and '{name}' are both" if canonical[preset] != name else f"'{name}' is"
            raise BadInput(f"{flag}: {same} preset {preset}: listed twice. List each preset once.")
        canonical[preset] = name
    return list(canonical)


def parse_grid(items: Sequence[str], presets: Optional[str]) -> list[tuple[str, list[str]]]:
    """The swept keys and their values, in the order given (`--presets` first); BadInput for a malformed
    `--grid`, empty or repeated values, a key given twice, or nothing to sweep."""
    grid: dict[str, list[str]] = {}
    if presets is not None:
        grid[PRESET_KEY] = parse_presets(presets)
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise BadInput(f"--grid {item}: expected KEY=V1,V2,... e.g. --grid optim.lr=0.1,0.05.")
        if key in grid:
            also = "--presets and --grid precision.preset both sweep" if key == PRESET_KEY and presets is not None \
                else "--grid gives"
            raise BadInput(f"--grid {item}: {also} {key} twice. Give each key once, all its values comma-separated.")
        if key == PRESET_KEY:
            grid[key] = parse_presets(text, flag="--grid")
            continue
        values = split_values(text)
        if not values:
            raise BadInput(f"--grid {item}: no value given. List them comma-separated, e.g. --grid {key}=A,B.")
        repeated = sorted({value for value in values if values.count(value) > 1})
        if repeated:
            raise BadInput(f"--grid {item}: {', '.join(repeated)} listed twice. List each value once.")
        grid[key] = values
    if not grid:
        raise BadInput("nothing to sweep: give --presets O0,O1 or --grid KEY=V1,V2 (e.g. --grid optim.lr=0.1,0.05).")
    return list(grid.items())


def split_values(text: str) -> list[str]:
    """`V1,V2,...` split at the commas outside brackets, so a list or a mapping is one value:
    `[3,32,32],[1,28,28]` is two values. Empty values are dropped."""
    values, depth, start = [], 0, 0
    for index, char in enumerate(text + ","):
        if char in "[{":
            depth += 1
        elif char in "]}":
            depth = max(depth - 1, 0)
        elif char == "," and depth == 0:
            values.append(text[start:index].strip())
            start = index + 1
    return [value for value in values if value]


def point_labels(grid: list[tuple[str, list[str]]]) -> dict[str, dict[str, str]]:
    """Every point of the grid (cartesian product, in order) by its label: the preset alone for a sweep of
    presets; else each value, after the key's last part for keys other than the preset (`lr0.1-O1`). Labels
    name runs and directories: letters, digits, `.`, `_` and `-` only."""
    keys = [key for key, _ in grid]
    points = [dict(zip(keys, values)) for values in itertools.product(*(values for _, values in grid))]

    def part(key: str, value: str) -> str:
        value = redact(f"{key}={value}").partition("=")[2]  # a secret (a password's value) never names a run
        text = value if key == PRESET_KEY else key.rsplit(".", 1)[-1] + value
        return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._-") or "x"

    labels = ["-".join(part(key, value) for key, value in point.items()) for point in points]
    if len(set(labels)) < len(labels):  # values that differ only in characters a label cannot hold
        labels = [f"{label}-{number}" for number, label in enumerate(labels, start=1)]
    return dict(zip(labels, points))
