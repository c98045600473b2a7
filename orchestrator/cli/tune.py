"""`python -m orchestrator.tune JOB [key=value ...] --output FILE` (also `ampflow tune`): choose the cheapest
per-layer precision policy that keeps the model's numbers, and write it as a job that `submit` takes as it is
(the tuner itself: `orchestrator.autotune`).

Exit codes: 0 written; 1 no policy passed the validation (nothing written), or the tune's MLflow run could not be
logged; 2 bad input, refused before any work: the job, `--output` (a file that can be written; the job file itself
only with `--force`), float8 asked for where it cannot run, MLflow unreachable unless `tracking.required: false`.
"""

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from orchestrator import console
from orchestrator.cli.program import check_output_file, prog, refused
from orchestrator.config.loader import load_job
from orchestrator.errors import EXIT_FAILED, EXIT_OK, BadInput, command_exit
from orchestrator.tracking.secrets import install_console_redaction, redact, remember_secrets
from orchestrator.tracking.tracker import TrackingUnavailable, quick_http_failures, reach, resolve_uri


def main(argv: Optional[Sequence[str]] = None) -> int:
    install_console_redaction()
    quick_http_failures()
    parser = argparse.ArgumentParser(
        prog=prog("tune"), description="Find the cheapest per-layer precision policy that keeps the model's numbers "
        "(the job's `tune` section: target, tolerance, candidates, batches, validate_steps) and write it as a job.")
    parser.add_argument("job", type=Path, help="the job file (YAML)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as submit takes them (tune.target=h100)")
    parser.add_argument("--output", "-o", type=Path, required=True,
                        help="where to write the tuned job file (not a directory; checked before the tune starts)")
    parser.add_argument("--force", action="store_true",
                        help="let --output be the job file itself: the tuned job replaces it")
    console.add_arguments(parser)
    args = parser.parse_args(argv)
    console.from_args(args)

    from orchestrator.autotune.record import log_tune
    from orchestrator.autotune.run import ValidationFailed, refuse_unavailable_float8, tune, tuned_job

    try:  # every refusal before the work: the job, --output, float8, the tracking store
        cfg = load_job(args.job, args.overrides)
        remember_secrets(cfg)  # masked wherever they show, as the environment's are
        check_output(args.output, args.job, args.force)
        refuse_unavailable_float8(cfg, str(args.job))
        uri = tracking_store(cfg)
        result = tune(cfg, say=console.logger.info)
    except BadInput as exc:
        return refused(exc)
    except ValidationFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    header = (f"# Written by `ampflow tune {args.job}` ({cfg.tune.target or result.device}, tolerance "
              f"{cfg.tune.tolerance:g}): {len(result.lowered)} layer(s) lowered.\n")
    text = header + tuned_job(args.job, args.overrides, result.precision)
    try:
        args.output.write_text(text)
    except OSError as exc:  # checked before the tune; gone since (a full disk, a directory removed)
        print(f"error: could not write --output {args.output} ({exc.strerror or exc}); nothing is written: "
              "run the tune again with another --output.", file=sys.stderr)
        return EXIT_FAILED
    print(summary(result, cfg), file=sys.stderr)
    print(f"wrote {args.output}")
    if uri is None:
        return EXIT_OK
    try:
        run_id, hint = log_tune(uri, cfg, args.job, result, text, args.output)
    except Exception as exc:  # answered at the start, not now: one line, not MLflow's traceback
        detail = (str(exc).splitlines() or [""])[0]
        print(f"{'error' if cfg.tracking.required else 'warning'}: the tuned job is written to {args.output}, but "
              f"its MLflow run could not be logged at {redact(uri)} ({type(exc).__name__}: {redact(detail)[:300]}).",
              file=sys.stderr)
        return EXIT_FAILED if cfg.tracking.required else EXIT_OK
    print(f"Tune run: {run_id}\nView it:  {hint}")
    return EXIT_OK


def check_output(output: Path, job: Path, force: bool) -> None:
    """`--output` before any work: a file that can be written (`check_output_file`), and not the job file itself
    unless `--force`. BadInput naming `--output` otherwise."""
    if output.exists() and not output.is_dir() and os.path.samefile(output, job) and not force:
        raise BadInput(f"--output {output} is the job file {job}: the tuned job would replace it. Write it "
                       "elsewhere, or add --force to replace the job file.")
    check_output_file(output, "tuned.yaml")


def tracking_store(cfg) -> Optional[str]:
    """The tracking store the tune's run goes to, once it answers; TrackingUnavailable (exit 2) when it does not,
    or, under `tracking.required: false`, None after saying once that the tune goes on without its MLflow run."""
    uri = resolve_uri(cfg.tracking.uri, Path.cwd())
    try:
        reach(uri, cfg.tracking.experiment, "to tune anyway (the tuned job is written, without its MLflow run)")
    except TrackingUnavailable:
        if cfg.tracking.required:
            raise
        print(f"warning: MLflow at {redact(uri)} cannot be reached; tuning anyway (tracking.required: false): the "
              "tuned job is written, without its MLflow run.", file=sys.stderr)
        return None
    return uri


def summary(result, cfg) -> str:
    """The console's account of the choice: each lowered layer, the predictions, the validation."""
    lines = []
    if not result.lowered:
        where = cfg.tune.target or f"this {result.device}"
        lines.append(f"every layer stays float32: on {where} no lowered layer is cheaper within "
                     f"tune.tolerance={cfg.tune.tolerance:g}" + (" (plan for a GPU with tune.target=h100)"
                                                                  if where in ("cpu", "this cpu") else ""))
    for layer, dtype in result.lowered.items():
        row = next(r for r in result.table if r["layer"] == layer and r["dtype"] == dtype)
        lines.append(f"  {layer:<32} {dtype:<9} output error {row['output_error']:.2e}  grad error "
                     f"{row['grad_error']:.2e}")
    refused = sorted({r["layer"] for r in result.table if r["refused"] and r["refused"].startswith("no fp16")})
    if refused:
        lines.append(f"  never fp16 (no headroom): {', '.join(refused)}")
    failed = [row for row in result.table if row["refused"] and row["refused"].startswith("fails in")]
    if failed:
        lines.append("  skipped, the model does not run with them lowered:")
        lines.extend(f"    {row['layer']}: {row['refused']}" for row in failed)
    lines.extend(not_tried(result.table))
    p = result.predicted
    lines.append(f"predicted: {p['predicted_speedup']:.2f}x the fp32 speed of the tuned layers, activations "
                 f"{p['predicted_activation_bytes_ratio']:.2f}x and parameters (fp32 masters included) "
                 f"{p['predicted_param_bytes_ratio']:.2f}x fp32's; errors: output {p['predicted_output_error']:.2e}, "
                 f"gradients {p['predicted_grad_error']:.2e}")
    if result.validations:
        last = result.validations[-1]
        lines.append(f"validation: loss {last.gap:.2e} from fp32's over {len(last.policy_losses)} steps "
                     f"(tolerance {cfg.tune.tolerance:g}), {len(result.validations)} round(s)")
    return "\n".join(lines)


def not_tried(table) -> list[str]:
    """For each candidate dtype refused on every layer before it was measured (float8 without torchao, off Linear
    layers, without float8 matmuls; a dtype the target lacks): why, layer by layer."""
    lines = []
    for dtype in dict.fromkeys(row["dtype"] for row in table if row["dtype"] != "float32"):
        rows = [row for row in table if row["dtype"] == dtype]
        if not all(row["refused"] and math.isnan(row["output_error"]) for row in rows):
            continue
        why: dict[str, list[str]] = {}
        for row in rows:
            why.setdefault(row["refused"], []).append(row["layer"])
        lines.append(f"  {dtype} not tried on any layer:")
        lines.extend(f"    {', '.join(layers)}: {reason}" for reason, layers in why.items())
    return lines


if __name__ == "__main__":
    command_exit(main())
