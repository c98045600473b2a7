"""Which run `submit --resume` continues: a small record beside Ray Train's own state in storage;
and `close_run`, the one way a run ends (its record and its MLflow run get the same status).

`<storage_path>/<run name>/ampflow_run.json` says which job file the run trains, its MLflow run
and experiment, and whether it finished. Ray Train restores its checkpoint manager from the same
directory when a trainer with the same name and storage path is built again.
"""

import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

from pyarrow import fs

from orchestrator.checkpoint.stored import _filesystem
from orchestrator.errors import BadInput
from orchestrator.tracking.refusals import describe

RECORD = "ampflow_run.json"
LOGGED = "ampflow_logged.json"
"""`{"seq": N}`: the driver's MLflow writer has logged every report up to report N (workers read it)."""


def storage_uri(storage_path: Optional[str], path) -> str:
    """`path` as the user names it: a path on `storage_path`'s filesystem (as pyarrow and Ray Train's `Result.path`
    give it, `bucket/runs/NAME` for `s3://bucket/runs`) with the storage URI's scheme put back (`s3://bucket/runs/
    NAME`); a local path as it is. The URI's user and password are left out."""
    path = str(path)
    if not storage_path or "://" not in storage_path or "://" in path:
        return path
    scheme, _, rest = storage_path.partition("://")
    if path.startswith("/"):  # a filesystem whose paths are absolute (hdfs://host/..., file:///...): its host first
        return f"{scheme}://{rest.split('/', 1)[0].rpartition('@')[2]}{path}"
    return f"{scheme}://{path}"


def write_record(storage_path: str, run_name: str, **fields: Any) -> None:
    """Create or update the record of `run_name` (fields given replace those stored)."""
    filesystem, base = _filesystem(storage_path)
    record = {**(read_record(storage_path, run_name) or {"started": time.time()}), "run_name": run_name, **fields}
    filesystem.create_dir(f"{base}/{run_name}", recursive=True)
    with filesystem.open_output_stream(f"{base}/{run_name}/{RECORD}") as out:
        out.write(json.dumps(record, indent=2).encode())


def write_logged_through(storage_path: str, run_name: str, seq: int) -> None:
    filesystem, base = _filesystem(storage_path)
    with filesystem.open_output_stream(f"{base}/{run_name}/{LOGGED}") as out:
        out.write(json.dumps({"seq": seq}).encode())


def read_logged_through(filesystem, run_dir: str) -> int:
    """What `write_logged_through` left in `run_dir` (a pyarrow filesystem and path); 0 when nothing is known
    yet or the file is being rewritten (the workers then keep more than they need, never less)."""
    try:
        with filesystem.open_input_stream(f"{run_dir}/{LOGGED}") as handle:
            return int(json.loads(handle.read())["seq"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def read_record(storage_path: str, run_name: str) -> Optional[dict[str, Any]]:
    filesystem, base = _filesystem(storage_path)
    path = f"{base}/{run_name}/{RECORD}"
    if filesystem.get_file_info(path).type == fs.FileType.NotFound:
        return None
    with filesystem.open_input_stream(path) as handle:
        return json.loads(handle.read())


def run_exists(storage_path: str, run_name: str) -> bool:
    filesystem, base = _filesystem(storage_path)
    return filesystem.get_file_info(f"{base}/{run_name}").type != fs.FileType.NotFound


def claim(storage_path: str, run_name: str) -> bool:
    """Take `run_name`'s directory in storage for this submit alone: BadInput when it exists already (another
    submit took the name first, or an earlier run has it). On a local path the directory is created atomically,
    so of two submits racing for one name exactly one wins; on a URI (no atomic create) it is checked, then
    created, and the default names' random suffix keeps submits apart. Returns whether `storage_path` itself
    was created (for `release`)."""
    filesystem, base = _filesystem(storage_path)
    try:
        if "://" in storage_path:
            if run_exists(storage_path, run_name):
                raise FileExistsError(run_name)
            filesystem.create_dir(f"{base}/{run_name}", recursive=True)
            return False
        created = not Path(base).exists()
        Path(base).mkdir(parents=True, exist_ok=True)
        Path(base, run_name).mkdir()
        return created
    except FileExistsError:
        raise BadInput(f"run.name: a run named '{run_name}' already exists in {storage_path} (another submit may "
                       "have just taken it). Choose another run.name, or continue it with "
                       "`python -m orchestrator.submit JOB --resume`.") from None


def release(storage_path: str, run_name: str, created_storage: bool = False) -> None:
    """Give back a claimed name whose run never started (its directory still empty), and the storage directory
    when `claim` created it and it is empty again: a submit refused at this point leaves nothing behind."""
    if "://" in storage_path:
        return
    for directory in (Path(storage_path, run_name), *([Path(storage_path)] if created_storage else [])):
        try:
            directory.rmdir()
        except OSError:  # not empty (the run started after all, or another run is there) or already gone
            return


def find_resumable(storage_path: str, job_path: Path) -> dict[str, Any]:
    """The newest unfinished run of this job file in `storage_path`; BadInput when there is none."""
    filesystem, base = _filesystem(storage_path)
    job = str(job_path.resolve())
    records = []
    if filesystem.get_file_info(base).type == fs.FileType.Directory:
        for info in filesystem.get_file_info(fs.FileSelector(base)):
            record = read_record(storage_path, info.base_name) if info.type == fs.FileType.Directory else None
            if record is not None and record.get("job_file") == job:
                records.append(record)
    unfinished = [r for r in records if r.get("status") != "FINISHED"]
    if not unfinished:
        finished = f" ({len(records)} finished run(s) of it there)" if records else ""
        raise BadInput(f"--resume: no interrupted run of {job_path} in {storage_path}{finished}. "
                       "Run it without --resume to start a new one.")
    return max(unfinished, key=lambda r: r["started"])


def close_run(tracker, status: str, timeout_s: float, storage_path: Optional[str] = None,
              run_name: Optional[str] = None) -> bool:
    """End a run as `status` (FINISHED, FAILED or KILLED): its record in `storage_path`, when it has one
    (nothing is created for a run that never got as far as writing it), then its MLflow run (`tracker`,
    None when MLflow never created it), retried for up to `timeout_s` while MLflow is flaky. An MLflow
    that still does not answer is reported, not raised: the run's end must not hide why it ended; returns
    whether the MLflow run was closed (True without one). A record that cannot be written is raised, after
    the MLflow run was marked FAILED (never left RUNNING)."""
    from orchestrator.tracking.writer import retry  # it imports ray, which the driver's bad-input path must not

    record_error = None
    try:
        if storage_path is not None and read_record(storage_path, run_name) is not None:
            write_record(storage_path, run_name, status=status)
    except Exception as exc:  # storage went away (a full disk, a lost mount): MLflow still hears how the run ended
        record_error, status = exc, "FAILED"
    closed = True
    if tracker is not None:
        try:
            retry(lambda: tracker.finish(status), timeout_s, f"marking the MLflow run {status}")
        except Exception as exc:
            closed = False
            print(f"error: MLflow run {tracker.run_id} could not be marked {status} and still shows RUNNING: its "
                  f"store refused ({describe(exc)}), so its record cannot be changed from here. Once the store takes "
                  "writes again, `--resume` closes it.", file=sys.stderr)
    if record_error is not None:
        raise record_error
    return closed
