"""One training core: the loop every Ray Train worker runs is the Ray-free loop, and the worker adds nothing."""

import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from conftest import REPO, small_job

pytestmark = pytest.mark.slow


def test_ray_train_and_the_ray_free_loop_end_with_the_same_weights(ray_session, tmp_path, write_job, mlflow_uri,
                                                                     monkeypatch):
    """One job trained twice, through submit on Ray Train and on the Ray-free loop's spawned ranks: the final
    weights are the same, since both run the one training loop.

    Long: two whole trainings of two ranks each, one through Ray Train and one in processes of their own."""
    from orchestrator.cli.submit import main
    from orchestrator.config import load_job
    from orchestrator.checkpoint.files import read_checkpoint
    from orchestrator.train.local import spawn

    storage = tmp_path / "ray_results"
    job = write_job(small_job(precision={"preset": "O0"}, run={"name": "identity", "max_steps_per_epoch": 6},
                              tracking={"uri": mlflow_uri}, checkpoint={"storage_path": str(storage)}))
    monkeypatch.chdir(tmp_path)
    assert main([str(job)]) == 0
    final = sorted(p for p in (storage / "identity").glob("checkpoint_*") if p.is_dir())[-1]
    through_ray = read_checkpoint(final, rank=0)
    assert through_ray.global_step == 6

    # Ray gives each 1-CPU worker one torch thread; the plain processes get the same, so kernels sum alike.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = load_job(job, [])
    ray_free = spawn(OmegaConf.to_container(cfg, resolve=True), world_size=2, directory=tmp_path / "local")
    assert set(ray_free["weights"]) == set(through_ray.model)
    for name, weight in through_ray.model.items():
        torch.testing.assert_close(ray_free["weights"][name], weight, rtol=0, atol=1e-6, msg=name)
    # Trained, not just initialised alike: the weights moved from the seed's initial ones.
    initial = load_initial(cfg)
    assert any(not torch.equal(initial[name], weight) for name, weight in through_ray.model.items()
               if weight.is_floating_point())
    # The same reports, step by step (loss to float precision; the ranks' windows were reduced alike).
    ray_free_losses = [r.metrics["train/loss"] for r in ray_free["reports"] if "train/loss" in r.metrics]
    assert len(ray_free_losses) == 3  # log_every_n_steps 2, 6 steps


def load_initial(cfg) -> dict:
    from orchestrator.train.models import build_model
    from orchestrator.train.rng import seed_everything

    seed_everything(cfg.run.seed)
    return build_model(cfg.model).state_dict()


SPAWNED = """
import sys
import torch.distributed as dist
import torch.multiprocessing as mp
from orchestrator.train.local import exit_rank

def rank_main(rank, rendezvous):
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    dist.barrier()
    print(f"rank {rank} done")  # buffered: stdout is a pipe
    print(f"rank {rank} warning", file=sys.stderr)
    dist.destroy_process_group()
    exit_rank()

if __name__ == "__main__":
    mp.spawn(rank_main, args=(sys.argv[1],), nprocs=2, join=True)
    print("joined")
"""


def test_a_finished_rank_exits_0_with_its_output_flushed(tmp_path):
    """`exit_rank` skips Python's finalization (where a gloo thread can abort the process), not the rank's output."""
    script = tmp_path / "spawned.py"
    script.write_text(SPAWNED)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # the ranks' stdout stays buffered
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "rendezvous")], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**env, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["joined", "rank 0 done", "rank 1 done"]
    assert {"rank 0 warning", "rank 1 warning"} <= set(done.stderr.splitlines())
