"""Search beyond a grid with Ray Tune: each trial is a whole ampflow run (its own MLflow run, checkpoints
and pre-flight), started from Python with `orchestrator.run`, and Tune picks the next learning rate and
preset from the trials' final metrics.

    python examples/tune/search.py                # 8 trials of the quickstart job on this machine
    python examples/tune/search.py --trials 2 run.epochs=1 run.max_steps_per_epoch=4

The trials run one at a time: each starts a Ray Train run of its own on the same Ray, which needs the
CPUs (or GPUs) its `scaling` section asks for.
"""

import argparse
from pathlib import Path

import ray
from ray import tune

from orchestrator import run

PROJECT = Path(__file__).resolve().parents[2]


def trial(config: dict, job: str, overrides: list[str], tracking_uri: str) -> None:
    """One Tune trial: an ampflow run with the trial's values; Tune gets its final metrics."""
    result = run(job, [*overrides, f"optim.lr={config['lr']}", f"precision.preset={config['preset']}",
                       f"tracking.uri={tracking_uri}", "tracking.experiment=tune-search"])
    # Tune's trial directory is the working directory here: every path above is absolute.
    tune.report({"eval/accuracy": result.metrics.get("eval/accuracy", 0.0),
                 "eval/loss": result.metrics.get("eval/loss", float("inf")),
                 "status": result.status, "mlflow_run_id": result.run_id or ""})


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("overrides", nargs="*", metavar="key=value", help="overrides for every trial")
    cli.add_argument("--job", default=str(PROJECT / "jobs" / "quickstart.yaml"))
    cli.add_argument("--trials", type=int, default=8)
    args = cli.parse_args()

    ray.init()
    storage = PROJECT / "ray_results"
    trainable = tune.with_parameters(
        trial, job=str(Path(args.job).resolve()),
        overrides=[*args.overrides, f"checkpoint.storage_path={storage}"],
        tracking_uri=f"sqlite:///{PROJECT / 'mlflow.db'}")
    tuner = tune.Tuner(
        # The trial itself mostly waits on its Ray Train run: a tenth of a CPU leaves the workers theirs.
        tune.with_resources(trainable, {"cpu": 0.1}),
        param_space={"lr": tune.loguniform(1e-3, 1e-1), "preset": tune.choice(["O0", "O1", "bf16-mixed"])},
        tune_config=tune.TuneConfig(metric="eval/accuracy", mode="max", num_samples=args.trials,
                                    max_concurrent_trials=1),
        run_config=tune.RunConfig(name="ampflow-tune-search", storage_path=str(storage)),
    )
    best = tuner.fit().get_best_result()
    print(f"best: lr={best.config['lr']:.4g} preset={best.config['preset']} "
          f"eval/accuracy={best.metrics['eval/accuracy']:.4f} (MLflow run {best.metrics['mlflow_run_id']})")


if __name__ == "__main__":
    main()
