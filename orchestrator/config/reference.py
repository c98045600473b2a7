"""Every config key with its type, default and doc line, read from the schema: what `--help` lists.

The doc lines are the strings under each field of `orchestrator.config.schema` and its sections
(`orchestrator.config.sections`: attribute docstrings), read from their source, so the help can never drift from
the schema.
"""

import argparse
import ast
import dataclasses
import importlib
import inspect
import pkgutil
import sys
import textwrap
import typing
from functools import lru_cache
from typing import Any, Iterator, NamedTuple

from omegaconf import MISSING

from orchestrator.config import schema, sections


class Key(NamedTuple):
    name: str
    """Dotted (`run.epochs`; `precision.rules[].match` for a list of sections)."""
    type: str
    default: str
    doc: str


@lru_cache(maxsize=None)
def _doc_lines() -> dict[tuple[str, str], str]:
    """(class name, field name) -> the string under the field, whitespace folded."""
    docs = {}
    modules = [schema, *(importlib.import_module(f"{sections.__name__}.{module.name}")
                         for module in pkgutil.iter_modules(sections.__path__))]
    for node in (node for module in modules for node in ast.parse(inspect.getsource(module)).body):
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for field, after in zip(body, body[1:]):
            if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) \
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                    and isinstance(after.value.value, str):
                docs[(node.name, field.target.id)] = " ".join(after.value.value.split())
    return docs


def _section(annotation: Any) -> tuple[Any, str]:
    """(the dataclass a field holds, "" or "[]" when it is a list of them), or (None, "") for a plain value."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if dataclasses.is_dataclass(candidate):
            return candidate, ""
        if typing.get_origin(candidate) in (list, typing.List) and dataclasses.is_dataclass(
                (typing.get_args(candidate) or (None,))[0]):
            return typing.get_args(candidate)[0], "[]"
    return None, ""


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    return text or str(annotation).replace("typing.", "")


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if value is MISSING:
        return "required"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def keys(cls: type = schema.JobConfig, prefix: str = "") -> Iterator[Key]:
    """Every key under `cls`, sections first as themselves, then their keys, in schema order."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        name, doc = prefix + field.name, _doc_lines().get((cls.__name__, field.name), "")
        section, suffix = _section(hints[field.name])
        if section is None:
            yield Key(name, _type_name(hints[field.name]), _default(field), doc)
            continue
        if prefix:  # a nested section (transforms, scaler, early_stopping, rules) is a key of its own too
            yield Key(name, "list of sections" if suffix else "section", "[]" if suffix else _default(field)
                      if _default(field) == "null" else "", doc)
        yield from keys(section, f"{name}{suffix}.")


def section_docs() -> dict[str, str]:
    """Top-level section -> its doc line."""
    return {field.name: _doc_lines().get(("JobConfig", field.name), "") for field in dataclasses.fields(schema.JobConfig)}


def render(width: int = 100) -> str:
    """The reference as text: one block per section, a line per key (`key  type = default`) and its doc."""
    out, section = ["config keys (job file sections, or key=value on the command line):"], None
    docs = section_docs()
    for key in keys():
        top = key.name.split(".", 1)[0].removesuffix("[]")  # `callbacks[].name` belongs to `callbacks`
        if top != section:
            section = top
            out.append(f"\n  {top}: {docs[top]}")
        default = f" = {key.default}" if key.default else ""
        out.append(f"    {key.name}  ({key.type}){default}")
        if key.doc:
            out.extend(textwrap.wrap(key.doc, width, initial_indent=" " * 8, subsequent_indent=" " * 8))
    return "\n".join(out) + "\n"


class _HelpConfig(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(render())
        parser.exit()


def add_help_config(parser: argparse.ArgumentParser) -> None:
    """`--help-config`: print only the config keys and exit (as `--help` does)."""
    parser.add_argument("--help-config", action=_HelpConfig, nargs=0,
                        help="list every config key with its type, default and meaning, and exit")
