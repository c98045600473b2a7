"""The quickstart job through the Ray-free training loop under one precision preset: what it reports.

Runs `jobs/quickstart.yaml` (scikit-learn's digits, simple_cnn, SGD + one-cycle) with
`orchestrator.train.local.spawn`, the loop every Ray Train worker runs, on one rank (one GPU with
`--device cuda`), and writes what the loop reported: the precision audit (what each layer stored and
computed in after the first step, next to what the policy promised), the memory peaks (on CUDA
`torch.cuda.max_memory_allocated` and the reserved peak) and the bytes by dtype, the loss-scale telemetry of
every report (scale, skipped steps, growth events, overflow records) and the final accuracy.

Needs neither Ray nor MLflow, only torch, OmegaConf and scikit-learn: it is what the GPU visit
(`bench/gpu_visit.sh`) runs where those are all it has. `--through submit` runs the same job as a user does
(`orchestrator.run`: pre-flight, a local Ray, Ray Train, an MLflow run in a temporary SQLite store) and
records how the run ended and its final metrics, where Ray and MLflow are installed.

    python -m bench.visit_quickstart --preset O2 --device cuda --json out/gpu-visit/quickstart-O2.json
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common
from orchestrator.precision.fsdp import broken_fsdp_promises
from orchestrator.precision.policy import broken_promises
from orchestrator.common.report import Report

HARNESS = "visit_quickstart"
JOB = Path(__file__).resolve().parents[1] / "jobs" / "quickstart.yaml"
SCALE_KEYS = ("amp/loss_scale", "amp/skipped_steps", "amp/consecutive_skips", "amp/growth_events",
              "amp/nan_loss_steps", "amp/rank_disagreements", "amp/skip_rate")


def report_parts(report: Report) -> tuple[dict[str, float], dict[str, Any], dict[str, str]]:
    """(metrics, tables, tags) of one report of the loop (`orchestrator.common.report.Report`), with its overflow
    records as the `amp/overflow_log` table, as the driver logs them."""
    tables = dict(report.tables)
    if report.overflow_records:
        tables["amp/overflow_log"] = list(report.overflow_records)
    return dict(report.metrics), tables, dict(report.tags)


def audit_mismatches(audit: list[dict[str, Any]]) -> list[str]:
    """What the run's own check says of the audit: one message per layer whose parameters, shards, computation or
    output broke the policy's promise (a layer with no parameters promises no storage dtype)."""
    if any("unit" in entry for entry in audit):
        return broken_fsdp_promises(audit)
    return broken_promises(audit)


def _median_after_first(parts: list, key: str) -> Any:
    values = [metrics[key] for metrics, _, _ in parts if key in metrics]
    return statistics.median(values[1:] or values) if values else None


def summarise(reports: list[Any]) -> dict[str, Any]:
    """The figures of a run from its reports, in order."""
    parts = [report_parts(report) for report in reports]
    last: dict[str, float] = {}
    for metrics, _, _ in parts:
        last.update(metrics)
    audit = next((tables["precision/audit"] for _, tables, _ in parts if "precision/audit" in tables), [])
    breakdown = next((tables["memory/breakdown"] for _, tables, _ in parts if "memory/breakdown" in tables), [])
    speeds = [metrics["perf/samples_per_s"] for metrics, _, _ in parts if "perf/samples_per_s" in metrics]
    tags: dict[str, str] = {}
    for _, _, report_tags in parts:
        tags.update(report_tags)
    return {
        "final": {key: last[key] for key in ("eval/accuracy", "eval/loss", "train/loss", "step") if key in last},
        # The first window holds the audited first step (and compilation, where asked): left out.
        "samples_per_s": speeds, "samples_per_s_median": statistics.median(speeds[1:] or speeds) if speeds else None,
        # MFU and FLOPs (issue figures on the GPU): per report, the first window left out as above.
        **{f"{key.removeprefix('perf/')}_median": _median_after_first(parts, key)
           for key in ("perf/mfu", "perf/tflops_per_s", "perf/tokens_per_s")},
        "time_split": [{key: metrics[key] for key in metrics if key.startswith("time/")}
                       for metrics, _, _ in parts if "time/compute_s" in metrics],
        "loss_scale": [{"step": metrics.get("step"), **{key: metrics[key] for key in SCALE_KEYS if key in metrics}}
                       for metrics, _, _ in parts if "amp/loss_scale" in metrics],
        "loss_scale_final": {key: last[key] for key in SCALE_KEYS if key in last},
        "overflow_log": [record for _, tables, _ in parts for record in tables.get("amp/overflow_log", [])],
        "memory": {key: value for key, value in last.items() if key.startswith("memory/")},
        "memory_breakdown": breakdown,
        "audit": audit, "audit_mismatches": audit_mismatches(audit),
        "tags": tags, "reports": len(reports),
    }


def main(argv=None) -> int:
    cli = common.with_device(common.parser(HARNESS, "the quickstart job through the Ray-free loop under one preset: "
                                                    "audit, memory peaks, loss-scale telemetry"))
    cli.add_argument("--preset", default="O1", help="precision preset (O0..O3, bf16-mixed, bf16-true, ...)")
    cli.add_argument("--job", default=str(JOB), help="job file (default jobs/quickstart.yaml)")
    cli.add_argument("--through", choices=("loop", "submit"), default="loop",
                     help="loop: the Ray-free loop (default); submit: Ray Train and MLflow, as `orchestrator.submit`")
    cli.add_argument("overrides", nargs="*", help="more key=value overrides of the job")
    args = cli.parse_args(argv)
    device = common.chosen_device(args)
    if device is None:
        return 2

    from omegaconf import OmegaConf

    from orchestrator.config import load_job
    from orchestrator.train.local import spawn

    overrides = [f"precision.preset={args.preset}", "scaling.num_workers=1",
                 f"scaling.use_gpu={str(device.type == 'cuda').lower()}"]
    if args.smoke:  # a few steps of one epoch, every report kind still made
        overrides += ["run.epochs=1", "run.max_steps_per_epoch=3", "run.batch_size=16", "tracking.log_every_n_steps=1"]
    overrides += args.overrides
    if args.through == "submit":
        return through_submit(args, overrides, device)
    cfg = load_job(args.job, overrides)
    job = OmegaConf.to_container(cfg, resolve=True)
    with tempfile.TemporaryDirectory(prefix="ampflow-visit-") as tmp:
        started = time.perf_counter()
        result = spawn(job, 1, Path(tmp))
        wall = time.perf_counter() - started
    figures = {**summarise(result["reports"]), "wall_s": wall}

    final, scale, memory = figures["final"], figures["loss_scale_final"], figures["memory"]
    print(f"bench.visit_quickstart on {common.device_description(device)}: {Path(args.job).name}, preset {args.preset}, "
          f"{figures['reports']} reports in {wall:.1f} s")
    common.print_table(["figure", "value"], [
        ["eval/accuracy", final.get("eval/accuracy", float("nan"))],
        ["samples/s (median)", figures["samples_per_s_median"] or float("nan")],
        ["MFU (median)", figures["mfu_median"] if figures["mfu_median"] is not None else float("nan")],
        ["memory/peak_bytes", memory.get("memory/peak_bytes", float("nan"))],
        ["amp/loss_scale", scale.get("amp/loss_scale", float("nan"))],
        ["amp/skipped_steps", scale.get("amp/skipped_steps", float("nan"))],
        ["audited layers", len(figures["audit"])],
        ["audit mismatches", len(figures["audit_mismatches"])],
    ])
    common.finish(HARNESS, device=common.device_description(device),
                  config={"job": Path(args.job).name, "preset": args.preset, "overrides": overrides, "world_size": 1,
                          "smoke": args.smoke},
                  figures=figures, ratios={}, targets={}, json_path=args.json)
    if figures["audit_mismatches"]:
        print(f"error: {len(figures['audit_mismatches'])} layers did not run as preset {args.preset} promised "
              f"(audit_mismatches in the JSON)", file=sys.stderr)
        return 1
    return 0


def through_submit(args, overrides: list[str], device) -> int:
    """The job through `orchestrator.run` (what `submit` does), its MLflow store and checkpoints in a temporary
    folder: how the run ended, its final metrics and its audit artifact."""
    from orchestrator import run

    with tempfile.TemporaryDirectory(prefix="ampflow-visit-submit-") as tmp:
        overrides = [*overrides, f"tracking.uri=sqlite:///{tmp}/mlflow.db", f"checkpoint.storage_path={tmp}/ray_results"]
        started = time.perf_counter()
        result = run(args.job, overrides)
        wall = time.perf_counter() - started
        audit = None
        if result.run_id is not None:
            import mlflow

            mlflow.set_tracking_uri(f"sqlite:///{tmp}/mlflow.db")
            try:
                audit = mlflow.artifacts.load_dict(f"runs:/{result.run_id}/precision/audit.json")
            except Exception as exc:  # noqa: BLE001: recorded, the run's own outcome is what matters
                audit = {"error": f"{type(exc).__name__}: {exc}"}
    figures = {"status": result.status, "error": result.error, "metrics": result.metrics, "audit": audit,
               "wall_s": wall}
    print(f"bench.visit_quickstart --through submit on {common.device_description(device)}: preset {args.preset}, "
          f"{result.status} in {wall:.1f} s, eval/accuracy {result.metrics.get('eval/accuracy')}")
    common.finish(HARNESS, device=common.device_description(device),
                  config={"job": Path(args.job).name, "preset": args.preset, "overrides": overrides, "world_size": 1,
                          "through": "submit", "smoke": args.smoke},
                  figures=figures, ratios={}, targets={}, json_path=args.json)
    return 0 if result.status == "FINISHED" else 1


if __name__ == "__main__":
    sys.exit(main())
