"""bench.orchestration's candidates that start a local Ray in a subprocess of their own: `ours` (a real
`python -m orchestrator.submit`) and `raytrain` (the plain script from Ray Train's guide), and the job
every candidate trains.
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.orchestration_spawned import profiled, write_windows

REPO = Path(__file__).resolve().parents[1]


def job_dict(args, tmp: Path, steps: int | None = None) -> dict:
    """The job every candidate trains; `steps` per run (default --steps). The synthetic data is sized for the
    longest run of the invocation, so runs of different lengths build the same tensors (same start-up cost)."""
    return {
        "model": {"name": args.model},
        "data": {"name": "synthetic", "synthetic_samples": max(args.step_counts) * args.batch_size * args.workers},
        "precision": {"preset": "O0"},
        "scaling": {"num_workers": args.workers},
        "run": {"epochs": 1, "batch_size": args.batch_size, "max_steps_per_epoch": steps or args.steps, "seed": 0},
        "tracking": {"uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "bench-orchestration",
                     "log_every_n_steps": args.log_every, "log_model": False},
        "checkpoint": {"storage_path": str(tmp / "ray_results")},
    }


def ray_env(args) -> dict:
    """The environment of a subprocess that starts its own local Ray the way submit does: no RAY_ADDRESS (with
    --address, that one: both candidates then join the Ray there), torch threads per worker = --threads, and
    submit's report poll (or --health-check-interval-s)."""
    from orchestrator.runner.ray_start import HEALTH_CHECK_INTERVAL_S

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    if getattr(args, "address", None):
        env["RAY_ADDRESS"] = args.address
    env["OMP_NUM_THREADS"] = str(args.threads)
    # How often Ray Train's controller drains each worker's reports. submit sets HEALTH_CHECK_INTERVAL_S for a
    # local Ray unless the variable is set; the raytrain candidate gets the same value explicitly.
    env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(args.health_check_interval_s or HEALTH_CHECK_INTERVAL_S)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])  # Ray's workers too
    return env


def run_process(command: list[str], env: dict, timeout: float) -> dict:
    """Run `command` from the repository root; its wall time as seen from here."""
    import threading

    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    output = {"stdout": [], "stderr": []}

    def drain(stream, lines: list[str]) -> None:
        lines.extend(stream)

    readers = [threading.Thread(target=drain, args=(process.stdout, output["stdout"]), daemon=True),
               threading.Thread(target=drain, args=(process.stderr, output["stderr"]), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        returncode = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()  # our own child only
        process.wait()
        raise
    wall = time.perf_counter() - started
    for reader in readers:
        reader.join()
    if returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} exited {returncode}:\n{''.join(output['stdout'])[-3000:]}\n"
                           f"{''.join(output['stderr'])[-3000:]}")
    return {"process_wall_s": wall}


def run_ours(args, tmp: Path, index: int, steps: int) -> dict:
    import yaml
    from mlflow import MlflowClient

    from orchestrator.runner.records import read_record
    from orchestrator.tracking.summary_values import values

    name = f"bench-ours-{index}-{steps}"
    job_path = tmp / f"{name}.yaml"
    job = job_dict(args, tmp, steps)
    job["run"]["name"] = name
    job_path.write_text(yaml.safe_dump(job, sort_keys=False))
    process_started_at = time.time()
    done = run_process([sys.executable, "-m", "orchestrator.submit", str(job_path)], ray_env(args), args.timeout)
    client = MlflowClient(tracking_uri=job["tracking"]["uri"])
    experiment = client.get_experiment_by_name(job["tracking"]["experiment"])
    runs = client.search_runs([experiment.experiment_id], filter_string=f"attributes.run_name = '{name}'")
    run_id = runs[0].info.run_id
    history = sorted(client.get_metric_history(run_id, "perf/samples_per_s"), key=lambda m: m.step)
    windows = [m.value for m in history]
    run = client.get_run(run_id)  # a value set once is a summary tag (orchestrator.tracking.summary_values)
    launch = values(run.data.metrics, run.data.tags).get("perf/time_to_first_step_s")
    # The run record dates submit's `launched_at` (just before Ray starts), where perf/time_to_first_step_s
    # counts from: start-up then counts from the process start, as raytrain's does.
    launched_at = read_record(job["checkpoint"]["storage_path"], name)["launched_at"]
    from_start = launched_at - process_started_at + launch if launch is not None else None
    return {"windows": windows, "steady": windows[args.warmup_windows:], "launch_to_first_step_s": launch,
            "process_start_to_first_step_s": from_start, "first_to_last_step_s": None,
            "process_wall_s": done["process_wall_s"]}


def raytrain_train_func(config: dict) -> None:
    """The `raytrain` candidate's worker: Ray's getting-started script with the job's model, data and optimizer.

    Nothing of ampflow's step code: a DataLoader made a distributed one by `prepare_data_loader` (it adds the
    DistributedSampler and the move to the device), the model DDP-wrapped by `prepare_model`, SGD, cross-entropy,
    `ray.train.report` every `log_every` steps. Rank 0 takes the timestamps the `plain` ranks take.
    """
    import ray.train
    import ray.train.torch
    import torch.nn.functional as F
    from omegaconf import OmegaConf
    from torch.utils.data import DataLoader

    from orchestrator.train.data import build_datasets
    from orchestrator.train.models import build_model

    cfg, args = OmegaConf.create(config["job"]), argparse.Namespace(**config["args"])
    context = ray.train.get_context()
    rank = context.get_world_rank()
    torch.manual_seed(cfg.run.seed + rank)
    train_set, _ = build_datasets(cfg.data, cfg.model.num_classes)  # the same synthetic tensors as the others
    loader = ray.train.torch.prepare_data_loader(DataLoader(train_set, batch_size=cfg.run.batch_size, shuffle=True))
    model = ray.train.torch.prepare_model(build_model(cfg.model))
    o = cfg.optim
    optimizer = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    if context.get_world_size() > 1:
        loader.sampler.set_epoch(0)
    model.train()
    # Windows leave the report out, as ours's perf/samples_per_s does (`Window.exclude_since`): a window runs from
    # the end of one report to the start of the next. The reports stay in `first_to_last_step_s` and in the
    # process wall that --by-difference compares, and their time is recorded apart.
    marks, starts, report_s, first_step_s, first_step_end = [time.perf_counter()], [time.perf_counter()], 0.0, None, None
    with profiled(args.profile, "raytrain", rank):
        for step, (inputs, targets) in enumerate(loader, start=1):
            if step > args.steps:
                break
            loss = F.cross_entropy(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step == 1:
                first_step_s, first_step_end = time.time() - config["ray_started_at"], time.perf_counter()
            if step % args.log_every == 0:
                marks.append(time.perf_counter())
                ray.train.report({"loss": loss.item()})
                starts.append(time.perf_counter())
                report_s += starts[-1] - marks[-1]
    if rank == 0:
        import orchestrator

        write_windows(config["result_path"], args, marks, first_step_s, first_step_end, starts=starts[:-1],
                      last_step_end=starts[-1],  # after the last report
                      report_s_per_report=report_s / max(len(marks) - 1, 1),
                      process_start_to_first_step_s=first_step_s + config["ray_started_at"] - config["process_started_at"],
                      orchestrator_imported_from=str(Path(orchestrator.__file__).parent))


def raytrain_process(spec_path: str) -> int:
    """The `raytrain` subprocess: a local Ray started as submit starts it (or the one at $RAY_ADDRESS, joined), a
    TorchTrainer, fit, shut down."""
    import json

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    spec = json.loads(Path(spec_path).read_text())
    spec["ray_started_at"] = time.time()  # as submit's `launched_at`: just before Ray starts
    ray.init(log_to_driver=False, logging_level="WARNING")
    try:
        trainer = TorchTrainer(
            raytrain_train_func, train_loop_config=spec,
            scaling_config=ScalingConfig(num_workers=spec["args"]["workers"], use_gpu=False),  # 1 CPU per worker
            run_config=RunConfig(name=spec["name"], storage_path=spec["storage_path"]),
            torch_config=TorchConfig(backend="gloo"))
        trainer.fit()
    finally:
        ray.shutdown()
    return 0


def run_raytrain(args, cfg: dict, tmp: Path, index: int) -> dict:
    import json

    name = f"raytrain{index}-{args.steps}"
    spec_path, result_path = tmp / f"{name}.spec.json", tmp / f"{name}.json"
    keep = ("workers", "steps", "log_every", "batch_size", "profile")
    spec = {"job": cfg, "args": {key: getattr(args, key) for key in keep}, "name": name,
            "storage_path": str(tmp / "ray_results"), "result_path": str(result_path),
            "process_started_at": time.time()}
    spec_path.write_text(json.dumps(spec))
    command = [sys.executable, "-c", "import sys; from bench.orchestration_ray import raytrain_process; "
                                     "sys.exit(raytrain_process(sys.argv[1]))", str(spec_path)]
    done = run_process(command, ray_env(args), args.timeout)
    result = json.loads(result_path.read_text())
    result["steady"] = result["windows"][args.warmup_windows:]
    result["process_wall_s"] = done["process_wall_s"]
    return result
