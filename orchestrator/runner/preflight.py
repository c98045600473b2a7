"""The one pre-flight of `submit`, `sweep` and remote submission: everything that can refuse a job (exit 2)
before Ray starts, an MLflow run exists or anything reaches a cluster.

In order: the data can be had, the model builds (on the CPU here) and takes the data's samples (which
also describes the data for the run's MLflow dataset inputs), the optimizer and schedule (built on it), the
precision lint, the FSDP units (`scaling.strategy: fsdp`), this machine can hold the workers, and which run
it is (a new name that is not taken, or the interrupted run `--resume` continues, checked against its newest
checkpoint: `orchestrator.checkpoint.resume`). The config itself was checked when it was loaded.
A sweep passes one config per point of its grid: each is checked, what its points share once (the model
and data once per distinct model, data and task sections, the capacity once per scaling section). A job
for a remote job server skips what the cluster checks itself: its data, its capacity and its storage.
"""

import dataclasses
import os
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch
from omegaconf import DictConfig
from torch.utils.data import default_collate

from orchestrator.config.job import Job
from orchestrator.errors import BadInput
from orchestrator.runner import records
from orchestrator.checkpoint.stored import newest
from orchestrator.runner.remote import is_job_server_address
from orchestrator.tracking.lineage import describe as describe_lineage
from orchestrator.common.values import describe as describe_value, prediction
from orchestrator.tracking.secrets import remember_secrets
from orchestrator.train.batch import MODEL_LOSS, BatchLayout
from orchestrator.train.data import build_datasets, collate_fn, collate_source, device_refusal, ensure_available
from orchestrator.runner.precision_lint import lint
from orchestrator.train.models import build_model
from orchestrator.common.modes import eval_mode
from orchestrator.train.optim import check_on_model
from orchestrator.checkpoint.resume import check_model, check_resume
from orchestrator.train.strategy import check_plan
from orchestrator.train.task import MODEL_LOSS_HINT, Perplexity, SummedMetric, build_loss, build_metric, fp32, model_loss_of


@dataclass
class RunChoice:
    """Which run a config trains: the name its checkpoints and record live under in storage."""

    name: str
    resume: bool = False
    """Continue the interrupted run of this name (`--resume`) rather than start one."""
    mlflow_run_id: Optional[str] = None
    """The resumed run's MLflow run, when it had one (MLflow may have been down all through it)."""
    datasets: list = field(default_factory=list, compare=False)
    """The train and eval sets it reads (`DatasetLineage`s), logged as the MLflow run's dataset inputs."""
    resumed_from: Optional[object] = field(default=None, compare=False)
    """(`resume`) The facts of the checkpoint it continues from (`CheckpointFacts`), when there is one the driver
    could read."""


@dataclass
class Preflight:
    """What the pre-flight established, for the stages after it."""

    model: object
    """The job's model (the first config's), built on the CPU."""
    runs: list[RunChoice]
    """One per config, in order; empty for a job server, where the cluster's storage decides."""


def preflight(configs: Sequence[DictConfig], job_path: Path, address: Optional[str], *,
              resume: bool = False) -> Preflight:
    """Check the job as it would run at `address` (None: a local Ray here); BadInput (exit 2) when it cannot.

    `configs`: the job's resolved config, or a sweep's, one per point of its grid (the first is the base).
    """
    for cfg in configs:  # before anything is printed or logged: the job's own secrets are masked as the env's are
        remember_secrets(cfg)
    to_job_server = is_job_server_address(address)
    built: dict[str, object] = {}  # a model per distinct model section (a sweep's points usually share one)
    lineage: dict[str, list] = {}  # the data's lineage per distinct data section
    evaluated: dict[str, set[str]] = {}  # the eval/... metrics each distinct model, data and task logs
    warned: set[str] = set()  # optimizer warnings printed already (a sweep's points usually share them)
    firsts: dict[str, list] = {}  # the first training batch each distinct model, data and task section gives
    for cfg in configs:
        what = repr((cfg.model, cfg.data, cfg.task))
        if what not in built:
            if not to_job_server:  # a remote job reads its data on the cluster, which checks it there
                ensure_available(cfg.data)
            built[what] = build_model(cfg.model)  # a broken model fails here, before Ray starts
            if not to_job_server:
                lineage[repr(cfg.data)], evaluated[what] = check_data_fits_model(cfg, built[what],
                                                                                 firsts.setdefault(what, []))
        if what in evaluated:
            check_metric_names(cfg, evaluated[what])
        check_optimizer(cfg, built[what], warned)
        check_lint(cfg, built[what])
        # DDP: the policy kept on two samples, as the workers' audit will hold it; FSDP: the units can be planned
        check_plan(cfg, built[what], firsts[what][0] if firsts.get(what) else None)
    if not address:
        for cfg in {repr(cfg.scaling): cfg for cfg in configs}.values():
            check_local_capacity(cfg)
    if not to_job_server:  # a job server's storage is the cluster's
        for storage in dict.fromkeys(cfg.checkpoint.storage_path for cfg in configs):
            check_storage_writable(storage)
    train_samples = {repr(cfg.data): next(d.num_samples for d in lineage[repr(cfg.data)] if d.context == "train")
                     for cfg in configs} if not to_job_server else {}
    for cfg in configs if not to_job_server else ():
        check_whole_steps(cfg, train_samples[repr(cfg.data)])
    runs = [] if to_job_server else [
        choose_run(cfg, job_path, resume, model=built[repr((cfg.model, cfg.data, cfg.task))],
                   train_samples=train_samples[repr(cfg.data)])
        for cfg in configs]
    for cfg, run in zip(configs, runs):
        run.datasets = lineage[repr(cfg.data)]
    return Preflight(next(iter(built.values())), runs)


def describe_data(cfg: DictConfig, datasets: Optional[tuple] = None, batches: tuple = (None, None)) -> list:
    """The lineage of the job's train and eval sets (built from the config unless given); `batches`: a first
    `Batch` of each, whose inputs describe the samples."""
    train, evaluation = datasets or build_datasets(cfg.data, cfg.model.num_classes)
    return describe_lineage(cfg.data, [("train", train), ("eval", evaluation)], batches)


def first_batch(cfg: DictConfig, dataset, split: str):
    """Two samples of `dataset` collated as its loader collates them and read as `task.inputs`/`task.target`
    say: a collate function that fails on them, or a part the batch lacks, is bad input naming the key."""
    samples = [dataset[i] for i in range(min(2, len(dataset)))]
    collate = collate_fn(cfg.data, dataset)
    if collate is None:
        collate = default_collate
    try:
        raw = collate(samples)
    except Exception as exc:  # whatever the collate function raises (RuntimeError on unequal sizes, KeyError, ...)
        key = "data.collate" if cfg.data.collate is not None else "data.name"
        hint = "Fix the collate function." if cfg.data.collate is not None else (
            "Give data.collate (e.g. one that pads variable-length samples) or make the samples equal in size.")
        raise BadInput(f"{key}: {collate_source(cfg.data, dataset)} fails on two samples of the {split} set of "
                       f"data.name {cfg.data.name} ({type(exc).__name__}: {str(exc)[:300]}). {hint}") from None
    return BatchLayout.from_task(cfg.task).batch(raw)


def check_data_fits_model(cfg: DictConfig, model, first: Optional[list] = None) -> tuple[list, set[str]]:
    """Two samples of the training set, collated as the loaders collate them, through the model, the loss and the
    metrics on the CPU, every input in its own dtype (int64 token ids stay int64): a model that cannot take the
    batch, or whose outputs do not match the number of classes the data has, is refused naming both; so is a
    loss or metric that fails on them, a collate function that fails, a `task.inputs` part the batch lacks, and
    data `data.loader: device` cannot hold. Returns the data's lineage (`describe_data`) and the names of the
    metrics an evaluation logs (`eval/loss`, `eval/<name>` for each name the metrics return); `first`: the first
    training `Batch` is appended to it (for `check_policy_kept`)."""
    train, evaluation = build_datasets(cfg.data, cfg.model.num_classes)
    if len(train) == 0:
        raise BadInput(f"data.name: {cfg.data.name} has an empty training set.")
    if cfg.data.loader == "device":
        for split, dataset in (("training", train), ("eval", evaluation)):
            refusal = device_refusal(dataset)
            if refusal is not None:
                raise BadInput(f"data.loader: device holds (inputs, targets) tensors on the device; data.name "
                               f"{cfg.data.name}'s {split} set is {refusal}. Use data.loader: dataloader.")
    check_vocabulary(cfg, train, model)
    batch = first_batch(cfg, train, "training")
    if first is not None:
        first.append(batch)
    eval_batch = first_batch(cfg, evaluation, "eval") if len(evaluation) else None
    single = batch.args[0] if len(batch.args) == 1 and not batch.kwargs else None
    given = (f"samples of shape {'x'.join(str(d) for d in single.shape[1:])}" if isinstance(single, torch.Tensor)
             else f"batches of {batch.describe_inputs()}")
    try:
        with torch.no_grad(), eval_mode(model):
            outputs = batch.forward(model)
    except Exception as exc:  # whatever the model raises on the wrong shape (RuntimeError, ValueError, ...)
        if batch.labels is not None and _takes_inputs_alone(model, batch):
            raise BadInput(f"task.loss: model: model.name {cfg.model.name} does not take the targets as "
                           f"`{batch.labels}` ({type(exc).__name__}: {str(exc)[:300]}), so it cannot return its own "
                           f"loss. task.loss: model is for a model called as model(inputs, {batch.labels}=targets) "
                           "that returns its loss (as Hugging Face models do); for this model name a loss: "
                           "cross_entropy, mse, bce_with_logits, next_token or your own package.module:fn.") from None
        raise BadInput(f"data.name: {cfg.data.name} gives {given}, which model.name {cfg.model.name} cannot take "
                       f"({type(exc).__name__}: {str(exc)[:300]}). Use a model for this input (e.g. model.kwargs), "
                       "transform the data (data.transforms), or name the model's inputs (task.inputs).") from None
    classes = getattr(train, "classes", None)
    scores = prediction(outputs, cfg.task.output)
    if cfg.task.loss == "cross_entropy" and classes is not None and isinstance(scores, torch.Tensor) \
            and scores.dim() == 2 and scores.shape[1] != len(classes):
        raise BadInput(f"model.num_classes: model {cfg.model.name} gives {scores.shape[1]} class scores, but "
                       f"data {cfg.data.name} has {len(classes)} classes. Set model.num_classes={len(classes)}.")
    lineage = describe_data(cfg, (train, evaluation), (batch, eval_batch))
    return lineage, evaluated_metrics(cfg, outputs, batch.targets, describe_value(outputs))


def check_vocabulary(cfg: DictConfig, train, model) -> None:
    """Token ids the model's token embedding (its first `nn.Embedding`) has no row for are refused naming both
    sizes, for a dataset that says its vocabulary (`lm_text`'s `vocab_size`), rather than as an IndexError."""
    vocabulary = getattr(train, "vocab_size", None)
    embedding = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    if isinstance(vocabulary, int) and embedding is not None and embedding.num_embeddings < vocabulary:
        raise BadInput(f"model.kwargs: model {cfg.model.name}'s token embedding has {embedding.num_embeddings} rows, "
                       f"but data {cfg.data.name} has a vocabulary of {vocabulary} tokens. Set the model's "
                       f"vocab_size (model.kwargs) to at least {vocabulary}.")


def _takes_inputs_alone(model, batch) -> bool:
    """Whether `model` runs on `batch`'s inputs without its targets (`task.loss: model` gives it both)."""
    try:
        with torch.no_grad(), eval_mode(model):
            dataclasses.replace(batch, labels=None).forward(model)
    except Exception:
        return False
    return True


def evaluated_metrics(cfg: DictConfig, outputs, targets, described: str = "") -> set[str]:
    """The job's loss and metrics on the model's outputs for two samples: the names an evaluation logs."""
    def refuse(key: str, name: str, exc: Exception) -> BadInput:
        shape = described.partition(" ")[2] or described
        return BadInput(f"{key}: '{name}' fails on model {cfg.model.name}'s outputs ({shape}) for data "
                        f"{cfg.data.name} ({type(exc).__name__}: {str(exc)[:300]}). Fix it, or choose a loss or "
                        "metric for this kind of output.")

    if cfg.task.loss == MODEL_LOSS and model_loss_of(outputs) is None:
        raise BadInput(f"task.loss: model: model.name {cfg.model.name} returns no loss ({described or 'outputs'} "
                       f"without a `loss`). {MODEL_LOSS_HINT}")
    try:
        build_loss(cfg.task)(outputs, targets)
    except Exception as exc:
        raise refuse("task.loss", cfg.task.loss, exc) from None
    names = {"eval/loss"}
    for index, spec in enumerate(cfg.task.metrics):
        try:
            metric = build_metric(spec, cfg.task.output)
        except Exception as exc:  # a torchmetrics constructor refusing its kwargs' values
            raise BadInput(f"task.metrics[{index}].kwargs: {spec.name} refuses {dict(spec.kwargs)} "
                           f"({type(exc).__name__}: {str(exc)[:300]}). Fix the metric's kwargs.") from None
        try:
            metric.reset(torch.device("cpu"))
            metric.update(fp32(outputs), targets)
            computed = metric.sums if isinstance(metric, SummedMetric) else \
                metric.of_loss(0.0) if isinstance(metric, Perplexity) else metric.compute()
        except Exception as exc:
            raise refuse(f"task.metrics[{index}]", spec.name, exc) from None
        names.update(f"eval/{key}" for key in computed)
    return names


def check_metric_names(cfg: DictConfig, evaluated: set[str]) -> None:
    """`run.early_stopping.metric` and `checkpoint.score_metric` name a metric the evaluation logs: a typo would
    otherwise surface only after the first evaluation, on the workers."""
    stopping = cfg.run.early_stopping
    for key, name in (("run.early_stopping.metric", stopping.metric if stopping is not None else None),
                      ("checkpoint.score_metric", cfg.checkpoint.score_metric)):
        if name is not None and name not in evaluated:
            raise BadInput(f"{key}: '{name}' is not a metric this job evaluates. It logs "
                           f"{', '.join(sorted(evaluated))} (task.metrics: {', '.join(m.name for m in cfg.task.metrics) or 'none'}).")


def check_optimizer(cfg: DictConfig, model, warned: set[str]) -> None:
    """The job's optimizer and schedule, built on the model: what their constructors refuse is bad input here;
    an `optim.param_groups` glob that takes no parameter is a warning (printed once)."""
    for warning in check_on_model(cfg.optim, model):
        if warning not in warned:
            warned.add(warning)
            print(f"warning: {warning}", file=sys.stderr)


def check_lint(cfg: DictConfig, model) -> None:
    """The precision lint: with `precision.lint: error` its errors stop the job and its warnings are printed;
    with `warn` everything is printed; `off` skips it."""
    findings = lint(cfg, model) if cfg.precision.lint != "off" else []
    policy = f"preset {cfg.precision.preset}" if cfg.precision.preset else "this job's precision policy"
    errors = [f for f in findings if f.severity == "error"] if cfg.precision.lint == "error" else []
    if errors:
        listed = "\n".join(f"  - {finding}" for finding in errors)
        raise BadInput(f"{policy}: precision lint found {len(errors)} problem(s):\n{listed}\n"
                       "Fix the policy or choose another preset (in a sweep: drop it from --presets), or set "
                       "precision.lint=warn to train anyway.")
    if findings:
        listed = "\n".join(f"  - {finding}" for finding in findings)
        print(f"warning: {policy}: precision lint (precision.lint: {cfg.precision.lint}):\n{listed}", file=sys.stderr)


def default_run_name(job_path: Path) -> str:
    """`<job stem>-<date>-<time>-<6 hex>`: readable, and distinct for two submits of one job in the same second
    (which name is actually taken is settled when the run claims its directory: `records.claim`)."""
    return f"{job_path.stem}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def choose_run(cfg: DictConfig, job_path: Path, resume: bool, *, model=None,
               train_samples: Optional[int] = None) -> RunChoice:
    """A new run under a name not taken in storage, or (`resume`) this job's newest interrupted run, checked
    against its newest checkpoint when `model` (the job's, built on the CPU) and `train_samples` are given."""
    storage = cfg.checkpoint.storage_path
    if resume:
        record = records.find_resumable(storage, job_path)
        run = RunChoice(record["run_name"], resume=True, mlflow_run_id=record.get("run_id"))
        if model is not None and train_samples is not None:
            run.resumed_from = check_resume_against_run(cfg, run.name, model, train_samples)
        return run
    name = cfg.run.name or default_run_name(job_path)
    if records.run_exists(storage, name):
        raise BadInput(f"run.name: a run named '{name}' already exists in {storage}. Choose another run.name, "
                       "or continue it with `python -m orchestrator.submit JOB --resume`.")
    return RunChoice(name)


def check_resume_against_run(cfg: DictConfig, run_name: str, model, train_samples: int):
    """The job against the newest checkpoint of the run it resumes, read from storage before Ray starts:
    IncompatibleResume (exit 2) naming the key and both values when the checkpoint cannot go on under it
    (`orchestrator.checkpoint.resume.check_resume`). Returns the checkpoint's facts (None without a checkpoint, or
    for one written before checkpoints recorded them, on a storage URI: then only the workers check)."""
    stored = newest(cfg.checkpoint.storage_path, run_name)
    if stored is None:
        return None
    if stored.facts is None:
        print(f"warning: --resume: checkpoint {stored.path} was written by an earlier version without its "
              "ampflow_checkpoint.json: the job is checked against it on the workers only.", file=sys.stderr)
        return None
    where = f"run {run_name} from {stored.name}"
    check_model(stored.facts, {name: list(t.shape) for name, t in model.state_dict().items()}, cfg, where)
    job = Job.of(cfg)
    check_resume(stored.facts, job.layout(train_samples, job.workers.max), where)
    return stored.facts


def check_whole_steps(cfg: DictConfig, train_samples: Optional[int]) -> None:
    """An epoch must hold at least one optimizer step (on `max` workers for a fixed count: the most it asks)."""
    if train_samples is None:
        return
    job = Job.of(cfg)
    workers = job.workers
    layout = job.layout(train_samples, workers.max)
    if layout.steps_per_epoch > 0:
        return
    step = (f"a step's global batch of {layout.global_batch} (run.batch_size x run.accumulate_steps x "
            f"{workers.max}, the most workers of scaling.num_workers {workers})" if workers.elastic else
            f"{workers.max} workers' batches of run.batch_size {cfg.run.batch_size} x run.accumulate_steps "
            f"{cfg.run.accumulate_steps}")
    raise BadInput(f"run: the training set has {train_samples} samples, too few for one optimizer step: {step}. "
                   "Lower run.batch_size or run.accumulate_steps, or use fewer workers.")


def check_storage_writable(storage_path: str) -> None:
    """A local `checkpoint.storage_path` must be a directory this process can write in, or one it can create:
    found here, not after Ray started and the run was created. Probed with a temporary directory in the path
    or its nearest existing parent, removed at once (nothing is left behind). A URI (s3://, gs://, ...) is left
    to the run: buckets and credentials can only be checked by writing."""
    if "://" in storage_path:
        return
    path = Path(storage_path).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is not a directory")
        os.rmdir(tempfile.mkdtemp(prefix=".ampflow-write-check-", dir=existing))
    except OSError as exc:
        raise BadInput(f"checkpoint.storage_path: cannot write checkpoints to {storage_path} "
                       f"({exc.strerror or exc}). Point checkpoint.storage_path at a writable directory (or a "
                       "storage URI such as s3://bucket/path).") from None


# -- capacity -------------------------------------------------------------------------------------


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
    have = {"CPU": float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()),
            "GPU": float(torch.cuda.device_count())}
    workers = Job.of(cfg).workers  # an elastic run starts with what fits, at least its min
    for resource, per_worker in sorted(worker_resources(cfg).items(), key=lambda item: item[0] != "GPU"):
        need = per_worker * workers.min
        if need > have.get(resource, 0.0):
            raise BadInput(
                f"scaling: the job asks for {need:g} {resource} ({workers.min} workers x {per_worker:g}"
                f"{', the least its elastic range takes' if workers.elastic else ''}), but this machine "
                f"has {have.get(resource, 0.0):g} and no cluster was given (--address / RAY_ADDRESS). Lower "
                "scaling.num_workers or scaling.resources_per_worker"
                + (", set scaling.use_gpu: false" if resource == "GPU" else "") + ", or submit to a cluster.")


def check_cluster_capacity(cfg: DictConfig) -> Optional[str]:
    """On an existing cluster (Ray connected): a warning when it has too little right now (an autoscaler
    may still add nodes), else None."""
    import ray  # loaded by then (Ray is connected); at the top it would cost the bad-input path a second

    total = ray.cluster_resources()
    for resource, per_worker in worker_resources(cfg).items():
        need = per_worker * Job.of(cfg).workers.min  # an elastic run starts with at least its min
        if need > total.get(resource, 0.0):
            return (f"the cluster has {total.get(resource, 0.0):g} {resource} now and the job needs {need:g}; "
                    "training starts when an autoscaler adds nodes (Ctrl-C to stop).")
    return None
