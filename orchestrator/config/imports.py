"""Import paths in a job file (`package.module:Name`): the user's own classes and functions, nothing else.

A job file is code and must be trusted like code: importing the user's module runs it. What this
module prevents is a job file turning the standard library into a payload: `model.name: os:system`
with `model.kwargs: {command: ...}` would otherwise run a shell command during pre-flight. So a path
is refused, before anything it names is called, unless it names a class or a Python function
defined in a file outside the standard library (the user's code or an installed package).
Standard-library modules are refused by name before they are even imported (importing some of them
does something: `antigravity` opens a browser). Known deserialisers of installed packages are refused
too (`numpy:load` with `allow_pickle: true`, `torch:load`, `joblib:load`, `pandas:read_pickle`, `dill`,
`cloudpickle`, ...): called with the job's kwargs, they unpickle whatever file the job names.
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

DESERIALISER_PACKAGES = frozenset({
    "pickle", "_pickle", "pickle5", "cPickle", "marshal", "shelve", "copyreg", "dill", "cloudpickle", "jsonpickle",
})
"""Packages that exist to turn bytes into objects: nothing in them is a factory."""

DESERIALISER_MODULES = frozenset({
    "torch.serialization", "torch.package", "torch.hub", "torch.utils.model_zoo", "torch.jit._serialization",
    "torch.export.pt2_archive", "joblib.numpy_pickle", "pandas.io.pickle", "pandas.compat.pickle_compat",
    "numpy.lib.format",
})
"""Modules of installed packages whose functions load (unpickle) files or download and run code."""

DESERIALISERS = frozenset({
    "numpy.load", "numpy.lib.npyio.load", "numpy.lib._npyio_impl.load", "numpy.lib.npyio.NpzFile",
    "numpy.lib._npyio_impl.NpzFile", "numpy.ma.load", "torch.load", "torch.jit.load", "torch.export.load",
    "joblib.load", "pandas.read_pickle", "pandas.read_hdf", "pandas.io.pytables.read_hdf", "pandas.HDFStore",
    "yaml.load", "yaml.load_all", "yaml.unsafe_load", "yaml.unsafe_load_all", "yaml.full_load", "yaml.full_load_all",
    "mlflow.pyfunc.load_model", "mlflow.pytorch.load_model", "mlflow.pytorch.load_state_dict",
    "mlflow.sklearn.load_model", "keras.models.load_model", "keras.saving.load_model",
    "tensorflow.keras.models.load_model",
})
"""Functions and classes (as written and as defined) that unpickle, or construct arbitrary objects from, a file."""


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
    if _is_deserialiser(f"{module_name}.{attr}"):  # by name, before its module is imported
        raise _deserialiser_refusal(text, where, f"{module_name}.{attr}")
    if _is_stdlib_name(module_name):
        raise refuse(f"module '{module_name}' is part of the Python standard library")
    module = import_module_from_cwd(module_name, where)
    if not hasattr(module, attr):
        raise BadInput(f"{where}: module '{module_name}' has no '{attr}'. Check the name after the colon.")
    target = getattr(module, attr)
    if not (inspect.isclass(target) or inspect.isfunction(target)):
        raise refuse(f"it is a {type(target).__name__}, not a class or a function")
    defined_in = getattr(target, "__module__", None) or ""
    defined_as = f"{defined_in}.{getattr(target, '__qualname__', attr)}"
    if _is_deserialiser(defined_as):  # also when the user's module re-exports it
        raise _deserialiser_refusal(text, where, defined_as)
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


def _is_deserialiser(dotted: str) -> bool:
    module = dotted.rpartition(".")[0]
    return (dotted in DESERIALISERS or dotted.split(".")[0] in DESERIALISER_PACKAGES
            or any(module == m or module.startswith(m + ".") for m in DESERIALISER_MODULES))


def _deserialiser_refusal(text: str, where: str, dotted: str) -> BadInput:
    return BadInput(
        f"{where}: '{text}' is refused: it is {dotted}, a deserialiser; called with the job's kwargs it would "
        "unpickle (and so run) whatever the file it is given holds. Name your own class or function, and load "
        "files there without unpickling (torch.load(..., weights_only=True), numpy.load without allow_pickle, "
        "safetensors). Job files are code: run only those you trust.")


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
