"""Import paths in a job file name the user's own classes and functions, never the standard library's."""

import pytest
import torch

from orchestrator.config.imports import resolve_import_path
from orchestrator.config.schema import ModelSection
from orchestrator.errors import BadInput
from orchestrator.train.models import build_model, resolve_factory


@pytest.mark.parametrize("path, why", [
    ("os:system", "standard library"),
    ("subprocess:run", "standard library"),
    ("subprocess:Popen", "standard library"),
    ("builtins:print", "standard library"),
    ("builtins:eval", "standard library"),
    ("os.path:join", "standard library"),
    ("collections:OrderedDict", "standard library"),
    ("antigravity:fly", "standard library"),  # importing it alone would open a browser: refused by name
])
def test_standard_library_callables_are_refused(path, why):
    with pytest.raises(BadInput) as info:
        resolve_import_path(path, where="model.name", kind="model")
    message = str(info.value)
    assert message.startswith(f"model.name: '{path}'") and why in message


def test_stdlib_callables_re_exported_by_user_code_are_refused(tmp_path, monkeypatch):
    (tmp_path / "sneaky_models.py").write_text(
        "from os import system\nfrom subprocess import run, Popen\nimport functools\n"
        "shell = functools.partial(run, shell=True)\n"
    )
    monkeypatch.chdir(tmp_path)
    for attr in ("system", "run", "Popen", "shell"):
        with pytest.raises(BadInput, match=f"'sneaky_models:{attr}'"):
            resolve_import_path(f"sneaky_models:{attr}", where="model.name", kind="model")


def test_nothing_is_called_while_resolving(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "called"
    with pytest.raises(BadInput):
        build_model(ModelSection(name="os:system", kwargs={"command": f"touch {marker}"}))
    assert not marker.exists()


def test_a_model_class_and_a_factory_in_a_user_module_are_accepted(tmp_path, monkeypatch):
    (tmp_path / "user_nets.py").write_text(
        "import torch.nn as nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self, num_classes=10):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))\n"
        "    def forward(self, x):\n"
        "        return self.fc(x)\n"
        "def make(num_classes=10):\n"
        "    return Net(num_classes)\n"
        "not_callable = 3\n"
    )
    monkeypatch.chdir(tmp_path)
    net_class = resolve_import_path("user_nets:Net", where="model.name", kind="model")
    assert net_class.__name__ == "Net" and resolve_factory("user_nets:make").__name__ == "make"
    assert build_model(ModelSection(name="user_nets:Net", num_classes=3))(torch.randn(1, 3, 32, 32)).shape == (1, 3)
    with pytest.raises(BadInput, match="not a class or a function"):
        resolve_import_path("user_nets:not_callable", where="model.name", kind="model")
    with pytest.raises(BadInput, match="has no 'Missing'"):
        resolve_import_path("user_nets:Missing", where="model.name", kind="model")


def test_a_class_from_an_installed_package_is_accepted():
    assert resolve_import_path("torch.nn:Linear", where="model.name", kind="model") is torch.nn.Linear


def test_malformed_paths_say_the_form(tmp_path):
    for text in ("nomodule:", ":Name", "pkg:Outer.Inner", "pkg:Name:more"):
        with pytest.raises(BadInput, match="package.module:Name"):
            resolve_import_path(text, where="data.name", kind="dataset")


@pytest.mark.parametrize("path", [
    "numpy:load", "numpy.lib.npyio:load", "numpy.lib.format:read_array", "torch:load", "torch.serialization:load",
    "torch.jit:load", "torch.export:load", "torch.hub:load", "torch.hub:load_state_dict_from_url", "joblib:load",
    "pandas:read_pickle", "cloudpickle:loads", "dill:loads", "jsonpickle:decode", "yaml:unsafe_load", "pickle:loads",
    "marshal:loads", "shelve:open", "mlflow.pytorch:load_model",
])
def test_known_deserialisers_of_installed_packages_are_refused(path):
    with pytest.raises(BadInput) as info:
        resolve_import_path(path, where="model.name", kind="model")
    message = str(info.value)
    assert message.startswith(f"model.name: '{path}' is refused") and "deserialiser" in message
    assert "weights_only=True" in message  # what to do instead


def test_deserialisers_re_exported_by_user_code_are_refused(tmp_path, monkeypatch):
    (tmp_path / "loaders.py").write_text("from numpy import load as fetch\nfrom torch import load\n"
                                         "from joblib import load as restore\n")
    monkeypatch.chdir(tmp_path)
    for attr, defined_as in (("fetch", "numpy.load"), ("load", "torch.serialization.load"),
                             ("restore", "joblib.numpy_pickle.load")):
        with pytest.raises(BadInput, match=f"'loaders:{attr}' is refused: it is {defined_as}, a deserialiser"):
            resolve_import_path(f"loaders:{attr}", where="data.name", kind="dataset factory")


def test_numpy_load_with_allow_pickle_never_runs_the_pickle(tmp_path, monkeypatch):
    import numpy as np

    class Payload:
        def __reduce__(self):
            return open, (str(tmp_path / "unpickled"), "w")

    np.save(tmp_path / "payload.npy", np.array([Payload()], dtype=object), allow_pickle=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadInput, match="model.name: 'numpy:load' is refused"):
        build_model(ModelSection(name="numpy:load", kwargs={"file": str(tmp_path / "payload.npy"),
                                                            "allow_pickle": True}))
    assert not (tmp_path / "unpickled").exists()
