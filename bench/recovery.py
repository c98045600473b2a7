"""bench.recovery: what a lost node and a preemption notice cost a run on a Ray cluster.

For each scenario, per repeat: the time from the strike to the first step past the one the run had reached
(`recovery_s`: the restarted attempt's start, its resume and the steps it trains again), and the steps trained
again (`steps_redone`).

- `node-loss`: a `ray.cluster_utils.Cluster` on this machine (a head without CPUs, three nodes of one CPU),
  `submit --address`; rank 1's node is removed (its processes SIGKILLed) while rank 1 waits at `--at-step`,
  once the driver has logged the step before. `steps_redone` is the run's tag (`orchestrator.tracking.nodes`).
- `preemption`: `submit` with a Ray of its own; rank 1's process gets SIGTERM in the middle of `--at-step`.
  `steps_redone` is the step struck minus the step the restart resumed from (`resumed_from_step`).
- `elastic-shrink`: as `node-loss`, on two nodes with `scaling.num_workers: [1, 2]`: the run goes on with one
  worker on the node left, no spare node needed.
- `elastic-grow`: `[1, 2]` on one node; while rank 0 waits at `--at-step`, a second node joins, and the run goes
  on with two workers from its newest checkpoint once Ray Train's next look for room finds it
  (`scaling.resize_check_s`, `--resize-check-s`). `recovery_s` runs from the join to the first step trained by
  two workers; `steps_redone`: the steps reported before the join that the grown group trained again.

Each run's own goodput (`goodput/*`, `orchestrator.tracking.goodput`) is read back too: the share of its wall time,
submit to end, spent in steps that count, with the seconds its restarts and its steps trained again cost.

All train digits on 2 workers (elastic: up to 2), checkpoints every `--every` steps, a report every step, `failure.max_failures: 1`.
The first step past the strike is the first the struck attempt never reported (`--at-step` after a node loss, the
next one after a notice, whose step was finished and checkpointed): its time is when the driver's MLflow writer
took its report (the writer polls every second; Ray Train's controller takes reports every 2 s on
a cluster that does not set RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 0.5 s in a Ray that submit starts).

    python -m bench.recovery [--scenarios node-loss,preemption,elastic-shrink,elastic-grow] [--repeats 1]
                             [--json PATH]
"""

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
FAST_NODE_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000,
                   "health_check_timeout_ms": 1000, "health_check_failure_threshold": 2}
"""Ray declares a node dead ~3 s after it stops answering here (15 s and more by default): `--default-health-checks`
keeps Ray's."""


NODES = {"node-loss": 3, "elastic-shrink": 2, "elastic-grow": 1}
"""The 1-CPU nodes each cluster scenario starts with (one worker fits on each); `preemption` needs no cluster."""


def job(args, tmp: Path, experiment: str, marker: Path, address_storage: str) -> Path:
    path = tmp / f"{experiment}.yaml"
    elastic = experiment.startswith("elastic")
    scaling = {"num_workers": [1, 2], "resize_check_s": args.resize_check_s} if elastic else {"num_workers": 2}
    path.write_text(yaml.safe_dump({
        "model": {"name": "simple_cnn"}, "data": {"name": "digits"}, "scaling": scaling,
        "run": {"epochs": 1, "batch_size": 32, "max_steps_per_epoch": args.steps, "seed": 0},
        "tracking": {"uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": experiment, "log_every_n_steps": 1,
                     "log_model": False},
        "checkpoint": {"every_n_steps": args.every, "storage_path": address_storage},
        "failure": {"max_failures": 1},
        "callbacks": [{"name": "bench.recovery_hooks:PauseAt",
                       "kwargs": {"rank": 0 if experiment == "elastic-grow" else 1, "at_step": args.at_step,
                                  "marker": str(marker)}}],
    }, sort_keys=False))
    return path


def env_for(ray_tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "MLFLOW_TRACKING_URI"}
    return {**env, "RAY_TMPDIR": str(ray_tmp), "PYTHONPATH": str(REPO)}


def wait(predicate, process, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (found := predicate()):
        if process.poll() is not None:
            raise RuntimeError(f"submit ended (rc {process.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.1)
    return found


def logged(uri: str, experiment: str):
    """(client, run) of the experiment's one run, once there is one."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id]) if found else []
    return (client, runs[0]) if runs else None


def loss_steps(client, run_id: str) -> dict[int, float]:
    """train/loss's step -> the time (s) the writer took it."""
    return {m.step: m.timestamp / 1000 for m in client.get_metric_history(run_id, "train/loss")}


def first_grown_step(client, run_id: str) -> int:
    """The first step two workers trained (`system/world_size`)."""
    return min(m.step for m in client.get_metric_history(run_id, "system/world_size") if m.value == 2)


def one_run(args, scenario: str, tmp: Path) -> dict:
    from ray.cluster_utils import Cluster

    ray_tmp = Path(tempfile.mkdtemp(prefix="ampflow-rt-", dir="/tmp"))  # short: Ray's socket paths are limited
    (ray_tmp / "ray").mkdir()
    marker = tmp / f"{scenario}.marker"
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    path = job(args, tmp, scenario, marker, str(tmp / f"{scenario}-storage"))
    command = [sys.executable, "-m", "orchestrator.submit", str(path)]
    cluster = None
    previous = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = str(ray_tmp)
    try:
        if scenario in NODES:
            head = {"num_cpus": 0, "temp_dir": str(ray_tmp / "ray"), "include_dashboard": False}  # no port 8265
            if not args.default_health_checks:
                head["_system_config"] = FAST_NODE_DEATH
            cluster = Cluster(initialize_head=True, head_node_args=head)
            for _ in range(NODES[scenario]):
                cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            command += ["--address", cluster.address]
        with open(tmp / f"{scenario}.console", "w") as console:
            driver = subprocess.Popen(command, cwd=tmp, env=env_for(ray_tmp), stdout=console, stderr=subprocess.STDOUT)
        try:
            where = json.loads(wait(lambda: marker.exists() and marker.read_text(), driver, 300, "the step to strike"))
            def step_before_logged():
                found = logged(uri, scenario)
                return found and args.at_step - 1 in loss_steps(found[0], found[1].info.run_id)

            wait(step_before_logged, driver, 60, f"step {args.at_step - 1} logged")
            struck_at = time.time()
            if scenario == "elastic-grow":
                cluster.add_node(num_cpus=1)
            elif scenario in NODES:
                (node,) = [n for n in cluster.worker_nodes if n.node_id == where["node_id"]]
                cluster.remove_node(node, allow_graceful=False)
            else:
                os.kill(where["pid"], signal.SIGTERM)
            if driver.wait(timeout=600) != 0:
                raise RuntimeError(f"submit failed:\n{(tmp / f'{scenario}.console').read_text()[-3000:]}")
        finally:
            if driver.poll() is None:
                driver.kill()
                driver.wait()
    finally:
        if cluster is not None:
            cluster.shutdown()
        if previous is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = previous
        shutil.rmtree(ray_tmp, ignore_errors=True)
    client, run = logged(uri, scenario)
    tags = run.data.tags
    # The first step the struck attempt never reported: the struck step itself after a loss (its report never
    # came), the one after it after a notice (the struck step was finished and checkpointed).
    resumed = int(tags["resumed_from_step"])
    if scenario == "elastic-grow":
        first_new = loss_steps(client, run.info.run_id)[first_grown_step(client, run.info.run_id)]
        redone = args.at_step - 1 - resumed
    else:
        first_new = loss_steps(client, run.info.run_id)[max(args.at_step, resumed + 1)]
        redone = int(tags["steps_redone"]) if scenario in NODES else args.at_step - resumed
    metrics = run.data.metrics
    goodput = {key.removeprefix("goodput/"): metrics[key] for key in sorted(metrics) if key.startswith("goodput/")}
    said = [line.strip() for line in (tmp / f"{scenario}.console").read_text().splitlines()
            if line.startswith("  time: ")]
    return {"recovery_s": first_new - struck_at, "steps_redone": redone,
            "resumed_from_step": int(tags["resumed_from_step"]), "told": "node_lost" in tags, "goodput": goodput,
            "console": said[0] if said else None}


def goodput_said(goodput: dict) -> str:
    """`goodput 41% of 52 s (restarts 12.0 s, redone 0.6 s)`: the run's own accounting (`goodput/*`)."""
    if not goodput:
        return "no goodput logged"
    return (f"goodput {100 * goodput['fraction']:.0f}% of {goodput['wall_s']:.0f} s (start-up "
            f"{goodput['startup_s']:.1f} s, restarts {goodput['restarts_s']:.1f} s, redone {goodput['redone_s']:.1f} s)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.recovery", description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="node-loss,preemption")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4, help="checkpoint.every_n_steps")
    parser.add_argument("--at-step", type=int, default=7, help="the step struck")
    parser.add_argument("--resize-check-s", type=float, default=5.0,
                        help="scaling.resize_check_s of the elastic scenarios (how often a run looks for room)")
    parser.add_argument("--default-health-checks", action="store_true",
                        help="Ray's own node health checks (declares a lost node dead after ~15 s or more)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    figures: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):
        for scenario in args.scenarios.split(","):
            with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
                result = one_run(args, scenario, Path(tmp))
            figures.setdefault(scenario, []).append(result)
            print(f"{scenario} #{repeat + 1}: {result['recovery_s']:.1f} s to the first new step, "
                  f"{result['steps_redone']} step(s) redone (resumed from step {result['resumed_from_step']}); "
                  f"{goodput_said(result['goodput'])}\n    {result['console']}", flush=True)
    print("\n| scenario | recovery_s (median) | steps redone | goodput (median) | restarts_s, redone_s (median) "
          "| repeats |\n| --- | --- | --- | --- | --- | --- |")
    for scenario, results in figures.items():
        timed = [r["goodput"] for r in results if r["goodput"]]
        median = {key: statistics.median(g[key] for g in timed) for key in ("fraction", "restarts_s", "redone_s")} \
            if timed else None
        goodput = f"{100 * median['fraction']:.0f}% | {median['restarts_s']:.1f}, {median['redone_s']:.1f}" \
            if median else "- | -"
        print(f"| {scenario} | {statistics.median(r['recovery_s'] for r in results):.1f} | "
              f"{sorted({r['steps_redone'] for r in results})} | {goodput} | {len(results)} |")
    if args.json:
        import torch

        medians = {f"{scenario}_recovery_s": statistics.median(r["recovery_s"] for r in results)
                   for scenario, results in figures.items()}
        medians |= {f"{scenario}_goodput": statistics.median(r["goodput"]["fraction"] for r in results)
                    for scenario, results in figures.items() if all(r["goodput"] for r in results)}
        args.json.write_text(json.dumps({
            "harness": "recovery", "device": f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
            "torch": torch.__version__, "config": vars(args) | {"json": str(args.json)}, "figures": figures,
            "ratios": medians, "targets": {},
            "command": " ".join(["python -m bench.recovery", *(argv or sys.argv[1:])])}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
