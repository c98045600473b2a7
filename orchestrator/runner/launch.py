"""Build the TorchTrainer for a resolved job: scaling, run, failure and checkpoint configs."""

import os
from typing import Optional

from omegaconf import DictConfig, OmegaConf
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from orchestrator.runner.worker import train_loop


KEEP_FREED_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(4 * 2**30)}
"""glibc malloc settings (`perf.keep_freed_memory`): blocks up to 32 MiB (the largest fixed threshold glibc takes)
come from the heap instead of their own mmap, and the heap is not given back to the system below 4 GiB of free
space. By default glibc unmaps a freed activation buffer and the next step faults its pages in again."""


def worker_env(cfg: DictConfig, runtime_env: Optional[dict]) -> Optional[dict]:
    """The workers' runtime env: `runtime_env` (the user's modules) plus the allocator settings of
    `perf.keep_freed_memory`. Values in the driver's environment win; so do the runtime env's own. glibc reads
    them once, when the process starts: Ray starts each worker with its runtime env's variables."""
    if not cfg.perf.keep_freed_memory:
        return runtime_env
    runtime_env = dict(runtime_env or {})
    allocator = {name: os.environ.get(name, value) for name, value in KEEP_FREED_MEMORY_ENV.items()}
    runtime_env["env_vars"] = {**allocator, **runtime_env.get("env_vars", {})}
    return runtime_env


def build_trainer(cfg: DictConfig, *, run_name: str, storage_path: str, callbacks: list,
                  worker_runtime_env: Optional[dict] = None, run_id: Optional[str] = None,
                  launched_at: Optional[float] = None, relay=None) -> TorchTrainer:
    """The trainer for a job; the same `run_name` and `storage_path` make Ray Train restore that run.

    `launched_at` (wall-clock seconds) is when submit began: the workers report `perf/time_to_first_step_s`
    from it. `relay`: the report relay, where the workers send what the user's code prints (`run.worker_output`).
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
        checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep,
                                           checkpoint_score_attribute=cfg.checkpoint.score_metric,
                                           checkpoint_score_order=cfg.checkpoint.score_mode),
        callbacks=callbacks,
        worker_runtime_env=worker_env(cfg, worker_runtime_env),
    )
    return TorchTrainer(
        train_loop,
        train_loop_config={"job": OmegaConf.to_container(cfg, resolve=True), "run_id": run_id,
                           "launched_at": launched_at, "relay": relay},
        scaling_config=scaling,
        run_config=run_config,
        # gloo on CPU, NCCL on GPU: Ray Train's default picks by device; we say it explicitly.
        torch_config=TorchConfig(backend="nccl" if cfg.scaling.use_gpu else "gloo"),
    )
