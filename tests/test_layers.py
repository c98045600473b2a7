"""The package's shape holds (its layers depend in one direction: `lint-imports`, which `make test` runs,
checks pyproject.toml's contracts): the names the public API shows import where it shows them, and the
built-in names the config checks are the ones the training registries build."""


def test_the_names_the_readme_shows_import_where_it_shows_them():
    from orchestrator import BadInput, Interrupted, RunResult, run  # noqa: F401
    from orchestrator.precision import Precision  # noqa: F401


def test_the_config_knows_exactly_the_names_the_registries_build():
    import torchvision

    from orchestrator.config import names
    from orchestrator.train import models, task

    assert set(names.MODELS) == set(models.REGISTRY)
    assert set(names.METRICS) == set(task.BUILT_IN)
    assert all(callable(getattr(torchvision.datasets, name, None)) for name in names.TORCHVISION_DATASETS)
    for loss in names.LOSSES:
        task.build_loss(type("Task", (), {"loss": loss, "label_smoothing": 0.0})())
