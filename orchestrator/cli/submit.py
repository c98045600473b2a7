"""`python -m orchestrator.submit JOB [key=value ...] [--resume]`: train a job on Ray, tracked in MLflow.

Exit codes: 0 success; 2 bad input (nothing started or submitted, no MLflow run; also MLflow
unreachable when `tracking.required`); 1 training failed (the worker's exception first, the
MLflow run marked FAILED), or the driver failed after the run was created (the run marked FAILED);
130 Ctrl-C and 143 SIGTERM (the run marked KILLED; the line printed says how to `--resume`).
A thin wrapper over the Python API (`orchestrator.api`), which drives the run through
`orchestrator.runner.driver`.

With `--address http(s)://HEAD:8265` the job is validated here and run on that cluster
(`orchestrator.runner.remote`): 0 it SUCCEEDED, 1 it FAILED or was STOPPED, 2 nothing was submitted.
"""

import argparse
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Optional, Sequence

from orchestrator import console
from orchestrator.cli.program import interrupted, parse_job_args, prog, refused
from orchestrator.config import reference
from orchestrator.errors import (EXIT_FAILED, EXIT_OK, INTERRUPT_DEADLINE_S, BadInput, command_exit, exit_within,
                                 interrupt_on_sigint, interrupt_on_sigterm)
from orchestrator.runner import remote
from orchestrator.tracking.secrets import install_console_redaction, redact


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog("submit"),
        description="Train a job file on Ray Train workers and track it in one MLflow run.",
        epilog=reference.render(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("job", help="job YAML file, e.g. jobs/cifar.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. run.epochs=2")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                        help="an existing Ray cluster (default: $RAY_ADDRESS, else a local Ray on this machine); "
                             "an http(s):// dashboard address submits the job there through the Job Submission API")
    parser.add_argument("--no-wait", action="store_true",
                        help="with an http(s):// --address: print the submitted job's id and exit")
    parser.add_argument("--resume", action="store_true",
                        help="continue this job's newest interrupted run from its last checkpoint, in the same MLflow run")
    return parse_job_args(parser, argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    install_console_redaction()  # before anything can print a secret (MLflow's own lines included)
    args = parse_args(argv)
    console.from_args(args)
    # Ctrl-C and SIGTERM raise Interrupted wherever they land (Ray's start, training, the final logging); the run
    # is closed KILLED on the way out, and the command ends within INTERRUPT_DEADLINE_S whatever hangs.
    previous_sigterm, previous_sigint = interrupt_on_sigterm(), interrupt_on_sigint()
    exit_within(INTERRUPT_DEADLINE_S)
    try:
        return _submit(args)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM; a created run was closed KILLED on the way
        return interrupted(exc)
    except Exception as exc:  # a driver-side failure after the run was created: execute() closed it FAILED
        frames = traceback.extract_tb(exc.__traceback__)
        where = f"\n  at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
        print(f"\nerror: the driver failed: {redact(f'{type(exc).__name__}: {exc}')}{where}\n"
              "Its MLflow run (if one was created) is marked FAILED.", file=sys.stderr)
        return EXIT_FAILED
    finally:
        exit_within(None)  # a deadline an interrupt started runs on: the command is ending
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
        if previous_sigint is not None:
            signal.signal(signal.SIGINT, previous_sigint)


def _submit(args: argparse.Namespace) -> int:
    """The command line around the Python API (`orchestrator.api`): dry runs and job servers here, a run
    there; bad input is exit 2."""
    # torch, Ray and MLflow (seconds) once the arguments are parsed: `--help` prints without them.
    from orchestrator import api
    from orchestrator.config import load_job, to_yaml
    from orchestrator.runner.preflight import preflight

    job_path = Path(args.job)
    to_cluster = remote.is_job_server_address(args.address)
    try:
        if args.no_wait and not to_cluster:
            raise BadInput("--no-wait needs a job server to submit to: --address http://HEAD:8265.")
        if args.dry_run:
            print(redact(to_yaml(load_job(job_path, args.overrides))), end="")
            return EXIT_OK
        if not to_cluster:
            return api.train(job_path, args.overrides, args.address, resume=args.resume)[1]
        preflight([load_job(job_path, args.overrides)], job_path, args.address, resume=args.resume)
        return remote.submit(job_path, args.overrides, args.address, wait=not args.no_wait, resume=args.resume)
    except BadInput as exc:  # also the job server's refusals (no token, a job file outside the project)
        return refused(exc)


if __name__ == "__main__":
    command_exit(main())
