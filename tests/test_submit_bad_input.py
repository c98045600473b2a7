"""Bad input exits 2 before anything starts: no Ray, no MLflow run, no files.

All cases run in one fresh interpreter (startup is the slow part), each through
`orchestrator.cli.submit.main`, exactly as the CLI calls it.
"""

import pytest
import yaml

from conftest import run_mains, small_job

CASES = {
    "unknown_key": (small_job(run={"epoch": 2}), [], "run.epochs"),
    "wrong_type": (small_job(run={"batch_size": "big"}), [], "run.batch_size"),
    "missing_required": ({"data": {"name": "digits"}}, [], "model.name"),
    "not_a_mapping": ("- a\n- b\n", [], "must be a mapping"),
    "missing_file": (None, [], "job file not found"),
    "unknown_model": (small_job(model={"name": "vgg99"}), [], "vgg99"),
    "unknown_dataset": (small_job(data={"name": "mnist"}), [], "mnist"),
    "import_path_unresolved": (small_job(model={"name": "nowhere_pkg.nets:Net"}), [], "nowhere_pkg"),
    "bad_override": (small_job(), ["scaling.workers=2"], "scaling.num_workers"),
    "cifar_unavailable": (small_job(data={"name": "cifar10", "download": False}), [], "cifar-10-batches-py"),
    # Hostile input (issue 5): each refused before anything starts.
    "duplicate_key": ("model: {name: simple_cnn}\ndata: {name: digits}\nmodel: {name: resnet18}\n", [],
                      "duplicate key 'model'"),
    "alias_bomb": ("a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                   "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n", [],
                   "anchors and aliases"),
    "python_object_tag": ("model: !!python/object/apply:os.system ['echo pwned']\n", [], "not valid YAML"),
    "zero_workers": (small_job(scaling={"num_workers": 0}), [], "scaling.num_workers: must be >= 1"),
    "negative_workers": (small_job(), ["scaling.num_workers=-2"], "scaling.num_workers: must be >= 1"),
    "batch_size_zero": (small_job(run={"batch_size": 0}), [], "run.batch_size: must be >= 1"),
    "eval_every_zero_steps": (small_job(), ["run.eval_every_n_steps=0"], "run.eval_every_n_steps: must be >= 1"),
    "lr_nan": (small_job(), ["optim.lr=nan"], "optim.lr: must be a finite number"),
    "lr_inf": (small_job(), ["optim.lr=inf"], "optim.lr: must be a finite number"),
    "system_metrics_interval_negative": (small_job(), ["tracking.system_metrics_interval_s=-1"],
                                         "tracking.system_metrics_interval_s: must be 0 (off)"),
    "lr_negative": (small_job(optim={"lr": -0.01}), [], "optim.lr: must be a finite number >= 0"),
    "unknown_preset": (small_job(precision={"preset": "O4"}), [], "unknown preset 'O4'"),
    "rule_bad_dtype": (small_job(precision={"rules": [{"match": "Linear", "dtype": "float4"}]}), [],
                       "precision.rules[0].dtype: unknown dtype 'float4'. Use one of float32, float16, bfloat16, "
                       "float8"),
    "rule_bad_checkpoint": (small_job(precision={"rules": [{"match": "features", "checkpoint": "half"}]}), [],
                            "precision.rules[0].checkpoint: unknown mode 'half'. Use one of full, selective"),
    "checkpoint_rule_matches_nothing": (small_job(precision={"rules": [{"match": "blocks.*", "checkpoint": "full"}]}),
                                        [], "precision.rules[0].match: 'blocks.*' (checkpoint: full) matches no "
                                            "module of SimpleCNN"),
    "compile_rule_matches_nothing": (small_job(precision={"rules": [{"match": "Attention", "compile": True}]}), [],
                                     "precision.rules[0].match: 'Attention' (compile: true) matches no module"),
    "more_gpus_than_exist": (small_job(scaling={"use_gpu": True, "num_workers": 2}), [],
                             "asks for 2 GPU (2 workers x 1), but this machine has 0"),
    "more_cpus_than_exist": (small_job(scaling={"resources_per_worker": {"CPU": 4096}}), [], "8192 CPU (2 workers x 4096)"),
    "mlflow_unreachable": (small_job(tracking={"uri": "http://127.0.0.1:9"}), [], "cannot be reached"),
    # Your own task: nothing assumes classification where the loss is not one.
    "accuracy_with_mse": (small_job(task={"loss": "mse"}), [], "task.metrics[0]: 'accuracy' needs class scores"),
    "export_needs_classes": (small_job(task={"loss": "mse", "metrics": []}, export={"dtype": "float16"}), [],
                             "export.dtype: the export is checked by its accuracy drop"),
    "unknown_loss": (small_job(task={"loss": "hinge"}), [], "task.loss: unknown loss 'hinge'"),
    "data_factory_missing": (small_job(data={"name": "nowhere_data:make"}), [], "nowhere_data"),
    # A metric the job does not evaluate is named before training, not after its first evaluation on the workers.
    "early_stopping_metric_typo": (small_job(run={"early_stopping": {"metric": "eval/acuracy"}}), [],
                                   "run.early_stopping.metric: 'eval/acuracy' is not a metric this job evaluates. "
                                   "It logs eval/accuracy, eval/loss"),
    "score_metric_not_evaluated": (small_job(checkpoint={"score_metric": "eval/top5", "score_mode": "max"}), [],
                                   "checkpoint.score_metric: 'eval/top5' is not a metric this job evaluates"),
    "loss_fails_on_the_outputs": (small_job(task={"loss": "bce_with_logits", "metrics": []}), [],
                                  "task.loss: 'bce_with_logits' fails on model simple_cnn's outputs (2x10)"),
    # Your own optimizer and schedule: what is not one, a key it does not take, a value it refuses.
    "optimizer_not_an_optimizer": (small_job(optim={"name": "orchestrator.train.models:SimpleCNN"}), [],
                                   "optim.name: 'orchestrator.train.models:SimpleCNN' is not a torch.optim.Optimizer"),
    "optimizer_kwarg_not_taken": (small_job(optim={"name": "torch.optim:RMSprop", "kwargs": {"betas": [0.9, 0.99]}}),
                                  [], "optim.kwargs.betas: optimizer torch.optim.rmsprop.RMSprop takes no argument"),
    "schedule_not_a_schedule": (small_job(), ["optim.schedule=torch.optim:SGD"],
                                "optim.schedule: 'torch.optim:SGD' is not an LRScheduler"),
    "optimizer_refuses_a_value": (small_job(optim={"name": "adam", "eps": -1.0}), [],
                                  "optim: adam refuses this job's settings (ValueError: Invalid epsilon value: -1.0)"),
    # Any batch (issue 26): a collate that fails on two samples, a part the batch lacks, a metric that is neither a
    # function nor a torchmetrics Metric, or one refusing its kwargs; the device loader says what it cannot hold.
    "collate_fails": (small_job(data={"name": "digits", "collate": "torch.nn.functional:relu"}), [],
                      "data.collate: data.collate (torch.nn.functional:relu) fails on two samples of the training set"),
    "inputs_part_missing": (small_job(task={"inputs": ["pixels"], "target": "1"}), [],
                            "task.inputs: the batch has no part 'pixels'; its parts are 0, 1"),
    "inputs_without_target": (small_job(task={"inputs": ["pixels"]}), [], "task.target: task.inputs names"),
    "metric_neither": (small_job(task={"metrics": ["torch.nn:Linear"]}), [],
                       "task.metrics[0].name: 'torch.nn:Linear' is neither a function"),
    "torchmetrics_refuses_kwargs": (small_job(task={"metrics": [{
        "name": "torchmetrics.classification:MulticlassF1Score", "kwargs": {"num_classes": 10, "averages": "macro"}}]}),
        [], "task.metrics[0].kwargs: torchmetrics.classification:MulticlassF1Score refuses"),
    "device_loader_with_collate": (small_job(data={"name": "digits", "loader": "device",
                                                   "collate": "torch.nn.functional:relu"}), [],
                                   "data.loader: device slices (inputs, targets) tensors"),
    # Storage that cannot be written is found before Ray starts or a run is created.
    "storage_unwritable": (small_job(checkpoint={"storage_path": "/proc/ampflow-x"}), [],
                           "checkpoint.storage_path: cannot write checkpoints to /proc/ampflow-x"),
    "storage_under_a_file": (small_job(checkpoint={"storage_path": "jobs/storage_under_a_file.yaml/runs"}), [],
                             "storage_under_a_file.yaml is not a directory"),
}

@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("bad-input")
    argvs = {}
    for name, (job, overrides, _) in CASES.items():
        path = workdir / "jobs" / f"{name}.yaml"
        path.parent.mkdir(exist_ok=True)
        if job is not None:
            path.write_text(job if isinstance(job, str) else yaml.safe_dump(job))
        argvs[name] = [str(path), *overrides, f"data.root={workdir / 'data'}"]
    return run_mains("orchestrator.cli.submit", argvs, workdir)


@pytest.mark.parametrize("name", CASES)
def test_bad_input_exits_2_with_a_clear_message_and_starts_nothing(outcomes, name):
    result = outcomes[name]
    assert result["rc"] == 2
    assert result["stderr"].startswith("error: ")
    assert CASES[name][2] in result["stderr"]
    assert not result["ray"], "Ray must not be started for bad input"
    assert result["files"] == ["jobs"], "no mlflow.db, ray_results or data may be left behind"
