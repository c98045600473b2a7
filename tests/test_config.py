"""The job config: layering precedence, presets, and errors that name file and key."""

import pytest
from omegaconf import OmegaConf

from orchestrator.config import flatten, load_job
from orchestrator.errors import BadInput

from conftest import REPO, small_job


def test_precedence_defaults_preset_job_cli(write_job):
    # defaults: init_scale 65536, growth_interval 2000; preset O1: float16 + dynamic;
    # the job overrides init_scale; the command line overrides growth_interval and epochs.
    path = write_job(small_job(precision={"preset": "O1", "init_scale": 1024.0}, run={"epochs": 3}))
    cfg = load_job(path, ["precision.growth_interval=7", "run.epochs=5"])
    assert cfg.precision.compute_dtype == "float16"  # from the preset
    assert cfg.precision.loss_scale == "dynamic"  # from the preset
    assert cfg.precision.init_scale == 1024.0  # job beats default
    assert cfg.precision.growth_interval == 7  # CLI beats default
    assert cfg.run.epochs == 5  # CLI beats job
    assert cfg.optim.name == "sgd"  # untouched default


def test_job_value_beats_preset(write_job):
    cfg = load_job(write_job(small_job(precision={"preset": "O1", "compute_dtype": "bfloat16"})))
    assert cfg.precision.compute_dtype == "bfloat16"


def test_cli_can_choose_the_preset(write_job):
    cfg = load_job(write_job(small_job(precision={"preset": "O0"})), ["precision.preset=bf16-mixed"])
    assert (cfg.precision.preset, cfg.precision.compute_dtype) == ("bf16-mixed", "bfloat16")


def test_lightning_alias_resolves_to_preset(write_job):
    cfg = load_job(write_job(small_job(precision={"preset": "16-mixed"})))
    assert (cfg.precision.preset, cfg.precision.compute_dtype) == ("O1", "float16")


def test_relative_paths_become_absolute(write_job, tmp_path):
    cfg = load_job(write_job(small_job(data={"root": "mydata"})), base_dir=tmp_path)
    assert cfg.data.root == str(tmp_path / "mydata")
    assert cfg.checkpoint.storage_path == str(tmp_path / "ray_results")


def test_resolved_config_is_read_only(write_job):
    cfg = load_job(write_job(small_job()))
    with pytest.raises(Exception):
        cfg.run.epochs = 9


def test_flatten_gives_dotted_params(write_job):
    params = flatten(load_job(write_job(small_job())))
    assert params["run.batch_size"] == "32"
    assert params["model.name"] == "simple_cnn"
    assert params["scaling.resources_per_worker"] == "{}"


def test_resources_per_worker_accepts_any_resource(write_job):
    cfg = load_job(write_job(small_job(scaling={"resources_per_worker": {"CPU": 2, "custom": 1}})))
    assert OmegaConf.to_container(cfg.scaling.resources_per_worker) == {"CPU": 2.0, "custom": 1.0}


@pytest.mark.parametrize(
    "job, overrides, expected",
    [
        (small_job(run={"epoch": 2}), [], ["job.yaml", "run.epoch", "Did you mean 'run.epochs'"]),
        (small_job(), ["optim.lrr=0.1"], ["command line", "optim.lrr", "optim.lr"]),
        (small_job(runn={"epochs": 1}), [], ["unknown section 'runn'", "Did you mean 'run'"]),
        (small_job(run={"epochs": "many"}), [], ["job.yaml", "run.epochs", "many"]),
        ({"data": {"name": "digits"}}, [], ["required value missing", "model.name"]),
        (small_job(model={"name": "no_such_net"}), [], ["model.name", "no_such_net", "simple_cnn"]),
        (small_job(data={"name": "imagenet"}), [], ["data.name", "imagenet", "digits"]),
        (small_job(model={"name": "no_such_module_xyz:Net"}), [], ["model.name", "no_such_module_xyz"]),
        (small_job(model={"name": "orchestrator.train.models:NoSuchNet"}), [], ["model.name", "NoSuchNet"]),
        (small_job(scaling={"num_workers": 0}), [], ["scaling.num_workers", ">= 1"]),
        (small_job(run={"batch_size": 0}), [], ["run.batch_size", ">= 1"]),
        (small_job(data={"synthetic_shape": [3, 0, 32]}), [], ["data.synthetic_shape", ">= 1"]),
        (small_job(optim={"lr": float("nan")}), [], ["optim.lr", "finite"]),
        (small_job(optim={"lr": -0.1}), [], ["optim.lr"]),
        (small_job(optim={"name": "lamb"}), [], ["optim.name", "lamb", "adamw"]),
        (small_job(optim={"schedule": "step"}), [], ["optim.schedule", "cosine"]),
        (small_job(precision={"preset": "O7"}), [], ["precision.preset", "O7", "O1"]),
        (small_job(precision={"compute_dtype": "float8"}), [], ["precision.compute_dtype", "float8"]),
        (small_job(precision={"loss_scale": "big"}), [], ["precision.loss_scale", "big"]),
        (small_job(failure={"step_timeout_s": 0}), [], ["job.yaml", "failure.step_timeout_s", "> 0", "null"]),
        (small_job(failure={"step_timeout_s": -5}), [], ["failure.step_timeout_s", "got -5"]),
        (small_job(failure={"step_timeout_s": float("inf")}), [], ["failure.step_timeout_s", "finite"]),
        (small_job(failure={"step_timeout_s": "soon"}), [], ["job.yaml", "failure.step_timeout_s", "soon"]),
        (small_job(), ["run=3"], ["command line", "section 'run' must be a mapping"]),
        (small_job(), ["run.epochs"], ["command line", "key.path=value"]),
    ],
)
def test_bad_input_names_where_and_what(write_job, job, overrides, expected):
    with pytest.raises(BadInput) as info:
        load_job(write_job(job), overrides)
    for fragment in expected:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("- just\n- a list\n", "must be a mapping"),
        ("model:\n  name: a\nmodel:\n  name: b\n", "duplicate key 'model'"),
        ("a: &x [1]\nb: *x\n", "anchors and aliases"),
        ("model: !!python/object:os.system {}\n", "not valid YAML"),
        ("model: [unclosed\n", "not valid YAML"),
        ("run: 3\n", "section 'run' must be a mapping"),
    ],
)
def test_hostile_or_malformed_yaml_is_refused(tmp_path, text, expected):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(BadInput) as info:
        load_job(path)
    assert expected in str(info.value)
    assert str(path) in str(info.value)


def test_missing_job_file(tmp_path):
    with pytest.raises(BadInput, match="job file not found"):
        load_job(tmp_path / "nope.yaml")


def test_every_shipped_job_and_preset_resolves():
    from orchestrator.config.loader import available_presets

    jobs = sorted((REPO / "jobs").glob("*.yaml"))
    assert jobs
    for job in jobs:
        load_job(job)
    assert set(available_presets()) == {path.stem for path in (REPO / "configs" / "precision").glob("*.yaml")}
    for preset in available_presets():
        assert load_job(REPO / "jobs" / "quickstart.yaml", [f"precision.preset={preset}"])


def test_an_export_needs_class_scores_which_your_own_loss_gives_when_you_evaluate_accuracy(write_job, tmp_path,
                                                                                            monkeypatch):
    """The export is judged by its accuracy drop: allowed for cross-entropy, and for a classification loss of your
    own with `accuracy` among the metrics; refused, naming export.dtype, for your own loss without it."""
    (tmp_path / "my_losses.py").write_text(
        "import torch.nn.functional as F\n\ndef focal(outputs, targets):\n    return F.cross_entropy(outputs, targets)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    own = {"loss": "my_losses:focal"}
    cfg = load_job(write_job(small_job(task={**own, "metrics": ["accuracy"]}, export={"dtype": "float16"})))
    assert cfg.export.dtype == "float16"
    with pytest.raises(BadInput, match="export.dtype: the export is checked by its accuracy drop"):
        load_job(write_job(small_job(task={**own, "metrics": []}, export={"dtype": "float16"}), "no-accuracy.yaml"))


def test_the_step_timeout_defaults_to_ten_minutes_and_null_turns_the_watchdog_off(write_job):
    assert load_job(write_job(small_job())).failure.step_timeout_s == 600
    assert load_job(write_job(small_job(failure={"step_timeout_s": None}))).failure.step_timeout_s is None
    assert load_job(write_job(small_job()), ["failure.step_timeout_s=2.5"]).failure.step_timeout_s == 2.5
