"""`perf.keep_freed_memory`: Ray Train workers (and the Ray-free loop's ranks) start with glibc malloc keeping freed
memory, so a step's activations reuse pages instead of faulting fresh ones in every step."""

import os
import subprocess
import sys
import textwrap

import torch
from omegaconf import OmegaConf

from orchestrator.config.loader import load_job
from orchestrator.runner.launch import build_trainer
from orchestrator.train.allocator import KEEP_FREED_MEMORY_ENV

from conftest import REPO, small_job


def trainer_env(tmp_path, write_job, *overrides: str, runtime_env=None):
    cfg = load_job(write_job(small_job()), list(overrides))
    trainer = build_trainer(cfg, run_name="env", storage_path=str(tmp_path), callbacks=[],
                            worker_runtime_env=runtime_env)
    return trainer.run_config.worker_runtime_env


def test_workers_get_the_allocator_settings_beside_the_users_modules(tmp_path, write_job, monkeypatch):
    for name in KEEP_FREED_MEMORY_ENV:
        monkeypatch.delenv(name, raising=False)
    env = trainer_env(tmp_path, write_job, runtime_env={"env_vars": {"PYTHONPATH": "/models"}})
    assert env["env_vars"] == {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "4294967296",
                               "PYTHONPATH": "/models"}


def test_the_drivers_own_values_win_and_the_switch_turns_it_off(tmp_path, write_job, monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    assert trainer_env(tmp_path, write_job)["env_vars"]["MALLOC_MMAP_THRESHOLD_"] == "1048576"
    assert not trainer_env(tmp_path, write_job, "perf.keep_freed_memory=false")  # Ray keeps no env as {}


def test_the_ray_free_loops_ranks_start_with_the_settings_too(tmp_path, write_job, monkeypatch):
    """`local.spawn`'s rank processes inherit the environment they are started in: the settings are in it then
    (not with the switch off), and the caller's environment is as it was afterwards."""
    import torch.multiprocessing as mp

    from orchestrator.train.local import spawn

    for name in KEEP_FREED_MEMORY_ENV:
        monkeypatch.delenv(name, raising=False)
    seen = []

    class Ended:  # the ranks' context, as `mp.spawn(join=False)` returns it: every rank has ended
        def join(self, grace_period=None):
            return True

    def start_ranks(fn, args, nprocs, join):  # what the rank processes would inherit; rank 0's result file
        seen.append({name: os.environ.get(name) for name in KEEP_FREED_MEMORY_ENV})
        torch.save({"reports": [], "weights": {}}, args[3])
        return Ended()

    monkeypatch.setattr(mp, "spawn", start_ranks)
    job = OmegaConf.to_container(load_job(write_job(small_job())), resolve=True)
    spawn(job, 2, tmp_path / "on")
    job["perf"]["keep_freed_memory"] = False
    spawn(job, 2, tmp_path / "off")
    assert seen == [KEEP_FREED_MEMORY_ENV, dict.fromkeys(KEEP_FREED_MEMORY_ENV)]
    assert not any(name in os.environ for name in KEEP_FREED_MEMORY_ENV)


FAULTS = textwrap.dedent("""
    import resource, threading
    import torch
    from omegaconf import OmegaConf
    from orchestrator.train.models import build_model

    torch.set_num_threads(1)
    model = build_model(OmegaConf.create({"name": "simple_cnn", "num_classes": 10, "kwargs": {}}))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    inputs, targets = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))

    def steps(n):
        for _ in range(n):
            loss = torch.nn.functional.cross_entropy(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

    def train():  # in a thread of its own, as Ray Train runs the training function
        steps(3)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        steps(20)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    thread = threading.Thread(target=train)
    thread.start()
    thread.join()
""")


def test_with_the_settings_a_training_step_reuses_its_memory_instead_of_page_faulting_it_in():
    def faults(env: dict) -> int:
        done = subprocess.run([sys.executable, "-c", FAULTS], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        return int(done.stdout)

    base = {k: v for k, v in os.environ.items() if k not in KEEP_FREED_MEMORY_ENV}
    base["PYTHONPATH"] = str(REPO)
    default, kept = faults(base), faults({**base, **KEEP_FREED_MEMORY_ENV})
    # 20 steps of a small CNN, batch 64: glibc's defaults fault about 2,000 pages in per step, the settings ~50.
    assert default > 20 * 500, default
    assert kept < default / 10, (kept, default)
