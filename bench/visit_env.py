"""The GPU visit's environment: carried wheels in and out, the versions record, the steps' summary.

A GPU machine for the visit (`bench/gpu_visit.sh`) has torch but may lack what the rest needs (OmegaConf,
torchvision, Ray, MLflow), and no network: those come as wheels in the checkout. Subcommands:

- `pack`: on a machine with internet, after `pip download`: every file of a folder in one tar, cut into
  parts of at most `--part-mib` MiB, with a manifest of SHA-256 sums. Each part can ride along with a
  different command to the GPU machine (one command carries at most 64 MiB).
- `install`: on the GPU machine: join the parts found (all present and every sum right, else nothing), then
  install every carried wheel whose distribution is not installed yet with
  `pip install --no-index --no-deps --target SITE`; SITE goes first on PYTHONPATH. `--check` only says what
  it would install (wheels for another Python cannot be installed where the dry run runs).
- `versions`: `versions.json`: the device, torch, CUDA, cuDNN, NCCL and the other packages' versions.
- `cuda-tests`: the tests marked `cuda` in tests/ through pytest, their outcomes as JSON (passed, failed,
  skipped by name); pytest's exit code.
- `summary`: the visit's steps (a tab-separated list `gpu_visit.sh` writes) as `summary.json`.

Imports only the standard library at the top (torch only in `versions`): it runs before anything is installed.
"""

import argparse
import hashlib
import importlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ElementTree
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

MANIFEST_SUFFIX = ".manifest.json"
"""`<name>.manifest.json` beside the parts `<name>.part-000`, `-001`, ...: what `pack` made and `install` checks."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_json(path: Path, record: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")


# -- wheels -------------------------------------------------------------------------------------------------

def distribution_of(wheel: Path) -> str:
    """The distribution a wheel installs, from its file name (`omegaconf-2.4.0-py3-none-any.whl` -> omegaconf)."""
    return wheel.name.split("-", 1)[0]


def installed(distribution: str) -> Optional[str]:
    """The installed version of `distribution` (on sys.path, PYTHONPATH included), None when absent."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def pack(source: Path, parts_dir: Path, name: str, part_mib: float) -> dict[str, Any]:
    """`source`'s files in one uncompressed tar (wheels are zips already), cut into parts of `part_mib` MiB, and
    the manifest. Old parts of the same name are removed first, so a part never comes from another pack."""
    files = sorted(p for p in source.iterdir() if p.is_file())
    if not files:
        raise SystemExit(f"error: {source} holds no files to pack; run pip download into it first")
    parts_dir.mkdir(parents=True, exist_ok=True)
    for old in parts_dir.glob(f"{name}.part-*"):
        old.unlink()
    archive = parts_dir / f"{name}.tar"
    with tarfile.open(archive, "w") as tar:
        for file in files:
            tar.add(file, arcname=file.name)
    part_bytes = int(part_mib * 2**20)
    parts = []
    with open(archive, "rb") as handle:
        for index in range(10**4):
            chunk = handle.read(part_bytes)
            if not chunk:
                break
            part = parts_dir / f"{name}.part-{index:03d}"
            part.write_bytes(chunk)
            parts.append({"file": part.name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    manifest = {"name": name, "sha256": sha256(archive), "bytes": archive.stat().st_size,
                "files": [f.name for f in files], "parts": parts}
    archive.unlink()
    write_json(parts_dir / f"{name}{MANIFEST_SUFFIX}", manifest)
    return manifest


def join(manifest_path: Path, into: Path) -> tuple[Optional[Path], str]:
    """Join and unpack the parts a manifest lists into `into/<name>/`; (that folder, what happened).
    (None, why) when a part is missing or a sum is wrong: nothing is unpacked from an incomplete set."""
    manifest = json.loads(manifest_path.read_text())
    parts_dir, name = manifest_path.parent, manifest["name"]
    target = into / name
    stamp = target / ".complete"
    if stamp.exists() and stamp.read_text().strip() == manifest["sha256"]:
        return target, f"{name}: unpacked already ({len(manifest['files'])} files)"
    missing = [p["file"] for p in manifest["parts"] if not (parts_dir / p["file"]).exists()]
    if missing:
        return None, (f"{name}: {len(manifest['parts']) - len(missing)} of {len(manifest['parts'])} parts here; "
                      f"missing {', '.join(missing)} (carry each with a command of its own)")
    for part in manifest["parts"]:
        if sha256(parts_dir / part["file"]) != part["sha256"]:
            return None, f"{name}: {part['file']} is damaged (SHA-256 differs from the manifest); carry it again"
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    archive = into / f"{name}.tar"
    with open(archive, "wb") as out:
        for part in manifest["parts"]:
            with open(parts_dir / part["file"], "rb") as handle:
                shutil.copyfileobj(handle, out)
    if sha256(archive) != manifest["sha256"]:
        archive.unlink()
        return None, f"{name}: the joined parts differ from the packed file (SHA-256); pack and carry them again"
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    archive.unlink()
    stamp.write_text(manifest["sha256"] + "\n")
    return target, f"{name}: joined {len(manifest['parts'])} parts, unpacked {len(manifest['files'])} files"


def install(wheel_dirs: list[Path], parts_dir: Optional[Path], site: Path, check: bool) -> dict[str, Any]:
    """Join what was carried in parts, then install every wheel whose distribution is missing into `site`."""
    notes, folders = [], [d for d in wheel_dirs if d.is_dir()]
    if parts_dir is not None and parts_dir.is_dir():
        for manifest in sorted(parts_dir.glob(f"*{MANIFEST_SUFFIX}")):
            if check:
                notes.append(f"{manifest.name}: would join its parts (not in a dry run)")
                continue
            folder, note = join(manifest, site.parent / f"{site.name}-packs")
            notes.append(note)
            if folder is not None:
                folders.append(folder)
    wheels = sorted({w.name: w for d in folders for w in d.glob("*.whl")}.values(), key=lambda w: w.name)
    present = {w.name: installed(distribution_of(w)) for w in wheels}
    wanted = [w for w in wheels if present[w.name] is None]
    record: dict[str, Any] = {"site": str(site), "notes": notes, "check": check,
                              "present": {w.name: v for w, v in ((w, present[w.name]) for w in wheels) if v},
                              "to_install": [w.name for w in wanted], "installed": [], "failed": {}}
    if check or not wanted:
        return record
    site.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet", "--target", str(site)]
    done = subprocess.run(command + [str(w) for w in wanted], capture_output=True, text=True)
    if done.returncode == 0:
        record["installed"] = [w.name for w in wanted]
        return record
    for wheel in wanted:  # one of them is bad: find which, keep the others
        one = subprocess.run(command + [str(wheel)], capture_output=True, text=True)
        if one.returncode == 0:
            record["installed"].append(wheel.name)
        else:
            record["failed"][wheel.name] = (one.stderr.strip().splitlines() or ["pip failed"])[-1]
    return record


# -- records ------------------------------------------------------------------------------------------------

DISTRIBUTIONS = {"sklearn": "scikit-learn", "pynvml": "nvidia-ml-py"}
"""Modules whose distribution has another name (for the version of a module without `__version__`)."""


def module_version(name: str) -> Optional[str]:
    """The version of an importable module; `[import fails: ...]` when it is there but does not import (a
    torchvision built for another CUDA); None when it is absent."""
    if importlib.util.find_spec(name) is None:
        return None
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001: a package that cannot import is what this record must show
        return f"[import fails: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}]"
    return str(getattr(module, "__version__", None) or installed(DISTRIBUTIONS.get(name, name)))


def nvidia_smi() -> Optional[str]:
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                           "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    return done.stdout.strip() or done.stderr.strip()


def git_commit() -> Optional[str]:
    if os.environ.get("AMPFLOW_COMMIT"):
        return os.environ["AMPFLOW_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parents[1])
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def versions(dry_run: bool) -> dict[str, Any]:
    import torch

    from bench.common import device_description

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    record: dict[str, Any] = {
        "device": device_description(device), "device_type": device.type,
        "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "packages": {name: module_version(name) for name in
                     ("torchvision", "omegaconf", "triton", "numpy", "sklearn", "psutil", "pynvml", "ray", "mlflow")},
        "git_commit": git_commit(), "dry_run": dry_run, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if cuda:
        props = torch.cuda.get_device_properties(device)
        record.update({"capability": f"{props.major}.{props.minor}", "gpu_memory_bytes": props.total_memory,
                       "multiprocessors": props.multi_processor_count, "nvidia_smi": nvidia_smi()})
    return record


CUDA_MARK = "pytest.mark.cuda"


def cuda_test_files(tests_dir: Path) -> list[Path]:
    """The test files that mark tests `cuda`. Only these are collected: the others may import Ray or MLflow at
    the top, which the visit machine may lack, and collecting them would fail before any CUDA test ran."""
    return sorted(path for path in tests_dir.glob("test_*.py") if CUDA_MARK in path.read_text())


def cuda_tests(tests_dir: Path, json_path: Path) -> int:
    """Run the `cuda` tests (`pytest -m cuda`), write their outcomes to `json_path`; pytest's exit code."""
    files = cuda_test_files(tests_dir)
    xml_path = json_path.with_suffix(".xml")
    xml_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", "-q",
               f"--junitxml={xml_path}", *map(str, files)]
    print(" ".join(command), flush=True)
    rc = subprocess.run(command).returncode
    write_json(json_path, {**junit(xml_path), "files": [str(f) for f in files], "pytest_exit_code": rc})
    xml_path.unlink(missing_ok=True)
    return rc


def junit(xml_path: Path) -> dict[str, Any]:
    """pytest's JUnit XML as {counts, tests: [{name, outcome, message}]}; {"error"} when pytest wrote none."""
    if not xml_path.exists():
        return {"error": f"pytest wrote no {xml_path.name} (it failed before running tests: see its log)"}
    tests = []
    for case in ElementTree.parse(xml_path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or "")[:500]
        tests.append({"name": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "message": message})
    counts = {outcome: sum(t["outcome"] == outcome for t in tests) for outcome in ("passed", "failed", "error", "skipped")}
    return {"counts": counts, "tests": tests}


STEP_FIELDS = ("name", "status", "rc", "seconds", "timeout_s", "log", "json", "command")


def summary(steps_tsv: Path, dry_run: bool) -> dict[str, Any]:
    steps = []
    for line in steps_tsv.read_text().splitlines():
        if line.strip():
            row = dict(zip(STEP_FIELDS, line.split("\t")))
            row["rc"], row["seconds"], row["timeout_s"] = int(row["rc"]), float(row["seconds"]), int(row["timeout_s"])
            row["json"] = row["json"] or None
            if row["status"] in ("skipped", "no_time"):  # a step not run: the last column says why
                row["why"], row["command"] = row.pop("command"), None
            steps.append(row)
    failed = [s["name"] for s in steps if s["status"] not in ("ok", "skipped")]
    return {"dry_run": dry_run, "steps": steps, "failed": failed, "ok": not failed,
            "seconds": round(sum(s["seconds"] for s in steps), 1)}


def main(argv=None) -> int:
    cli = argparse.ArgumentParser(prog="python -m bench.visit_env", description=__doc__.splitlines()[0])
    sub = cli.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="tar a folder of wheels and cut it into parts of at most --part-mib MiB")
    p.add_argument("source", type=Path)
    p.add_argument("--parts", type=Path, default=Path(".whl-parts"), help="where the parts go (default .whl-parts)")
    p.add_argument("--name", default="submit", help="name of the pack (its parts are NAME.part-NNN)")
    p.add_argument("--part-mib", type=float, default=48, help="largest part in MiB (default 48: a part, the small "
                                                               "wheels and the checkout fit in one 64 MiB carry)")
    p = sub.add_parser("install", help="install the carried wheels whose distribution is missing")
    p.add_argument("--wheels", type=Path, action="append", default=[], help="a folder of wheels (repeatable)")
    p.add_argument("--parts", type=Path, help="a folder of packs made by `pack`")
    p.add_argument("--site", type=Path, required=True, help="the --target folder (put it first on PYTHONPATH)")
    p.add_argument("--check", action="store_true", help="only say what would be installed")
    p.add_argument("--json", type=Path)
    p = sub.add_parser("versions", help="write the device and package versions")
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true")
    p = sub.add_parser("cuda-tests", help="run the tests marked cuda, write their outcomes")
    p.add_argument("--tests", type=Path, default=Path("tests"))
    p.add_argument("--json", type=Path, required=True)
    p = sub.add_parser("summary", help="the visit's steps as JSON")
    p.add_argument("steps", type=Path)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true")
    args = cli.parse_args(argv)

    if args.command == "pack":
        manifest = pack(args.source, args.parts, args.name, args.part_mib)
        for part in manifest["parts"]:
            print(f"{args.parts / part['file']}  {part['bytes'] / 2**20:.1f} MiB")
        print(f"{len(manifest['files'])} files, {manifest['bytes'] / 2**20:.1f} MiB in {len(manifest['parts'])} parts; "
              f"manifest {args.parts / (args.name + MANIFEST_SUFFIX)}")
        return 0
    if args.command == "install":
        record = install(args.wheels, args.parts, args.site, args.check)
        for note in record["notes"]:
            print(note)
        print(f"present: {', '.join(sorted(record['present'])) or 'none'}")
        print(f"{'would install' if args.check else 'installed'}: "
              f"{', '.join(record['to_install'] if args.check else record['installed']) or 'none'}")
        for wheel, why in record["failed"].items():
            print(f"error: {wheel} did not install: {why}", file=sys.stderr)
        if args.json:
            write_json(args.json, record)
        return 1 if record["failed"] else 0
    if args.command == "versions":
        record = versions(args.dry_run)
        write_json(args.json, record)
        print(f"{record['device']}; torch {record['torch']}, CUDA {record['cuda']}, cuDNN {record['cudnn']}")
        return 0
    if args.command == "cuda-tests":
        return cuda_tests(args.tests, args.json)
    record = summary(args.steps, args.dry_run)
    write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
