"""The GPU visit (`bench/gpu_visit.sh`): one command that runs every CUDA path and writes every GPU figure.

On this CPU the dry run proves the plumbing end to end: every step runs (tiny sizes, CPU devices, Ray and
MLflow made unimportable as on the visit machine), every record is written and parses, a step that fails
or overruns does not stop the others, and wheels carried in parts are joined and installed. The `cuda`
tests at the end run on a GPU machine (the visit runs them first).
"""

import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import REPO

SCRIPT = REPO / "bench" / "gpu_visit.sh"
RECORD_FIELDS = {"harness", "device", "torch", "config", "figures", "ratios", "targets", "command"}
HARNESS_RECORDS = {"policy": "policy_step_time", "telemetry": "telemetry_step_time",
                   "fast_paths": "all_speedup", "airbench": "airbench_epoch_throughput"}
PRESETS = ("O1", "O2", "bf16-mixed")
DRY_RUN_PRESETS = ("O1",)  # the other two are the same command with another --preset


def visit(out: Path, *args: str, timeout: float = 1200, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out", str(out), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHON": sys.executable, **env})


def load(path: Path) -> dict:
    assert path.is_file(), f"{path.name} was not written"
    return json.loads(path.read_text())


@pytest.mark.slow  # trains in processes of its own (the harnesses)
def test_dry_run_writes_every_record_of_the_visit(tmp_path):
    """The GPU visit's script in a dry run on the CPU writes every record the visit on a GPU writes.

    Long: it runs the visit's whole script (versions, wheels, the cuda tests, the quickstart under each preset and
    the bench harnesses), each in processes of its own, sized down for the CPU."""
    out = tmp_path / "visit"
    done = visit(out)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"

    versions = load(out / "versions.json")
    assert versions["device"].startswith("cpu") and versions["device_name"]
    assert versions["torch"] == torch.__version__ and versions["dry_run"] is True
    for hidden in ("ray", "mlflow"):  # as on the visit machine
        assert versions["packages"][hidden] is None or "import fails" in versions["packages"][hidden]
    assert versions["packages"]["omegaconf"] and versions["packages"]["sklearn"]
    assert load(out / "wheels.json")["check"] is True

    tests = load(out / "cuda_tests.json")
    assert "tests/test_gpu_visit.py" in tests["files"] and "tests/test_bench.py" in tests["files"]
    names = {t["name"].rsplit("::", 1)[1]: t["outcome"] for t in tests["tests"]}
    assert names["test_gpu_amp_harness"] == "skipped" and names["test_quickstart_on_cuda"] == "skipped"

    for preset in DRY_RUN_PRESETS:
        record = load(out / f"quickstart-{preset}.json")
        assert RECORD_FIELDS <= record.keys() and record["config"]["preset"] == preset
        figures = record["figures"]
        assert figures["audit"] and figures["audit_mismatches"] == []
        assert figures["memory"]["memory/peak_bytes"] > 0
        assert figures["loss_scale"] and all("amp/loss_scale" in entry for entry in figures["loss_scale"])
        assert figures["loss_scale_final"]["amp/loss_scale"] == 65536.0  # fp16: GradScaler's 2^16 to start
        assert 0.0 <= figures["final"]["eval/accuracy"] <= 1.0

    # FSDP2 on one rank, O2 with a float32 rule: the rule's layers gather and store fp32, the rest fp16.
    fsdp = load(out / "quickstart-fsdp.json")["figures"]
    assert fsdp["audit_mismatches"] == [] and all("unit" in entry for entry in fsdp["audit"])
    stored = {entry["name"]: entry["param_dtype"] for entry in fsdp["audit"] if entry["param_dtype"]}
    assert stored and all(dtype == ("float32" if name.startswith("classifier.") else "float16")
                          for name, dtype in stored.items())

    assert load(out / "gpu_amp.json")["skipped"] == "no CUDA device"
    for harness, ratio in HARNESS_RECORDS.items():
        record = load(out / f"{harness}.json")
        assert RECORD_FIELDS <= record.keys() and record["harness"] == harness
        assert math.isfinite(record["ratios"][ratio])
    assert record["targets"]["airbench_epoch_throughput"] == ">= 0.9"

    summary = load(out / "summary.json")
    status = {step["name"]: step["status"] for step in summary["steps"]}
    expected = {"install", "versions", "cuda_tests", *(f"quickstart-{p}" for p in DRY_RUN_PRESETS), "quickstart-fsdp",
                "gpu_amp", *HARNESS_RECORDS}
    assert {name: status[name] for name in expected} == {name: "ok" for name in expected}
    assert {status[f"quickstart-{p}"] for p in PRESETS if p not in DRY_RUN_PRESETS} == {"skipped"}
    assert status["submit"] == "skipped"  # Ray and MLflow are not importable: said, not crashed
    assert status["epoch"] == status["startup"] == "skipped"  # fresh processes per run: test_bench runs them
    assert summary["ok"] is True and summary["failed"] == []
    assert all((out / "logs" / f"{name}.log").is_file() for name in expected)


@pytest.mark.slow  # trains in processes of its own (the harnesses)
def test_a_step_that_fails_or_overruns_does_not_stop_the_others(tmp_path):
    out = tmp_path / "visit"
    done = visit(out, "--only", "policy,gpu_amp", VISIT_TIMEOUT_POLICY="1")
    assert done.returncode == 1, done.stdout[-3000:]
    steps = {step["name"]: step for step in load(out / "summary.json")["steps"]}
    assert steps["policy"]["status"] == "timed_out" and steps["policy"]["timeout_s"] == 1
    assert steps["gpu_amp"]["status"] == "ok"  # the step after the one that overran still ran
    assert load(out / "gpu_amp.json")["harness"] == "gpu_amp"
    assert "quickstart-O1" not in steps and load(out / "summary.json")["failed"] == ["policy"]
    assert "some steps failed" in done.stderr


def test_an_unknown_step_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "visit"
    done = visit(out, "--only", "polcy", timeout=60)
    assert done.returncode == 2
    assert "unknown step 'polcy'" in done.stderr and "fast_paths" in done.stderr
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_the_visit_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "visit"
    done = subprocess.run(["bash", str(SCRIPT), "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 2 and "no CUDA device" in done.stderr and "--dry-run" in done.stderr
    assert not out.exists()


def test_steps_past_the_deadline_are_recorded_as_not_started(tmp_path):
    out = tmp_path / "visit"
    done = visit(out, "--only", "gpu_amp", "--deadline", "0", timeout=120)
    assert done.returncode == 1
    summary = load(out / "summary.json")
    assert {step["name"]: step["status"] for step in summary["steps"]} == \
        {"install": "no_time", "versions": "no_time", "gpu_amp": "no_time"}
    assert "--deadline 0 s reached" in summary["steps"][-1]["why"] and not (out / "gpu_amp.json").exists()


def pure_wheel(folder: Path, distribution: str, version: str, module_text: str) -> Path:
    """A real, installable pure-Python wheel holding one module named like the distribution."""
    name = f"{distribution}-{version}"
    path = folder / f"{name}-py3-none-any.whl"
    files = {f"{distribution}.py": module_text,
             f"{name}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n",
             f"{name}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{name}.dist-info/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{name}.dist-info/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:
        for file, text in files.items():
            archive.writestr(file, text)
    return path


def visit_env(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.visit_env", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_wheels_carried_in_parts_are_joined_and_installed_once(tmp_path):
    wheels, parts, site = tmp_path / "wheels", tmp_path / "parts", tmp_path / "site"
    pure_wheel(wheels, "ampflow_visit_probe", "1.0", "ANSWER = 42\n" + "# padding\n" * 400)
    pure_wheel(wheels, "pyyaml", "0.0.1", "")  # installed here already: must not be installed again
    packed = visit_env("pack", str(wheels), "--parts", str(parts), "--name", "probe", "--part-mib", "0.001")
    assert packed.returncode == 0, packed.stderr
    manifest = json.loads((parts / "probe.manifest.json").read_text())
    assert len(manifest["parts"]) > 1  # cut in parts, each carried on its own

    # One part not carried yet: nothing is joined or installed, and the record says which part is missing.
    last = parts / manifest["parts"][-1]["file"]
    kept = last.read_bytes()
    last.unlink()
    record_path = tmp_path / "wheels.json"
    done = visit_env("install", "--parts", str(parts), "--site", str(site), "--json", str(record_path))
    assert done.returncode == 0 and not site.exists()
    assert last.name in json.loads(record_path.read_text())["notes"][0]

    # A damaged part is refused the same way.
    last.write_bytes(b"x" + kept[1:])
    visit_env("install", "--parts", str(parts), "--site", str(site), "--json", str(record_path))
    assert "damaged" in json.loads(record_path.read_text())["notes"][0] and not site.exists()

    last.write_bytes(kept)
    done = visit_env("install", "--parts", str(parts), "--site", str(site), "--json", str(record_path))
    assert done.returncode == 0, done.stderr
    record = json.loads(record_path.read_text())
    assert record["installed"] == ["ampflow_visit_probe-1.0-py3-none-any.whl"]
    assert "pyyaml-0.0.1-py3-none-any.whl" in record["present"]
    probe = subprocess.run([sys.executable, "-c", "import ampflow_visit_probe as p; print(p.ANSWER)"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(site)})
    assert probe.stdout.strip() == "42", probe.stderr

    # The next command of the visit finds it installed: nothing is installed twice.
    done = subprocess.run([sys.executable, "-m", "bench.visit_env", "install", "--parts", str(parts), "--site",
                           str(site), "--json", str(record_path)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": f"{site}:{REPO}"}, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(record_path.read_text())["installed"] == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quickstart_on_cuda(tmp_path):
    """The Ray-free loop on one GPU under O2: fp16 parameters and compute as promised, CUDA memory peaks."""
    out = tmp_path / "quickstart.json"
    done = subprocess.run([sys.executable, "-m", "bench.visit_quickstart", "--preset", "O2", "--device", "cuda",
                           "--smoke", "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    figures = json.loads(out.read_text())["figures"]
    assert figures["audit"] and figures["audit_mismatches"] == []
    assert {entry["param_dtype"] for entry in figures["audit"]} == {"float16"}
    memory = figures["memory"]
    assert memory["memory/peak_bytes"] > 0 and memory["memory/rank0_peak_reserved_bytes"] >= memory["memory/peak_bytes"]
    assert figures["loss_scale_final"]["amp/loss_scale"] > 0
