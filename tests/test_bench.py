"""The benchmark harnesses run end to end and produce their ratios and JSON record.

Each harness runs as a user runs it (`python -m bench.NAME --smoke --json PATH`, from the
repository root). The figures of a smoke run mean nothing (tiny sizes, a shared CPU), so only
their presence and finiteness are checked, never their values.
"""

import json
import math
import subprocess
import sys

import pytest
import torch

from conftest import REPO

RECORD_FIELDS = {"harness", "device", "torch", "config", "figures", "ratios", "targets", "command"}


def run_harness(name: str, tmp_path, *extra: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / f"{name}.json"
    done = subprocess.run([sys.executable, "-m", f"bench.{name}", "--smoke", "--json", str(out), *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"bench.{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done, json.loads(out.read_text())


def check_record(done: subprocess.CompletedProcess, record: dict, harness: str, ratios: set[str]) -> None:
    assert RECORD_FIELDS <= record.keys()
    assert record["harness"] == harness
    assert record["command"].startswith(f"python -m bench.{harness}")
    assert ratios <= record["ratios"].keys()
    for name, value in record["ratios"].items():
        assert math.isfinite(value), f"ratio {name} is {value}"
        assert f"ratio {name} = " in done.stdout
    assert set(record["targets"]) <= set(record["ratios"])


@pytest.mark.slow  # trains in processes of its own (the harnesses)
def test_policy_harness(tmp_path):
    done, record = run_harness("policy", tmp_path)
    check_record(done, record, "policy", {"policy_step_time"})
    assert record["figures"]["same_logits"] is True  # the two candidates compute the same thing


@pytest.mark.slow
def test_rule_checkpoint_harness(tmp_path):
    done, record = run_harness("rule_checkpoint", tmp_path)
    check_record(done, record, "rule_checkpoint", {"activation_bytes"})


@pytest.mark.slow
def test_fsdp_memory_harness(tmp_path):
    done, record = run_harness("fsdp_memory", tmp_path)
    check_record(done, record, "fsdp_memory", {"O0_state_bytes"})
    assert record["figures"]["O0"]["prediction_exact"] is True


@pytest.mark.slow  # trains in processes of its own (the harnesses)
def test_fast_paths_harness(tmp_path):
    done, record = run_harness("fast_paths", tmp_path)
    check_record(done, record, "fast_paths", {f"{name}_speedup" for name in
                                              ("defaults", "device_loader", "channels_last", "fused", "cudnn_benchmark",
                                               "compile", "all")}
                 | {"baseline_time_vs_hand_written", "defaults_speedup_vs_hand_written"})


@pytest.mark.slow  # trains in processes of its own (the harness)
def test_epoch_harness(tmp_path):
    """Each run is a fresh process: the hand-written script and the Ray-free loop (fast paths off) both train a
    short and a long run; each stamps its epochs' ends (the loop through a job callback), and the per-epoch
    figures come from those stamps and from the process walls."""
    done, record = run_harness("epoch", tmp_path, "--candidates", "hand_written,baseline")
    check_record(done, record, "epoch", {"baseline_epoch_vs_hand_written", "baseline_epoch_vs_hand_written_by_difference",
                                         "baseline_fixed_extra_s"})
    walls, in_runs = record["figures"]["process_wall_s"], record["figures"]["seconds_per_epoch_in_runs"]
    assert set(walls) == set(in_runs) == {"hand_written", "baseline"}
    assert all(len(runs["1"]) == len(runs["2"]) == 1 and min(runs["1"] + runs["2"]) > 0 for runs in walls.values())
    # The long run (2 epochs) has one epoch after its first, timed inside it, shorter than the whole process.
    assert all(len(epochs) == 1 and 0 < epochs[0] < walls[name]["2"][0] for name, epochs in in_runs.items())


@pytest.mark.slow  # starts processes of its own (the harness)
def test_startup_harness(tmp_path):
    done, record = run_harness("startup", tmp_path)
    check_record(done, record, "startup", {"ray_free_loop_extra_s", "ray_train_worker_extra_s"})
    assert set(record["figures"]["seconds"]) == {"hand_written", "ray_free_loop", "ray_train_worker", "ddp_wrap"}


@pytest.mark.slow  # trains in processes of its own (the harnesses)
def test_telemetry_harness_with_mlflow(tmp_path):
    done, record = run_harness("telemetry", tmp_path)
    check_record(done, record, "telemetry", {"telemetry_step_time", "grad_check_step_time", "watchdog_step_time",
                                             "accounting_step_time"})
    assert math.isfinite(record["figures"]["grad_check_alone_ms"])
    assert math.isfinite(record["figures"]["mlflow_ms_per_report"])


@pytest.mark.slow  # trains in processes of its own (the harnesses)
def test_telemetry_harness_without_mlflow(tmp_path):
    done, record = run_harness("telemetry", tmp_path, "--no-mlflow")
    check_record(done, record, "telemetry", {"telemetry_step_time"})
    assert "mlflow_ms_per_report" not in record["figures"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip path is for machines without CUDA")
def test_gpu_amp_skips_cleanly_without_cuda(tmp_path):
    out = tmp_path / "gpu_amp.json"
    done = subprocess.run([sys.executable, "-m", "bench.gpu_amp", "--smoke", "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "skipped: no CUDA device" in done.stdout
    assert json.loads(out.read_text())["skipped"] == "no CUDA device"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_amp_harness(tmp_path):
    done, record = run_harness("gpu_amp", tmp_path)
    check_record(done, record, "gpu_amp", {f"{d}_{kind}_{layout}" for d in ("fp16", "bf16")
                                           for kind in ("speedup", "peak_memory", "speedup_vs_tf32")
                                           for layout in ("nchw", "channels_last")})


@pytest.mark.slow
def test_orchestration_harness(tmp_path, shared_ray_address):
    """The orchestration harness end to end on the CPU: every figure it reports is there and finite. Its two Ray
    candidates join the suite's shared Ray (`--address`) rather than each starting one: a Ray of submit's own is
    started by the end-to-end tests (tests/test_local_ray.py), and here it would only add two starts of Ray.

    Long: it times the same training four ways in processes of their own (a plain loop, ampflow's loop, a plain Ray
    Train script, ampflow through Ray Train), the worker groups' start-ups included, which are what it measures."""
    done, record = run_harness("orchestration", tmp_path, "--address", shared_ray_address, timeout=600)
    check_record(done, record, "orchestration", {"orchestration_throughput", "loop_throughput", "runtime_throughput",
                                                 "raytrain_throughput", "raytrain_startup"})
    assert record["config"]["ray"] == f"joined at {shared_ray_address}"
    launch = record["figures"]["launch_to_first_step_s"]
    assert all(math.isfinite(launch[name]) for name in ("plain", "loop", "raytrain", "ours"))
    # The plain Ray Train script ran once, as a user's script: its own windows, its own start-up.
    assert len(record["figures"]["raytrain_windows"]) == 1
    assert math.isfinite(record["figures"]["process_start_to_first_step_s"]["raytrain"])


def test_telemetry_poisons_a_channels_last_gradient_in_place():
    """The overflow attribution's timing plants an inf in a real gradient: on CUDA the defaults make conv
    gradients channels_last, which no flat view can reach."""
    from bench.telemetry import poison

    grad = torch.ones(2, 3, 4, 4).to(memory_format=torch.channels_last)
    poison(grad)
    assert torch.isinf(grad[0, 0, 0, 0]) and int(torch.isinf(grad).sum()) == 1
    assert grad.is_contiguous(memory_format=torch.channels_last)
