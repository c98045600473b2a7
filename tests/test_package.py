"""`pip install .` (not editable) gives a working package: the presets inside it, the `ampflow` command on the
PATH. Built and installed here into a fresh virtual environment; its heavy dependencies (torch, ray, mlflow,
...) are borrowed from this environment through a .pth file instead of being installed again."""

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]



@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("package")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp / "dist")], check=True, capture_output=True, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("ampflow-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    elsewhere = tmp / "elsewhere"  # not the checkout: nothing of it on the path
    elsewhere.mkdir()
    return {"wheel": wheel, "venv": venv, "cwd": elsewhere}


def test_the_wheel_holds_the_presets_and_the_command(installed):
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    shipped = {Path(name).stem for name in names if name.startswith("orchestrator/presets/precision/")}
    assert shipped == {path.stem for path in (REPO / "configs" / "precision").glob("*.yaml")}
    entry_points = next(name for name in names if name.endswith("entry_points.txt"))
    assert "ampflow = orchestrator.cli.ampflow:run" in zipfile.ZipFile(installed["wheel"]).read(entry_points).decode()


def test_the_installed_command_resolves_a_preset_from_another_directory(installed):
    venv, cwd = installed["venv"], installed["cwd"]
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import orchestrator; print(orchestrator.__file__)"],
                           cwd=cwd, check=True, capture_output=True, text=True).stdout
    assert where.startswith(str(venv)), f"the installed package must be the one imported, not the checkout: {where}"
    out = subprocess.run([str(venv / "bin" / "ampflow"), "submit", str(REPO / "jobs" / "quickstart.yaml"), "--dry-run"],
                         cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "preset: O1" in out.stdout and "compute_dtype: float16" in out.stdout, out.stdout
    listed = subprocess.run([str(venv / "bin" / "ampflow"), "--help"], cwd=cwd, capture_output=True, text=True)
    assert listed.returncode == 0
    for command in ("submit", "sweep", "jobs", "summary", "export", "predict", "tune"):
        assert f"  {command} " in listed.stdout
