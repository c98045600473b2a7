"""`python -m orchestrator.jobs status|logs|stop JOB_ID`: jobs submitted with `submit --address http://...`.

The cluster is `--address`, else $RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS (the order `ray job`
uses). Token auth works as for submit: RAY_AUTH_MODE=token and the token where Ray looks for it.

Exit codes: 0 done (for `logs --follow`: the job SUCCEEDED); 1 the followed job FAILED or was
STOPPED; 2 bad input (no address, cluster unreachable or refusing the token, unknown job id).
"""

import argparse
import os
import sys
from typing import Optional, Sequence

from orchestrator.cli.program import prog
from orchestrator.errors import EXIT_BAD_INPUT, EXIT_OK, BadInput, command_exit
from orchestrator.runner import remote
from orchestrator.tracking.secrets import install_console_redaction


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog("jobs"),
                                     description="Look at or stop a job on a remote Ray cluster.")
    parser.add_argument("command", choices=("status", "logs", "stop"))
    parser.add_argument("job_id", help="the id `submit --address ... --no-wait` printed (raysubmit_...)")
    parser.add_argument("--address", default=os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS"),
                        help="the cluster's job server, e.g. http://127.0.0.1:8265 (default: "
                             "$RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS)")
    parser.add_argument("--follow", action="store_true", help="logs: keep printing until the job ends")
    return parser.parse_args(argv)


def _job_info(client, job_id: str, address: str):
    try:
        return client.get_job_info(job_id)
    except RuntimeError as exc:  # the job server answers 404 for an unknown id
        raise BadInput(f"job {job_id}: not found at {address} ({remote.first_line(exc)}). "
                       "List the cluster's jobs with `ray job list --address ...`.") from None


def status(client, job_id: str, address: str) -> int:
    info = _job_info(client, job_id, address)
    print(f"{job_id} {info.status.value}")
    if info.message:
        print(f"  {info.message}")
    return EXIT_OK


def logs(client, job_id: str, address: str, follow: bool) -> int:
    _job_info(client, job_id, address)
    if follow:
        return remote.follow(client, job_id, address)
    print(client.get_job_logs(job_id), end="")
    return EXIT_OK


def stop(client, job_id: str, address: str) -> int:
    """Ask the job to stop and wait until it has (its driver closes its MLflow run KILLED)."""
    if not _job_info(client, job_id, address).status.is_terminal() and client.stop_job(job_id):
        print(f"{job_id} {remote.wait_until_done(client, job_id).value}")
    else:  # stop_job is False when the job ended between the two calls
        print(f"{job_id} had already ended: {client.get_job_status(job_id).value}")
    return EXIT_OK


def main(argv: Optional[Sequence[str]] = None) -> int:
    install_console_redaction()  # job logs and errors may carry a URI's password or a token
    args = parse_args(argv)
    try:
        if not args.address:
            raise BadInput("no cluster given: pass --address http://HEAD:8265 or set RAY_ADDRESS.")
        client = remote.connect(args.address)
        if args.command == "status":
            return status(client, args.job_id, args.address)
        if args.command == "logs":
            return logs(client, args.job_id, args.address, args.follow)
        return stop(client, args.job_id, args.address)
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    command_exit(main())
