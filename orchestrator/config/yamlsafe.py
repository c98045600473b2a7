"""Load a job YAML file as plain data, refusing what a job file never needs.

PyYAML's SafeLoader already refuses `!!python/...` tags. On top of it we refuse
duplicate keys (the later one would silently win) and anchors/aliases (a job
file has no use for them, and they make "billion laughs" expansion possible).
Booleans are YAML 1.2's `true`/`false` only: `lint: off` or `comm_hook: no` stay the
strings a user meant, not YAML 1.1's False.

A job file is small text: one larger than `MAX_BYTES`, holding more than `MAX_NODES` keys and values, nested
deeper than `MAX_DEPTH`, or not UTF-8 is refused before it is parsed whole (a job is a kilobyte or two, about a
hundred keys and values, three or four levels deep; a 40 MB file took minutes and gigabytes to load, and a few
thousand levels overflowed Python's stack). Command-line values take the same limits.
"""

import re

from pathlib import Path
from typing import Any

import yaml

from orchestrator.errors import BadInput

MAX_BYTES = 1024 * 1024
"""The largest job file (or command-line value) read: 1 MiB, a thousand times the jobs shipped in jobs/."""

MAX_NODES = 10_000
"""The most keys, values, mappings and lists a job file (or a command-line value) may hold: each costs the typed
config about 0.2 ms to load, so 10,000 load in about two seconds."""

MAX_DEPTH = 32
"""The deepest nesting of mappings and lists a job file (or a command-line value) may have: sections are level 1,
their keys level 2; `model.kwargs` of a third-party model rarely goes past 6."""


class TooLarge(yaml.YAMLError):
    """A job file (or command-line value) past one of the limits: `problem` says which, `line` where (from 1)."""

    def __init__(self, problem: str, line: int):
        super().__init__(f"line {line}: {problem}")
        self.problem, self.line = problem, line


class _StrictLoader(yaml.SafeLoader):
    _depth = 0
    _nodes = 0

    def compose_node(self, parent, index):
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise TooLarge(f"it holds more than {MAX_NODES:,} keys and values, the most a job may hold (a job holds "
                           "about a hundred)", self.peek_event().start_mark.line + 1)
        if self.check_event(yaml.MappingStartEvent, yaml.SequenceStartEvent) and self._depth >= MAX_DEPTH:
            raise TooLarge(f"it nests mappings and lists deeper than {MAX_DEPTH} levels, the most a job may (a job "
                           "is three or four deep)", self.peek_event().start_mark.line + 1)
        if self.check_event(yaml.AliasEvent) or (
            self.check_event(yaml.NodeEvent) and self.peek_event().anchor is not None
        ):
            mark = self.peek_event().start_mark
            raise yaml.constructor.ConstructorError(
                None, None, "anchors and aliases (&name / *name) are not allowed in job files", mark
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"duplicate key {key!r} (first defined on line {seen[key] + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
# YAML 1.2 also reads `1e-3` (no dot) as a float, as users write learning rates.
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789"))


def parse_value(text: str):
    """One command-line value (`run.epochs=2`'s `2`) with the same rules and limits as a job file; `key=` is null.
    Raises yaml.YAMLError."""
    if len(text.encode("utf-8", "surrogateescape")) > MAX_BYTES:
        raise TooLarge(f"it is {_size(len(text.encode('utf-8', 'surrogateescape')))}, more than the "
                       f"{_size(MAX_BYTES)} a value may have", 1)
    return yaml.load(text, Loader=_StrictLoader)


def _size(count: int) -> str:
    """`1 MiB` for the limit, `40.0 MiB` for a large file, `1,048,577 bytes` for one just past the limit."""
    if count == MAX_BYTES:
        return f"{MAX_BYTES // 1024 // 1024} MiB"
    return f"{count / 1024 / 1024:.1f} MiB" if count > 2 * MAX_BYTES else f"{count:,} bytes"


def read_text(path: Path, what: str = "job file") -> str:
    """The text of `path` for a YAML `what`: BadInput when it is larger than MAX_BYTES (checked before it is read)
    or not UTF-8 text."""
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise BadInput(f"{path}: the {what} is {_size(size)}, more than the {_size(MAX_BYTES)} a {what} may "
                           "have. Give the YAML job file (a job is a few kilobytes; put large data in files its code "
                           "reads).")
        with path.open("rb") as stream:
            data = stream.read(MAX_BYTES + 1)  # a file that grew since: still no more than the limit read
    except OSError as exc:  # no permission to read it, an I/O error
        raise BadInput(f"{path}: cannot read the {what} ({exc.strerror or exc}). Check the file and its "
                       "permissions.") from None
    if len(data) > MAX_BYTES:
        raise BadInput(f"{path}: the {what} is more than the {_size(MAX_BYTES)} a {what} may have.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"{path}: not a YAML {what}: byte {exc.start} (0x{data[exc.start]:02x}) is not UTF-8 text. "
                       "Give the job's YAML file (UTF-8 text), not a binary file.") from None


def load_yaml_mapping(path: Path, what: str = "job file") -> dict:
    """Parse `path` and return its top-level mapping (empty file -> {})."""
    if path.is_dir():
        raise BadInput(f"{what} {path} is a directory, not a file. "
                       f"Give the YAML file inside it (e.g. {path}/job.yaml).")
    if not path.exists():
        raise BadInput(f"{what} not found: {path}. Check the path (it is relative to {Path.cwd()}).")
    if not path.is_file():
        raise BadInput(f"{what} {path} is not a regular file. Give the YAML file itself.")
    text = read_text(path, what)
    try:
        data: Any = yaml.load(text, Loader=_StrictLoader)
    except TooLarge as exc:
        raise BadInput(f"{path}, line {exc.line}: refused as a {what}: {exc.problem}. Give the job's own YAML "
                       "file; put large data in files its code reads.") from None
    except yaml.MarkedYAMLError as exc:  # one line: where, and what is wrong there
        mark = exc.problem_mark or exc.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise BadInput(f"{path}{where}: not valid YAML for a {what}: {exc.problem or exc.context}.") from None
    except yaml.YAMLError as exc:
        raise BadInput(f"{path}: not valid YAML for a {what}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise BadInput(
            f"{path}: a {what} must be a mapping of sections (model:, data:, run:, ...), "
            f"got a {type(data).__name__}."
        )
    return data
