"""The trainer a job gets (`orchestrator.runner.launch`): what Ray Train starts for it beside the workers."""

from ray.train.torch import TorchTrainer

from orchestrator.runner.launch import DriverTrainer


def callback_names(trainer) -> list[str]:
    return [type(callback).__name__ for callback in trainer._create_default_callbacks()]


def test_without_ray_datasets_the_trainer_starts_no_dataset_manager():
    """Ray Train's own trainer starts a DatasetManager actor for every worker group (its DatasetsCallback), even
    with no Ray Dataset; the workers load their data themselves, so ours leaves it out, and only it."""
    ours, rays = callback_names(DriverTrainer(lambda: None)), callback_names(TorchTrainer(lambda: None))
    assert "DatasetsCallback" in rays  # the name it goes by: if Ray renames it, this says so
    assert ours == [name for name in rays if name != "DatasetsCallback"]
