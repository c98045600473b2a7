"""Build the TorchTrainer for a resolved job: scaling, run, failure and checkpoint configs."""

from dataclasses import dataclass
from typing import Optional

from omegaconf import DictConfig, OmegaConf
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from ray.train.torch.config import _TorchBackend  # Ray 2.60: what TorchConfig sets up the workers with

from orchestrator.config.job import Job
from orchestrator.runner.worker import train_loop
from orchestrator.train.hooks.watchdog import collective_timeout_s
from orchestrator.train.allocator import allocator_env
from orchestrator.train.preemption import install_notice_handler
from orchestrator.common.report import CHECKPOINT_SCORE


class DriverTrainer(TorchTrainer):
    """A TorchTrainer whose `fit()` leaves Ctrl-C to the driver, keeps its run's controller, and starts no Ray
    Data machinery.

    Ray Train's own SIGINT handler aborts the run with a blocking call to the controller made from inside the
    signal handler (Ctrl-C then waits on the controller, and with a busy or stuck one does not end the driver),
    and, left installed after `fit()`, swallows a Ctrl-C that comes during the final logging. Here Ctrl-C raises
    like SIGTERM, and the driver kills the controller (`RayStart.stop_training`): its workers go with it.

    The workers load their data themselves (`orchestrator.train.data`), never through Ray Datasets; Ray Train
    would still start a `DatasetManager` actor for every worker group (a process, ~2 s of CPU, for nothing).
    """

    controller = None
    """The run's Ray Train controller actor, once `fit()` has made it."""

    def _register_sigint_handler(self, controller) -> None:  # Ray Train calls it, on the main thread, in fit()
        self.controller = controller

    def _create_default_callbacks(self) -> list:  # Ray Train 2.60 calls it once, in fit()
        callbacks = super()._create_default_callbacks()
        if self.datasets:
            return callbacks
        return [callback for callback in callbacks if type(callback).__name__ != "DatasetsCallback"]


def worker_env(cfg: DictConfig, runtime_env: Optional[dict]) -> Optional[dict]:
    """The workers' runtime env: `runtime_env` (the user's modules) plus the allocator settings of
    `perf.keep_freed_memory` (`train.allocator.allocator_env`). Values in the driver's environment win; so do the
    runtime env's own. Ray starts each worker with its runtime env's variables."""
    allocator = allocator_env(cfg.perf.keep_freed_memory)
    if not allocator:
        return runtime_env
    runtime_env = dict(runtime_env or {})
    runtime_env["env_vars"] = {**allocator, **runtime_env.get("env_vars", {})}
    return runtime_env


class _NoticeBackend(_TorchBackend):
    def on_training_start(self, worker_group, backend_config) -> None:
        super().on_training_start(worker_group, backend_config)
        if backend_config.preemption_grace_s is not None:
            # An actor task of Ray Train's (synchronous) worker actor runs on the process's main thread, the one
            # where a signal handler can be set; the training itself runs on a thread of its own.
            worker_group.execute(install_notice_handler, backend_config.preemption_grace_s)


@dataclass
class NoticeTorchConfig(TorchConfig):
    """TorchConfig whose workers take SIGTERM as a preemption notice (`orchestrator.train.preemption`): Ray's worker
    would end at once (its handler raises SystemExit)."""

    preemption_grace_s: Optional[float] = None

    @property
    def backend_cls(self):
        return _NoticeBackend


def torch_config(cfg: DictConfig) -> TorchConfig:
    """gloo on CPU, NCCL on GPU (Ray Train's default picks by device; we say it explicitly), and a collective
    timeout just past `failure.step_timeout_s`, so that the watchdog, not a collective's error, ends a stuck
    attempt; without a step timeout, Ray Train's default (30 min)."""
    backend = "nccl" if cfg.scaling.use_gpu else "gloo"
    timeout_s = collective_timeout_s(cfg.failure.step_timeout_s)
    grace_s = cfg.failure.preemption_grace_s
    if timeout_s is None:
        return NoticeTorchConfig(backend=backend, preemption_grace_s=grace_s)
    return NoticeTorchConfig(backend=backend, timeout_s=timeout_s, preemption_grace_s=grace_s)


def build_trainer(cfg: DictConfig, *, run_name: str, storage_path: str, callbacks: list,
                  worker_runtime_env: Optional[dict] = None, run_id: Optional[str] = None,
                  launched_at: Optional[float] = None, relay=None) -> DriverTrainer:
    """The trainer for a job; the same `run_name` and `storage_path` make Ray Train restore that run.

    `launched_at` (wall-clock seconds) is when submit began: the workers report `perf/time_to_first_step_s`
    from it. `relay`: the report relay, where the workers send what the user's code prints (`run.worker_output`).
    """
    workers = Job.of(cfg).workers
    scaling = ScalingConfig(
        num_workers=workers.for_ray(),  # (min, max): Ray Train's elastic scaling
        use_gpu=cfg.scaling.use_gpu,
        resources_per_worker=dict(cfg.scaling.resources_per_worker) or None,
        **({"elastic_resize_monitor_interval_s": cfg.scaling.resize_check_s} if workers.elastic else {}),
    )
    run_config = RunConfig(
        name=run_name,
        storage_path=storage_path,
        failure_config=FailureConfig(max_failures=cfg.failure.max_failures),
        checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep,
                                           checkpoint_score_attribute=CHECKPOINT_SCORE if cfg.checkpoint.score_metric
                                           else None,
                                           checkpoint_score_order=cfg.checkpoint.score_mode),
        callbacks=callbacks,
        worker_runtime_env=worker_env(cfg, worker_runtime_env),
    )
    return DriverTrainer(
        train_loop,
        train_loop_config={"job": OmegaConf.to_container(cfg, resolve=True), "run_id": run_id,
                           "launched_at": launched_at, "relay": relay},
        scaling_config=scaling,
        run_config=run_config,
        torch_config=torch_config(cfg),
    )
