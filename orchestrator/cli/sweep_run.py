"""The sweep `orchestrator.cli.sweep` runs: its plan checked before anything starts (`validate`), the parent run
(`start_parent`), one child run per point of the grid, and the comparison logged to the parent (`run_sweep`)."""

import argparse
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf

from orchestrator.cli.sweep_grid import PRESET_KEY, parse_grid, point_labels
from orchestrator.cli.sweep_report import (add_baseline_ratios, child_row, comparison_figure, label_of, markdown_table,
                                           verdict)
from orchestrator.config import flatten, load_job
from orchestrator.config.loader import configs_dir, parse_overrides
from orchestrator.config.yamlsafe import load_yaml_mapping
from orchestrator.errors import EXIT_FAILED, EXIT_OK, BadInput, Interrupted, interrupt_on_sigint, interrupt_on_sigterm
from orchestrator.runner import remote
from orchestrator.runner.driver import execute, plan_run
from orchestrator.runner.preflight import RunChoice, preflight
from orchestrator.runner.ray_start import init_ray
from orchestrator.runner.records import close_run
from orchestrator.tracking.plots import _pyplot
from orchestrator.tracking.secrets import redact
from orchestrator.tracking.tracker import RunTracker, quick_http_failures, resolve_uri, standard_tags, view_hint
from orchestrator.train import models

logger = logging.getLogger("ampflow.sweep")


@dataclass
class SweepPlan:
    job_path: Path
    overrides: list[str]
    address: Optional[str]
    name: str
    """The parent run's name; child runs are `<name>-<label>`."""
    configs: dict[str, DictConfig]
    """Each point's resolved job config by its label, in sweep order (the first is the baseline)."""
    runs: list[RunChoice]
    """Each point's run, in the same order, as the pre-flight chose it (`<name>-<label>`)."""
    grid: list[tuple[str, list[str]]]
    """The swept keys and their values, in order (`--presets` is the key `precision.preset`)."""
    points: dict[str, dict[str, str]]
    """Each point's values of the swept keys, by its label."""

    @property
    def presets_only(self) -> bool:
        """A sweep of presets alone: rows labelled by preset, compared with the first preset."""
        return [key for key, _ in self.grid] == [PRESET_KEY]

    @property
    def presets(self) -> Optional[list[str]]:
        return dict(self.grid).get(PRESET_KEY)


def check_precision_keys(job_path: Path, overrides: list[str], configs: Sequence[DictConfig]) -> None:
    """The job's own precision keys (job file, command line and grid) apply on top of every preset.

    One that replaces a value a preset file sets would make that child not the preset it is named
    after, and the comparison a lie: exit 2. The rest (rules, scaler tuning, lint) are announced.
    """
    own = dict(load_yaml_mapping(job_path).get("precision") or {})
    own.update(OmegaConf.to_container(parse_overrides(overrides)).get("precision") or {})
    own.pop("preset", None)
    for cfg in configs:
        preset = cfg.precision.preset
        preset_values = load_yaml_mapping(configs_dir() / "precision" / f"{preset}.yaml", what="precision preset")
        for key, value in preset_values.items():
            if key in own and key != "lint" and cfg.precision[key] != value:
                raise BadInput(
                    f"precision.{key}: {job_path} (or the command line) sets {cfg.precision[key]}, which replaces "
                    f"preset {preset}'s {value}: that run would not be {preset}. Remove precision.{key} from the "
                    "job's precision section and the overrides to sweep presets (the sweep sets the preset).")
    if own:
        print(f"warning: {', '.join(f'precision.{key}' for key in own)} from {job_path} or the command line "
              "apply on top of every preset of the sweep.", file=sys.stderr)


def validate(args: argparse.Namespace) -> SweepPlan:
    """Submit's pre-flight, for every preset, before anything starts; BadInput (exit 2) otherwise."""
    if remote.is_job_server_address(args.address):
        raise BadInput(f"--address {redact(args.address)}: the sweep does not submit to a job server; it runs "
                       "the presets from this process. Pass the cluster's Ray address (ray://HEAD:10001), or "
                       "submit each preset with `python -m orchestrator.submit JOB precision.preset=P --address ...`.")
    if not 0 <= args.max_accuracy_drop < 1:
        raise BadInput(f"--max-accuracy-drop {args.max_accuracy_drop:g}: must be in [0, 1) (0.01 = 1 point).")
    grid = parse_grid(args.grid, args.presets)
    given = parse_overrides(args.overrides)  # `optim.lr=0.3` and `optim={lr: 0.3}` alike
    for key, _ in grid:
        if OmegaConf.select(given, key, default=None) is None:
            continue
        if key == PRESET_KEY:
            flag = "--presets" if args.presets is not None else "--grid precision.preset=..."
            raise BadInput(f"command line: precision.preset is set by the sweep; list the presets with {flag}.")
        raise BadInput(f"command line: {key} is swept by --grid; leave it out of the overrides.")
    job_path = Path(args.job)
    for key, values in grid:  # an unknown key or a value of the wrong type, named as the user gave it
        try:
            load_job(job_path, [*args.overrides, f"{key}={values[0]}"])
        except BadInput as exc:
            flag = "--presets" if key == PRESET_KEY and args.presets is not None else f"--grid {key}"
            raise BadInput(f"{flag}: {exc}") from None
    points = point_labels(grid)
    first = load_job(job_path, [*args.overrides, *(f"{k}={v}" for k, v in next(iter(points.values())).items())])
    name = f"{first.run.name}-sweep" if first.run.name else f"{job_path.stem}-sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    configs = {}
    for label, point in points.items():
        values = [f"{key}={value}" for key, value in point.items()]
        try:
            configs[label] = load_job(job_path, [*args.overrides, *values, f"run.name={name}-{label}"])
        except BadInput as exc:
            raise BadInput(f"--grid point {' '.join(values)}: {exc}") from None
    if PRESET_KEY in dict(grid):
        swept = [f"{key}={values[0]}" for key, values in grid if key != PRESET_KEY]
        check_precision_keys(job_path, [*args.overrides, *swept], list(configs.values()))
    checked = preflight(list(configs.values()), job_path, args.address)
    return SweepPlan(job_path, list(args.overrides), args.address, name, configs, checked.runs, grid, points)


def start_parent(plan: SweepPlan, max_accuracy_drop: float):
    """The parent MLflow run: the common config (without what varies per child: the swept keys, and the whole
    precision section when presets are swept), the sweep's params and tags."""
    quick_http_failures()
    base = next(iter(plan.configs.values()))
    swept = [key for key, _ in plan.grid]
    grid_text = ";".join(f"{key}={','.join(values)}" for key, values in plan.grid)

    def varies(key: str) -> bool:
        return key in swept or key == "run.name" or (plan.presets is not None and key.startswith("precision."))

    common = OmegaConf.to_container(base, resolve=True)
    for key in [*swept, "run.name", *(["precision"] if plan.presets is not None else [])]:
        *parents, leaf = key.split(".")
        section = common
        for parent in parents:
            section = section.get(parent) or {}
        section.pop(leaf, None)
    params = {key: value for key, value in flatten(base).items() if not varies(key)}
    params.update({"sweep.grid": grid_text, "sweep.job_file": str(plan.job_path),
                   "sweep.overrides": " ".join(plan.overrides)[:6000] or "(none)",
                   "sweep.max_accuracy_drop": str(max_accuracy_drop)})
    tags = {**standard_tags(plan.job_path, Path.cwd()),
            "ampflow.sweep": "true", "sweep.grid": grid_text, "job_file": str(plan.job_path)}
    if plan.presets is not None:
        params["sweep.presets"] = tags["sweep.presets"] = ",".join(plan.presets)
    if "mlflow.source.git.commit" in tags:
        tags["git_commit"] = tags["mlflow.source.git.commit"]
    uri = resolve_uri(base.tracking.uri, Path.cwd())
    header = f"# The sweep's common config; each child run has its own {', '.join(swept)} ({grid_text}).\n"
    return RunTracker.start(uri, base, run_name=plan.name, tags=tags, params=params,
                            config_yaml=header + yaml.safe_dump(common, sort_keys=False))


def run_children(plan: SweepPlan, parent) -> list[tuple[str, Any, int]]:
    """Each point's run, in order: (label, its RunTracker or None, exit code). A failed child does not stop
    the others; Ctrl-C closes the running child KILLED (if `execute` did not already) and propagates."""
    results = []
    for number, ((label, cfg), run) in enumerate(zip(plan.configs.items(), plan.runs), start=1):
        _ctrl_c_interrupts()
        what = f"preset {label}" if plan.presets_only else \
            ", ".join(f"{key}={value}" for key, value in plan.points[label].items())
        logger.info(f"\n=== sweep {plan.name}: {what} ({number}/{len(plan.configs)}) ===")
        child = None
        try:
            child = plan_run(cfg, plan.job_path, plan.address, run, parent_run_id=parent.run_id)
            if child.tracker is not None:
                child.tracker.set_tags({f"sweep.{key}": value for key, value in plan.points[label].items()})
            exit_code = execute(child)
        except (KeyboardInterrupt, SystemExit):
            if child is not None and child.tracker is not None and child.tracker.status() == "RUNNING":
                close_run(child.tracker, "KILLED", 10, cfg.checkpoint.storage_path, run.name)
            raise
        except Exception as exc:  # a driver-side error in one child (execute closed its run FAILED)
            print(f"error: {what} failed: {redact(f'{type(exc).__name__}: {exc}')}", file=sys.stderr)
            exit_code = EXIT_FAILED
        results.append((label, child.tracker if child is not None else None, exit_code))
    return results


def _ctrl_c_interrupts() -> None:
    """Ctrl-C raises Interrupted(SIGINT), whatever a child's run left installed."""
    interrupt_on_sigint()


def grid_row(plan: SweepPlan, label: str, tracker, exit_code: int) -> dict[str, Any]:
    """A child's comparison row: `child_row`, and for a grid its label (`point`) and a column per swept key
    (the preset is the `preset` column)."""
    row = child_row(tracker, plan.configs[label].precision.preset or "custom", exit_code)
    if not plan.presets_only:
        row["point"] = label
        row.update({key: value for key, value in plan.points[label].items() if key != PRESET_KEY})
    return row


def log_comparison(parent, rows: list[dict[str, Any]]) -> None:
    """The comparison on the parent run: JSON rows, a Markdown table, a chart, per-preset metrics."""
    parent.log_text(json.dumps(rows, indent=2), "sweep/comparison.json")
    parent.log_text(markdown_table(rows), "sweep/comparison.md")
    figure = comparison_figure(rows)
    parent.log_figure(figure, "sweep/comparison.png")
    _pyplot().close(figure)
    parent.log_metrics({f"sweep/{label_of(row)}/{key}": value for row in rows for key, value in row.items()
                        if isinstance(value, (int, float)) and not isinstance(value, bool)})


def run_sweep(plan: SweepPlan, parent, max_accuracy_drop: float) -> int:
    """Run the children on one Ray, log and print the comparison; the parent always ends FINISHED (every
    child finished), FAILED or KILLED."""
    import ray  # about a second to import: the sweep's --help and bad input exit without it

    base = next(iter(plan.configs.values()))
    swept = f"presets {', '.join(plan.configs)}" if plan.presets_only else f"{len(plan.configs)} points of " + \
        " x ".join(f"{key} ({len(values)})" for key, values in plan.grid)
    logger.info(f"MLflow parent run {parent.run_id} ({plan.name}) in experiment '{base.tracking.experiment}' at "
                f"{redact(parent.uri)}: {swept}")
    started_ray, previous_sigterm = False, None
    try:
        # One Ray for every child: each child's execute() finds it initialised and leaves it running. Started
        # here as execute() would, so an import-path model is shipped as a job-level py_module.
        try:
            started_ray, _ = init_ray(plan.address, models.module_sources(base))
        except Exception as exc:  # e.g. no cluster answers at --address (RayUnreachable): no child was started
            close_run(parent, "FAILED", 10)
            print(f"error: Ray could not be started or reached ({type(exc).__name__}: {redact(str(exc))[:500]}). "
                  "Check --address / RAY_ADDRESS, or leave both out to train on a local Ray.", file=sys.stderr)
            return EXIT_FAILED
        previous_sigterm = interrupt_on_sigterm()
        results = run_children(plan, parent)
        _ctrl_c_interrupts()
        rows = add_baseline_ratios([grid_row(plan, label, tracker, exit_code) for label, tracker, exit_code in results])
        log_comparison(parent, rows)
        failed = any(exit_code != EXIT_OK for _, _, exit_code in results)
        close_run(parent, "FAILED" if failed else "FINISHED", base.tracking.flush_timeout_s)
    except (KeyboardInterrupt, SystemExit) as exc:  # SystemExit: Ctrl-C through Ray Train's handler (see above)
        close_run(parent, "KILLED", 10)
        interrupted = Interrupted.of(exc)
        print(f"\nsweep interrupted ({signal.Signals(interrupted.signum).name}): parent run {parent.run_id} and "
              "the running child marked KILLED; finished children keep their results.", file=sys.stderr)
        return interrupted.exit_code
    except BaseException:
        close_run(parent, "FAILED", 10)
        raise
    finally:
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
        if started_ray:
            ray.shutdown()

    print(f"\nSweep {plan.name} (ratios and delta vs {label_of(rows[0])}):\n")
    print(markdown_table(rows))
    print(verdict(rows, max_accuracy_drop))
    if not base.scaling.use_gpu:
        print("Note: on CPU, peak memory is each worker process's peak resident set, framework included; "
              "dtype savings show clearly on a GPU.")
    print(f"View it:  {redact(view_hint(parent.uri, parent.experiment_id, parent.run_id))}")
    return EXIT_FAILED if failed else EXIT_OK
