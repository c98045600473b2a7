"""Import paths in a job file (`package.module:Name`): the user's own classes and functions, nothing else.

A job file is code and must be trusted like code: importing the user's module runs it. What this
module prevents is a job file turning the standard library into a payload: `model.name: os:system`
with `model.kwargs: {command: ...}` would otherwise run a shell command during pre-flight. So a path
is refused, before anything it names is called, unless it names a class or a Python function
defined in a file outside the standard library (the user's code or an installed package).
Standard-library modules are refused by name before they are even imported (importing some of them
does something: `antigravity` opens a browser).
"""

import importlib
import inspect
import site
import sys
import sysconfig
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

from orchestrator.errors import BadInput

FORM = "'package.module:Name'"


def is_import_path(text: str) -> bool:
    return ":" in text


def import_module_from_cwd(module_name: str, where: str) -> ModuleType:
    """Import `module_name` with the current directory first on sys.path."""
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise BadInput(
            f"{where}: cannot import module '{module_name}' ({exc}). The module must be importable "
            f"from the directory you run submit in ({cwd})."
        ) from None


def resolve_import_path(text: str, where: str, kind: str) -> Any:
    """The class or function `text` names, refused (BadInput naming `where`) unless it is the user's own.

    `kind` says what the path is for ("model", "dataset", "loss"), for the message. Nothing the path
    names is called here; only the user's module is imported.
    """
    module_name, _, attr = text.partition(":")
    if not module_name or not attr.isidentifier() or not all(part.isidentifier() for part in module_name.split(".")):
        raise BadInput(f"{where}: '{text}' is not of the form {FORM} (a module, a colon, one class or function name).")
    refuse = _refusal(text, where, kind)
    if _is_stdlib_name(module_name):
        raise refuse(f"module '{module_name}' is part of the Python standard library")
    module = import_module_from_cwd(module_name, where)
    if not hasattr(module, attr):
        raise BadInput(f"{where}: module '{module_name}' has no '{attr}'. Check the name after the colon.")
    target = getattr(module, attr)
    if not (inspect.isclass(target) or inspect.isfunction(target)):
        raise refuse(f"it is a {type(target).__name__}, not a class or a function")
    defined_in = getattr(target, "__module__", None) or ""
    if _is_stdlib_name(defined_in):
        raise refuse(f"it is defined in '{defined_in}', part of the Python standard library")
    file = _module_file(defined_in)
    if file is None:
        raise refuse(f"it is defined in '{defined_in or '?'}', which has no source file (a builtin)")
    if _is_stdlib_file(file):
        raise refuse(f"it is defined in {file}, part of the Python standard library")
    return target


def _refusal(text: str, where: str, kind: str):
    def refuse(reason: str) -> BadInput:
        return BadInput(
            f"{where}: '{text}' is refused: {reason}. An import path must name a {kind} class or function "
            f"defined in your own code or an installed package (e.g. 'mypackage.models:MyNet'), never a "
            f"callable from the standard library or builtins. Job files are code: run only those you trust."
        )
    return refuse


def _is_stdlib_name(module_name: str) -> bool:
    top = module_name.split(".")[0]
    return top in sys.stdlib_module_names or top in sys.builtin_module_names


def _module_file(module_name: str) -> Optional[Path]:
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None)
    return Path(file).resolve() if file else None


@lru_cache(maxsize=1)
def _stdlib_dirs() -> tuple[tuple[Path, ...], tuple[Path, ...]]:
    """(the standard library's directories, the site-packages directories that may lie inside them)."""
    paths = sysconfig.get_paths()
    stdlib = {Path(paths[key]).resolve() for key in ("stdlib", "platstdlib") if key in paths}
    # pyenv and python.org builds keep site-packages under lib/python3.X: those files are packages, not stdlib.
    packages = {Path(paths[key]).resolve() for key in ("purelib", "platlib") if key in paths}
    packages |= {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]}
    return tuple(stdlib), tuple(packages)


def is_installed(file: Path) -> bool:
    """Whether `file` belongs to an installed package (site-packages) or the standard library."""
    stdlib, packages = _stdlib_dirs()
    return any(file.is_relative_to(p) for p in (*packages, *stdlib))


def _is_stdlib_file(file: Path) -> bool:
    stdlib, packages = _stdlib_dirs()
    if any(file.is_relative_to(p) for p in packages):
        return False
    return any(file.is_relative_to(p) for p in stdlib)
