"""`python -m orchestrator.tune JOB [key=value ...] --output FILE` (also `ampflow tune`): choose the cheapest
per-layer precision policy that keeps the model's numbers, and write it as a job that `submit` takes as it is
(the tuner itself: `orchestrator.tune`).

Exit codes: 0 written; 1 no policy passed the validation (nothing written); 2 bad input.
"""

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from orchestrator import console
from orchestrator.cli.program import prog
from orchestrator.config.loader import load_job
from orchestrator.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, BadInput, command_exit
from orchestrator.tracking.secrets import install_console_redaction, redact
from orchestrator.tracking.tracker import quick_http_failures, resolve_uri


def main(argv: Optional[Sequence[str]] = None) -> int:
    install_console_redaction()
    quick_http_failures()
    parser = argparse.ArgumentParser(
        prog=prog("tune"), description="Find the cheapest per-layer precision policy that keeps the model's numbers "
        "(the job's `tune` section: target, tolerance, candidates, batches, validate_steps) and write it as a job.")
    parser.add_argument("job", type=Path, help="the job file (YAML)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as submit takes them (tune.target=h100)")
    parser.add_argument("--output", "-o", type=Path, required=True, help="where to write the tuned job file")
    console.add_arguments(parser)
    args = parser.parse_args(argv)
    console.from_args(args)

    from orchestrator.tune.record import log_tune
    from orchestrator.tune.run import ValidationFailed, tune, tuned_job

    try:
        cfg = load_job(args.job, args.overrides)
        result = tune(cfg, say=console.logger.info)
    except BadInput as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ValidationFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    header = (f"# Written by `ampflow tune {args.job}` ({cfg.tune.target or result.device}, tolerance "
              f"{cfg.tune.tolerance:g}): {len(result.lowered)} layer(s) lowered.\n")
    text = header + tuned_job(args.job, args.overrides, result.precision)
    args.output.write_text(text)
    uri = resolve_uri(cfg.tracking.uri, Path.cwd())
    run_id, hint = log_tune(uri, cfg, args.job, result, text, args.output)
    print(summary(result, cfg), file=sys.stderr)
    print(f"wrote {args.output}\nTune run: {run_id}\nView it:  {hint}")
    return EXIT_OK


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


if __name__ == "__main__":
    command_exit(main())
