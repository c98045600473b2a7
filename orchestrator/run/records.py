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

from orchestrator.errors import BadInput

RECORD = "ampflow_run.json"


def _filesystem(storage_path: str):
    from pyarrow import fs

    return fs.FileSystem.from_uri(storage_path) if "://" in storage_path else (fs.LocalFileSystem(), storage_path)


def write_record(storage_path: str, run_name: str, **fields: Any) -> None:
    """Create or update the record of `run_name` (fields given replace those stored)."""
    filesystem, base = _filesystem(storage_path)
    record = {**(read_record(storage_path, run_name) or {"started": time.time()}), "run_name": run_name, **fields}
    filesystem.create_dir(f"{base}/{run_name}", recursive=True)
    with filesystem.open_output_stream(f"{base}/{run_name}/{RECORD}") as out:
        out.write(json.dumps(record, indent=2).encode())


def read_record(storage_path: str, run_name: str) -> Optional[dict[str, Any]]:
    from pyarrow import fs

    filesystem, base = _filesystem(storage_path)
    path = f"{base}/{run_name}/{RECORD}"
    if filesystem.get_file_info(path).type == fs.FileType.NotFound:
        return None
    with filesystem.open_input_stream(path) as handle:
        return json.loads(handle.read())


def run_exists(storage_path: str, run_name: str) -> bool:
    from pyarrow import fs

    filesystem, base = _filesystem(storage_path)
    return filesystem.get_file_info(f"{base}/{run_name}").type != fs.FileType.NotFound


def find_resumable(storage_path: str, job_path: Path) -> dict[str, Any]:
    """The newest unfinished run of this job file in `storage_path`; BadInput when there is none."""
    from pyarrow import fs

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
              run_name: Optional[str] = None) -> None:
    """End a run as `status` (FINISHED, FAILED or KILLED): its record in `storage_path`, when it has one
    (nothing is created for a run that never got as far as writing it), then its MLflow run (`tracker`,
    None when MLflow never created it), retried for up to `timeout_s` while MLflow is flaky. An MLflow
    that still does not answer is reported, not raised: the run's end must not hide why it ended."""
    from orchestrator.tracking.writer import retry

    if storage_path is not None and read_record(storage_path, run_name) is not None:
        write_record(storage_path, run_name, status=status)
    if tracker is None:
        return
    try:
        retry(lambda: tracker.finish(status), timeout_s, f"marking the MLflow run {status}")
    except Exception as exc:
        print(f"error: could not mark MLflow run {tracker.run_id} {status} ({exc}); it may show RUNNING. "
              f"Set it with: mlflow runs ... or rerun --resume.", file=sys.stderr)
