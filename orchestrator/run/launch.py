"""Build the TorchTrainer for a resolved job: scaling, run, failure and checkpoint configs."""

from typing import Optional

from omegaconf import DictConfig, OmegaConf
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from orchestrator.run.worker import train_loop


def build_trainer(cfg: DictConfig, *, run_name: str, storage_path: str, callbacks: list,
                  worker_runtime_env: Optional[dict] = None, run_id: Optional[str] = None,
                  launched_at: Optional[float] = None) -> TorchTrainer:
    """The trainer for a job; the same `run_name` and `storage_path` make Ray Train restore that run.

    `launched_at` (wall-clock seconds) is when submit began: the workers report `perf/time_to_first_step_s`
    from it.
    """
    scaling = ScalingConfig(
        num_workers=cfg.scaling.num_workers,
        use_gpu=cfg.scaling.use_gpu,
        resources_per_worker=dict(cfg.scaling.resources_per_worker) or None,
    )
    run_config = RunConfig(
        name=run_name,
        storage_path=storage_path,
        failure_config=FailureConfig(max_failures=cfg.failure.max_failures),
        checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep),
        callbacks=callbacks,
        worker_runtime_env=worker_runtime_env,
    )
    return TorchTrainer(
        train_loop,
        train_loop_config={"job": OmegaConf.to_container(cfg, resolve=True), "run_id": run_id,
                           "launched_at": launched_at},
        scaling_config=scaling,
        run_config=run_config,
        # gloo on CPU, NCCL on GPU: Ray Train's default picks by device; we say it explicitly.
        torch_config=TorchConfig(backend="nccl" if cfg.scaling.use_gpu else "gloo"),
    )


def worker_resources(cfg: DictConfig) -> dict[str, float]:
    """What one worker asks Ray for: resources_per_worker, else Ray Train's default (1 CPU, +1 GPU with use_gpu)."""
    asked = {key: float(value) for key, value in cfg.scaling.resources_per_worker.items()}
    asked.setdefault("CPU", 1.0)
    if cfg.scaling.use_gpu:
        asked.setdefault("GPU", 1.0)
    return {key: value for key, value in asked.items() if value > 0}


def check_local_capacity(cfg: DictConfig) -> None:
    """A local Ray gets this machine's CPUs and GPUs and nothing else: a job that can never fit fails
    here, before Ray starts, instead of waiting forever for resources."""
    import os

    import torch

    from orchestrator.errors import BadInput

    have = {"CPU": float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()),
            "GPU": float(torch.cuda.device_count())}
    workers = cfg.scaling.num_workers
    for resource, per_worker in sorted(worker_resources(cfg).items(), key=lambda item: item[0] != "GPU"):
        need = per_worker * workers
        if need > have.get(resource, 0.0):
            raise BadInput(
                f"scaling: the job asks for {need:g} {resource} ({workers} workers x {per_worker:g}), but this machine "
                f"has {have.get(resource, 0.0):g} and no cluster was given (--address / RAY_ADDRESS). Lower "
                "scaling.num_workers or scaling.resources_per_worker"
                + (", set scaling.use_gpu: false" if resource == "GPU" else "") + ", or submit to a cluster.")


def check_cluster_capacity(cfg: DictConfig) -> Optional[str]:
    """On an existing cluster: a warning when it has too little right now (an autoscaler may still add nodes)."""
    import ray

    total = ray.cluster_resources()
    for resource, per_worker in worker_resources(cfg).items():
        need = per_worker * cfg.scaling.num_workers
        if need > total.get(resource, 0.0):
            return (f"the cluster has {total.get(resource, 0.0):g} {resource} now and the job needs {need:g}; "
                    "training starts when an autoscaler adds nodes (Ctrl-C to stop).")
    return None
