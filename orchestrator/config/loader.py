"""Resolve a job: dataclass defaults < configs/ presets the job names < job YAML < CLI.

Every merge is done against the typed schema, so an error names the layer it came
from (preset file, job file or command line) and the key path inside it.
"""

import dataclasses
import difflib
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from orchestrator.config.schema import JobConfig, PrecisionSection
from orchestrator.config.validate import validate
from orchestrator.config.yamlsafe import MAX_DEPTH, load_yaml_mapping, parse_value
from orchestrator.errors import BadInput
from orchestrator.precision.policy import Policy

# Lightning's precision strings, accepted as names of our presets.
PRESET_ALIASES = {
    "32-true": "O0",
    "32": "O0",
    "16-mixed": "O1",
    "16": "O1",
    "16-true": "O3",
    "bf16-mixed": "bf16-mixed",
    "bf16": "bf16-mixed",
    "bf16-true": "bf16-true",
}


def configs_dir() -> Path:
    """The presets: `orchestrator/presets`, which in a checkout is a link to the project's top-level configs/
    (the source users read and edit) and in an installed package a copy of it (package data)."""
    return Path(__file__).resolve().parents[1] / "presets"


def available_presets(section: str = "precision") -> list[str]:
    return sorted(p.stem for p in (configs_dir() / section).glob("*.yaml"))


def _schema() -> DictConfig:
    # Dataclass nodes are closed to unknown keys; Dict[...] fields (model.kwargs, resources) stay open.
    return OmegaConf.structured(JobConfig)


def _nearest(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" Did you mean '{close[0]}'?" if close else ""


def _allowed_keys(schema: DictConfig, full_key: str) -> list[str]:
    node: Any = schema
    for part in full_key.split(".")[:-1]:
        node = node.get(part) if isinstance(node, DictConfig) else None
    return list(node.keys()) if isinstance(node, DictConfig) else []


def _merge(base: DictConfig, layer: Any, source: str) -> DictConfig:
    """Merge `layer` into `base`, turning OmegaConf's errors into BadInput naming `source`."""
    try:
        return OmegaConf.merge(base, layer)
    except ConfigKeyError as exc:
        entry = _entry_of(layer, exc)
        if entry is not None:
            where, fields = entry
            raise BadInput(f"{source}: unknown key '{exc.key}' in {where}.{_nearest(str(exc.key), fields)} "
                           f"Allowed keys in each entry of {where.partition('[')[0]}: {', '.join(fields)}.") from None
        full_key = str(exc.full_key or exc.key)
        allowed = _allowed_keys(base, full_key)
        leaf = full_key.rsplit(".", 1)[-1]
        parent = full_key.rsplit(".", 1)[0] if "." in full_key else "the top level"
        hint = _nearest(leaf, allowed).replace("'", f"'{parent}.", 1) if parent != "the top level" else ""
        raise BadInput(
            f"{source}: unknown key '{full_key}'.{hint} Allowed keys in {parent}: {', '.join(allowed)}."
        ) from None
    except OmegaConfBaseException as exc:
        entry = _entry_of(layer, exc)
        key = getattr(exc, "full_key", None)
        first_line = str(exc).splitlines()[0]
        where = f"key '{exc.key}' of {entry[0]}" if entry is not None else f"key '{key}'" if key else "a section"
        raise BadInput(f"{source}: {where}: {first_line}. Fix the value's type (see orchestrator/config/schema.py).") from None


@lru_cache(maxsize=None)
def _entry_sections(cls: type = JobConfig, prefix: str = "") -> tuple[tuple[str, type], ...]:
    """The schema's lists of sections (`precision.rules`, `task.metrics`, `callbacks`) and their entries' type."""
    found = []
    for name, annotation in typing.get_type_hints(cls).items():
        for candidate in (annotation, *typing.get_args(annotation)):
            args = typing.get_args(candidate)
            if dataclasses.is_dataclass(candidate):
                found += _entry_sections(candidate, f"{prefix}{name}.")
                break
            if typing.get_origin(candidate) is list and args and dataclasses.is_dataclass(args[0]):
                found.append((f"{prefix}{name}", args[0]))
                break
    return tuple(found)


def _entry_of(layer: Any, exc: OmegaConfBaseException) -> Optional[tuple[str, list[str]]]:
    """Where an error OmegaConf raised inside an entry of a list of sections lies, as OmegaConf does not say
    (its key path starts again inside the entry): (`precision.rules[1] (match 'features.*')`, the entry's
    fields), or None when the error is not in such an entry."""
    entry_type = getattr(exc, "object_type", None)
    data = OmegaConf.to_container(layer) if isinstance(layer, DictConfig) else layer
    for path, cls in _entry_sections():
        if cls is not entry_type:
            continue
        for candidate in (path, path.partition(".")[2]):  # a precision preset's layer has no `precision.`
            node = data
            for part in candidate.split(".") if candidate else ():
                node = node.get(part) if isinstance(node, dict) else None
            if not isinstance(node, list):
                continue
            for index, entry in enumerate(node):
                if isinstance(entry, dict) and exc.key in entry and not _fits(cls, entry):
                    label = next((f" ({field} {entry[field]!r})" for field in ("match", "name")
                                  if isinstance(entry.get(field), str)), "")
                    return f"{path}[{index}]{label}", [f.name for f in dataclasses.fields(cls)]
    return None


def _fits(cls: type, entry: dict) -> bool:
    """Whether `entry` merges into the section `cls` on its own."""
    try:
        OmegaConf.merge(OmegaConf.structured(cls), entry)
    except OmegaConfBaseException:
        return False
    return True


LIST_SECTIONS = ("callbacks",)
"""Top-level sections that are lists, not mappings of keys."""


def _check_sections(data: dict, source: str) -> None:
    sections = list(JobConfig.__dataclass_fields__)
    for name, value in data.items():
        if name not in sections:
            raise BadInput(
                f"{source}: unknown section '{name}'.{_nearest(str(name), sections)} "
                f"Allowed sections: {', '.join(sections)}."
            )
        if name in LIST_SECTIONS:
            if value is not None and not isinstance(value, list):
                raise BadInput(f"{source}: '{name}' must be a list, got {value!r}.")
        elif value is not None and not isinstance(value, dict):
            raise BadInput(f"{source}: section '{name}' must be a mapping of keys, got {value!r}.")


def _named_as_mappings(entries: Any) -> Any:
    return [{"name": entry} if isinstance(entry, str) else entry for entry in entries] \
        if isinstance(entries, list) else entries


def _callbacks_as_mappings(data: dict) -> dict:
    """`callbacks` and `task.metrics` entries written as a bare name (`pkg.mod:Class`, `accuracy`) as
    `{name: ...}`."""
    if isinstance(data.get("callbacks"), list):
        data = {**data, "callbacks": _named_as_mappings(data["callbacks"])}
    task = data.get("task")
    if isinstance(task, dict) and isinstance(task.get("metrics"), list):
        data = {**data, "task": {**task, "metrics": _named_as_mappings(task["metrics"])}}
    return data


def parse_overrides(overrides: Iterable[str]) -> DictConfig:
    """`key.path=value` strings from the command line (values parsed as YAML)."""
    items = list(overrides)
    for item in items:
        if "=" not in item or item.startswith("="):
            raise BadInput(f"command line: override '{_shown(item)}' is not of the form key.path=value "
                           "(e.g. run.epochs=2).")
        parts = item.partition("=")[0].count(".") + 1
        if parts > MAX_DEPTH:
            raise BadInput(f"command line: override '{_shown(item)}': its key has {parts} parts, more than the "
                           f"{MAX_DEPTH} levels a job may nest. Give a key of the schema (e.g. run.epochs=2).")
    cli = OmegaConf.create()
    for item in items:
        key, _, text = item.partition("=")
        try:
            OmegaConf.update(cli, key, parse_value(text), merge=True)
        except (yaml.YAMLError, OmegaConfBaseException) as exc:
            raise BadInput(f"command line: cannot parse override '{_shown(item)}': {str(exc).splitlines()[0]}") \
                from None
    return cli


def _shown(item: str, limit: int = 200) -> str:
    """An override as an error quotes it: cut after `limit` characters."""
    return item if len(item) <= limit else f"{item[:limit]}... ({len(item):,} characters)"


def resolve_preset(name: str) -> str:
    canonical = PRESET_ALIASES.get(name, name)
    if not (configs_dir() / "precision" / f"{canonical}.yaml").is_file():
        raise BadInput(
            f"precision.preset: unknown preset '{name}'.{_nearest(name, available_presets())} "
            f"Available: {', '.join(available_presets())} (or Lightning's {', '.join(PRESET_ALIASES)})."
        )
    return canonical


def load_precision(preset: str) -> DictConfig:
    """The `precision` section a preset resolves to (schema defaults < the preset file), validated."""
    canonical = resolve_preset(preset)
    preset_file = configs_dir() / "precision" / f"{canonical}.yaml"
    section = _merge(OmegaConf.structured(PrecisionSection), load_yaml_mapping(preset_file, what="precision preset"),
                     str(preset_file))
    section.preset = canonical
    Policy.from_config(section)  # raises BadInput naming the key
    return section


def load_job(path: str | Path, overrides: Iterable[str] = (), base_dir: Optional[Path] = None) -> DictConfig:
    """The fully resolved, validated job config (a read-only typed DictConfig).

    Relative local paths (data.root, checkpoint.storage_path) are made absolute against
    `base_dir` (default: the current directory), because workers run in other directories.
    """
    path = Path(path)
    job = load_yaml_mapping(path)
    _check_sections(job, str(path))
    job = _callbacks_as_mappings(job)
    cli = OmegaConf.to_container(parse_overrides(overrides))
    _check_sections(cli, "command line")
    cli = _callbacks_as_mappings(cli)

    cfg = _schema()
    preset: Optional[str] = OmegaConf.select(OmegaConf.merge(job, cli), "precision.preset")
    if preset is not None:
        canonical = resolve_preset(str(preset))
        preset_file = configs_dir() / "precision" / f"{canonical}.yaml"
        preset_data = load_yaml_mapping(preset_file, what="precision preset")
        cfg = _merge(cfg, {"precision": preset_data}, str(preset_file))
    cfg = _merge(cfg, job, str(path))
    cfg = _merge(cfg, cli, "command line")
    if preset is not None:
        cfg.precision.preset = canonical

    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise BadInput(
            f"{path}: required value missing: {', '.join(missing)}. "
            f"Set it in the job file or on the command line (e.g. {missing[0]}=...)."
        )
    validate(cfg, source=str(path))
    _absolutize_paths(cfg, base_dir or Path.cwd())
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _absolutize_paths(cfg: DictConfig, base_dir: Path) -> None:
    cfg.data.root = str((base_dir / cfg.data.root).resolve())
    storage = cfg.checkpoint.storage_path or "ray_results"
    if "://" not in storage:
        storage = str((base_dir / storage).resolve())
    cfg.checkpoint.storage_path = storage


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def flatten(cfg: DictConfig) -> dict[str, str]:
    """`section.key` -> value as text, the form MLflow params take."""
    out: dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            if not node and prefix:
                out[prefix] = "{}"
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else str(key), value)
        else:
            out[prefix] = str(node)

    walk("", OmegaConf.to_container(cfg, resolve=True))
    return out
