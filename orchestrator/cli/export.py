"""`python -m orchestrator.export RUN_ID --dtype float16|bfloat16`: export a finished run's model in half
precision, checked against the fp32 model's accuracy (the export itself: `orchestrator.runner.export`).

Exit codes: 0 exported and logged; 1 refused (it lost more than `export.max_accuracy_drop`); 2 the run
cannot be exported (not found, no logged model, weights that do not fit its model).
"""

import argparse
from pathlib import Path
from typing import Optional, Sequence

from orchestrator.cli.program import prog, refused
from orchestrator.errors import EXIT_FAILED, EXIT_OK, BadInput, command_exit
from orchestrator.runner.export import EXPORT_DTYPES, ExportRefused, export_logged_run
from orchestrator.tracking.secrets import install_console_redaction
from orchestrator.tracking.tracker import RunTracker, quick_http_failures, resolve_uri


def main(argv: Optional[Sequence[str]] = None) -> int:
    install_console_redaction()  # before anything can print the tracking URI's password (MLflow's lines included)
    quick_http_failures()

    parser = argparse.ArgumentParser(prog=prog("export"),
                                     description="Export a finished run's model in half precision.")
    parser.add_argument("run_id")
    parser.add_argument("--dtype", required=True, choices=EXPORT_DTYPES)
    parser.add_argument("--max-accuracy-drop", type=float, default=None,
                        help="default: the run's export.max_accuracy_drop")
    parser.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI, else ./mlflow.db")
    args = parser.parse_args(argv)
    uri = resolve_uri(args.tracking_uri, Path.cwd())
    try:
        result = export_logged_run(RunTracker.open(uri, args.run_id), args.dtype, args.max_accuracy_drop)
    except BadInput as exc:
        return refused(exc)
    except ExportRefused as exc:
        return refused(exc, EXIT_FAILED)
    print(f"exported {args.run_id} as {result.describe()}")
    return EXIT_OK


if __name__ == "__main__":
    command_exit(main())
