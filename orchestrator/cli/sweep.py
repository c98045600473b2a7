"""`python -m orchestrator.sweep JOB --presets O0,O1,O2,bf16-mixed [key=value ...]`: which precision is
fastest and smallest for this model, and does it cost accuracy? And with
`--grid optim.lr=0.1,0.05 --grid precision.preset=O0,O1`: the cartesian product of any keys' values.

The job runs once per point of the grid (`--presets P,Q` is `--grid precision.preset=P,Q`), one after
another on one Ray, each as a complete ampflow run (metrics, audit, plots, checkpoints in its own Ray
run directory) that MLflow nests under one parent run. The parent gets the comparison read back from
the children: `sweep/comparison.{json,md,png}` and `sweep/<label>/...` metrics, where a point's label
is its preset for a sweep of presets alone (`O1`), else its values (`lr0.1-O1`); a child run is named
`<parent>-<label>` and tagged `sweep.<key>` with each swept value.

Exit codes: 0 every child finished; 1 a child failed (the others still ran; its row says FAILED);
2 bad input (nothing started, no MLflow run); 130 interrupted (parent and running child closed KILLED).
"""

import argparse
import os
import signal
from typing import Optional, Sequence

from orchestrator import console
from orchestrator.cli.program import interrupted, parse_job_args, prog, refused
from orchestrator.config import reference
from orchestrator.errors import INTERRUPT_DEADLINE_S, BadInput, command_exit, exit_within, interrupt_on_sigint
from orchestrator.tracking.secrets import install_console_redaction


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog("sweep"),
        description="Train a job once per precision preset (--presets), or per point of a grid over any config keys "
                    "(--grid), and compare speed, memory and accuracy in MLflow.",
        epilog=reference.render(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("job", help="job YAML file, e.g. jobs/quickstart.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every child run")
    parser.add_argument("--presets",
                        help="comma-separated presets, the first is the baseline, e.g. O0,O1,O2,bf16-mixed "
                             "(the shorthand of --grid precision.preset=...)")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                        help="sweep a config key over comma-separated values; repeat for more keys, the sweep runs "
                             "their cartesian product (the first point is the baseline), e.g. --grid optim.lr=0.1,0.05")
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                        help="an existing Ray cluster (ray://HOST:10001 or HOST:6379; default: $RAY_ADDRESS, "
                             "else a local Ray)")
    parser.add_argument("--max-accuracy-drop", type=float, default=0.01,
                        help="name the presets (or grid points) whose final accuracy is lower than the first's "
                             "by more than this (0.01 = 1 point)")
    return parse_job_args(parser, argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    install_console_redaction()  # before anything can print a secret (MLflow's own lines included)
    args = parse_args(argv)
    console.from_args(args)
    # torch, Ray and MLflow (seconds) once the arguments are parsed: `--help` prints without them.
    from orchestrator.cli.sweep_run import run_sweep, start_parent, validate

    previous_sigint = interrupt_on_sigint()  # as submit: Ctrl-C ends the sweep within INTERRUPT_DEADLINE_S
    exit_within(INTERRUPT_DEADLINE_S)
    try:
        try:
            plan = validate(args)
            parent = start_parent(plan, args.max_accuracy_drop)  # MLflow unreachable: exit 2, nothing started
        except BadInput as exc:
            return refused(exc)
        except KeyboardInterrupt as exc:  # before any run
            return interrupted(exc)
        return run_sweep(plan, parent, args.max_accuracy_drop)
    finally:
        exit_within(None)  # a deadline an interrupt started runs on: the command is ending
        if previous_sigint is not None:
            signal.signal(signal.SIGINT, previous_sigint)


if __name__ == "__main__":
    command_exit(main())
