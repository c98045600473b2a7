"""Load a job YAML file as plain data, refusing what a job file never needs.

PyYAML's SafeLoader already refuses `!!python/...` tags. On top of it we refuse
duplicate keys (the later one would silently win) and anchors/aliases (a job
file has no use for them, and they make "billion laughs" expansion possible).
Booleans are YAML 1.2's `true`/`false` only: `lint: off` or `comm_hook: no` stay the
strings a user meant, not YAML 1.1's False.
"""

import re

from pathlib import Path
from typing import Any

import yaml

from orchestrator.errors import BadInput


class _StrictLoader(yaml.SafeLoader):
    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent) or (
            self.check_event(yaml.NodeEvent) and self.peek_event().anchor is not None
        ):
            mark = self.peek_event().start_mark
            raise yaml.constructor.ConstructorError(
                None, None, "anchors and aliases (&name / *name) are not allowed in job files", mark
            )
        return super().compose_node(parent, index)

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
    """One command-line value (`run.epochs=2`'s `2`) with the same rules as a job file; `key=` is null."""
    return yaml.load(text, Loader=_StrictLoader)


def load_yaml_mapping(path: Path, what: str = "job file") -> dict:
    """Parse `path` and return its top-level mapping (empty file -> {})."""
    if path.is_dir():
        raise BadInput(f"{what} {path} is a directory, not a file. "
                       f"Give the YAML file inside it (e.g. {path}/job.yaml).")
    if not path.is_file():
        raise BadInput(f"{what} not found: {path}. Check the path (it is relative to {Path.cwd()}).")
    try:
        data: Any = yaml.load(path.read_text(), Loader=_StrictLoader)
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
