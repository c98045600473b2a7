"""Throughput in FLOPs and tokens: a step's FLOPs counted by torch's counter and split by the dtype each op ran in,
the peak of a step's mix of dtypes, and `perf/tflops_per_s`, `perf/mfu` and `perf/tokens_per_s` in a run's
reports (the Ray-free loop on the CPU)."""

import time
from types import SimpleNamespace

import pytest
import yaml
import torch
from torch import nn

from conftest import REPO, small_job
from orchestrator.config import load_job
from orchestrator.errors import BadInput
from orchestrator.train.flops import count_flops
from orchestrator.train.local import LocalSession
from orchestrator.train.loop import TrainingLoop
from orchestrator.train.models import build_model
from orchestrator.train.peaks import PEAK_TFLOPS, device_row, step_peak_tflops

CPU = torch.device("cpu")


def test_a_linear_layers_training_flops_are_six_per_weight_per_sample():
    layer = nn.Linear(64, 32, bias=False)
    inputs = torch.randn(8, 64, requires_grad=True)
    tally = count_flops(lambda: layer(inputs).sum().backward())
    # forward 2 x 8 x 64 x 32; backward the same twice (the inputs' gradient and the weight's)
    assert tally.by_kind == {"fp32": 6 * 8 * 64 * 32}


def test_flops_are_counted_under_the_dtype_each_layer_ran_in():
    """A layer autocast to bf16 and a layer kept in fp32 in the same step: each one's FLOPs under its own kind."""
    lowered, kept = nn.Linear(16, 16, bias=False), nn.Linear(16, 4, bias=False)
    inputs = torch.randn(4, 16)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = lowered(inputs)
        kept(hidden.float()).sum().backward()

    tally = count_flops(step)
    assert tally.by_kind["bf16"] == 2 * 4 * 16 * 16 * 2  # forward, and the weight's gradient (no input gradient)
    assert tally.by_kind["fp32"] == 3 * 2 * 4 * 16 * 4  # forward, the input's and the weight's gradients
    assert tally.total == sum(tally.by_kind.values())


@pytest.mark.parametrize("name, row", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200"), ("NVIDIA H200 NVL", "H200 NVL"), ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100 80GB PCIe", "A100"), ("NVIDIA L4", "L4"), ("NVIDIA L40S", "L40S"), ("Tesla T4", None),
])
def test_device_names_as_torch_reports_them_find_their_row(name, row):
    assert device_row(name) == row


def test_a_mix_of_dtypes_peaks_where_each_kinds_flops_at_its_own_peak_take_as_long():
    """Half the FLOPs in fp8 and half in bf16 on an H100: 2 / (1/1978.9 + 1/989.4), not their plain mean."""
    flops = {"fp8": 10**12, "bf16": 10**12}
    peak = step_peak_tflops(flops, "H100 SXM")
    assert peak == pytest.approx(2 / (1 / 1978.9 + 1 / 989.4))
    assert step_peak_tflops({"bf16": 10**12}, "H100 SXM") == PEAK_TFLOPS["H100 SXM"]["bf16"]
    assert step_peak_tflops({"fp8": 10**12}, "A100") is None  # no fp8 tensor cores: no peak to compare with


def run_reports(write_job, tmp_path, **sections):
    cfg = load_job(write_job(small_job(scaling={"num_workers": 1}, **sections)))
    session = LocalSession(0, 1, CPU, tmp_path / "checkpoints")
    TrainingLoop(cfg, session).run()
    return [report for report in session.reports if "perf/samples_per_s" in report.metrics], session.reports


def test_a_run_logs_its_tflops_and_with_a_given_peak_its_mfu(write_job, tmp_path):
    reports, _ = run_reports(write_job, tmp_path, perf={"peak_tflops": 0.5},
                             run={"epochs": 1, "max_steps_per_epoch": 4, "batch_size": 16})
    model = build_model(load_job(write_job(small_job(scaling={"num_workers": 1}))).model)  # the same model, apart
    per_sample = count_flops(lambda: model(torch.randn(1, 3, 32, 32)).sum().backward()).total
    for report in reports:
        metrics = report.metrics
        assert metrics["perf/tflops_per_s"] == pytest.approx(per_sample * metrics["perf/samples_per_s"] / 1e12,
                                                             rel=1e-6)
        assert metrics["perf/mfu"] == pytest.approx(metrics["perf/tflops_per_s"] / 0.5)
        assert "perf/tokens_per_s" not in metrics  # images: no sequence dimension


def test_without_a_known_peak_mfu_is_not_logged_and_the_console_is_told_why_once(write_job, tmp_path):
    reports, every = run_reports(write_job, tmp_path, run={"epochs": 2, "max_steps_per_epoch": 4})
    assert len(reports) >= 2 and all("perf/tflops_per_s" in r.metrics and "perf/mfu" not in r.metrics
                                     for r in reports)
    said = [warning for report in every for warning in report.warnings if "perf/mfu" in warning]
    assert said == ["perf/mfu is not logged: no peak is known for a cpu device; set perf.peak_tflops to its peak "
                    "TFLOP/s to log it"]


@pytest.mark.parametrize("value", [0, -3.5, ".inf", ".nan"])
def test_a_peak_that_is_not_a_positive_finite_number_is_refused_naming_the_key(write_job, value, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(f"model: {{name: simple_cnn}}\ndata: {{name: digits}}\nperf: {{peak_tflops: {value}}}\n")
    with pytest.raises(BadInput, match=r"perf\.peak_tflops"):
        load_job(path)


def test_a_peak_that_is_not_a_number_is_refused_naming_the_key(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model: {name: simple_cnn}\ndata: {name: digits}\nperf: {peak_tflops: fast}\n")
    with pytest.raises(BadInput, match=r"perf\.peak_tflops"):
        load_job(path)


class TokenCount:
    """Each window's token ids and samples, as the batches hold them."""

    def __init__(self):
        self.windows, self.tokens, self.samples = [], 0, 0

    def after_step(self, loop, step):
        self.tokens += sum(batch.kwargs["input_ids"].numel() for batch in step.batches)
        self.samples += step.samples

    def collect(self, loop, report):
        if "perf/samples_per_s" in report.metrics:
            self.windows.append((self.tokens, self.samples))
            self.tokens = self.samples = 0


def test_a_batch_of_token_ids_logs_tokens_per_second(write_job, tmp_path, monkeypatch):
    """The text example's batches are padded to their longest sentence: tokens per sample vary by batch."""
    example = REPO / "examples" / "text-classification"
    monkeypatch.syspath_prepend(str(example))
    job = yaml.safe_load((example / "job.yaml").read_text())
    job.update(scaling={"num_workers": 1}, precision={"preset": "O0"},
               run={"epochs": 1, "batch_size": 16, "max_steps_per_epoch": 6},
               tracking={"log_every_n_steps": 2, "log_model": False})
    cfg = load_job(write_job(job))
    counted = TokenCount()
    session = LocalSession(0, 1, CPU, tmp_path / "checkpoints")
    TrainingLoop(cfg, session, hooks=[counted]).run()
    reports = [report.metrics for report in session.reports if "perf/samples_per_s" in report.metrics]
    assert len(reports) == len(counted.windows) >= 3
    for metrics, (tokens, samples) in zip(reports, counted.windows):
        assert metrics["perf/tokens_per_s"] == pytest.approx(tokens / samples * metrics["perf/samples_per_s"])
        assert metrics["perf/tflops_per_s"] > 0


class SlowSamples(torch.utils.data.Dataset):
    """Digits whose every sample takes `seconds` to load: the loader's wait is known."""

    def __init__(self, data, seconds: float):
        self.data, self.seconds = data, seconds

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        time.sleep(self.seconds)
        return self.data[index]


def slow_digits(seconds: float = 0.004):
    from orchestrator.train.data import _digits

    train, evaluation = _digits()
    return SlowSamples(train, seconds), evaluation


class SlowHook:
    """Host work of its own after each step: what `time/other_s` holds."""

    def after_step(self, loop, step):
        time.sleep(0.05)


def test_a_windows_wall_time_is_split_into_its_parts_each_where_it_was_spent(write_job, tmp_path):
    """Loading (a known sleep per sample), steps, evaluation and a checkpoint every 4 steps, a hook's own time:
    each lands in its part, the parts add up to the window's wall time, and the windows to the training's."""
    batch, per_sample = 8, 0.004
    cfg = load_job(write_job(small_job(
        scaling={"num_workers": 1}, data={"name": "test_throughput:slow_digits", "kwargs": {"seconds": per_sample}},
        run={"epochs": 1, "batch_size": batch, "max_steps_per_epoch": 12, "eval_every_n_steps": 4},
        checkpoint={"every_n_steps": 4}, tracking={"log_every_n_steps": 4})))
    session = LocalSession(0, 1, CPU, tmp_path / "checkpoints")
    loop = TrainingLoop(cfg, session, hooks=[SlowHook()])
    began = time.perf_counter()
    loop.run()
    trained = time.perf_counter() - began
    windows = [r.metrics for r in session.reports if "time/compute_s" in r.metrics]
    assert len(windows) == 3
    parts = ("data", "compute", "comm", "eval", "checkpoint", "other")
    for number, metrics in enumerate(windows):
        assert all(metrics[f"time/{part}_s"] >= 0 for part in parts)
        assert metrics["time/data_s"] >= 0.9 * 4 * batch * per_sample  # 4 steps' batches, loaded one by one
        assert metrics["time/other_s"] >= 4 * 0.05  # the hook's sleep after each of 4 steps
        assert metrics["time/compute_s"] > 0 and metrics["time/comm_s"] > 0
        wall = sum(metrics[f"time/{part}_s"] for part in parts)
        assert metrics["perf/samples_per_s_wall"] == pytest.approx(4 * batch / wall)
        if number > 0:  # the evaluation and checkpoint at the end of the window before (they follow its read)
            assert metrics["time/eval_s"] > 0 and metrics["time/checkpoint_s"] > 0
            assert metrics["perf/samples_per_s_wall"] < metrics["perf/samples_per_s"]  # which that one leaves out
    # The windows hold the training's time, from its first step to the last window's read: no more than the run
    # took, and at least every sleep planted in it (the epoch's closing evaluation and checkpoint follow that read).
    accounted = sum(sum(m[f"time/{part}_s"] for part in parts) for m in windows)
    assert 12 * (batch * per_sample + 0.05) <= accounted <= trained


class StreamEvent:
    """A CUDA event's stand-in for the arithmetic of `WindowClock.read` on a CPU: each `record()` takes the next
    device time (seconds) of the timeline a test lays out."""

    times: list[float] = []

    def __init__(self, enable_timing: bool = False):
        self.at = None

    def record(self):
        self.at = StreamEvent.times.pop(0)

    def elapsed_time(self, later: "StreamEvent") -> float:
        return (later.at - self.at) * 1000  # milliseconds, as CUDA's


def test_on_a_gpu_steps_count_as_the_device_ran_them_and_data_only_as_far_as_the_device_waited(monkeypatch):
    """A host that runs ahead: step 1's batch keeps the device idle for 1 s; step 2's batch takes the host 1.4 s
    while the device is still busy with step 1 (no idle gap: no data time); the window's reduction waits 3 s on
    the host, 2 of them for the device to finish step 2 (compute, not comm). The parts add up to the 6 s wall."""
    import orchestrator.train.clock as clock_module

    host = [0.0]
    monkeypatch.setattr(clock_module, "time", SimpleNamespace(perf_counter=lambda: host[0]))
    monkeypatch.setattr(torch.cuda, "Event", StreamEvent)
    StreamEvent.times = [1.0, 3.0, 3.0, 5.0]  # step 1 runs on the device from 1 s to 3 s, step 2 from 3 s to 5 s
    clock = clock_module.WindowClock(torch.device("cuda"))

    def loader():
        host[0] = 1.0
        yield "batch 1"
        host[0] = 2.5
        yield "batch 2"

    batches = clock.batches(loader())
    next(batches)
    with clock.step():
        host[0] = 1.1  # the host queued step 1 and went on
    next(batches)
    with clock.step():
        pass
    with clock.part("comm"):
        host[0] = 5.5
    host[0] = 6.0
    parts = clock.read()
    assert parts == pytest.approx({"time/data_s": 1.0, "time/compute_s": 4.0, "time/comm_s": 1.0,
                                   "time/eval_s": 0.0, "time/checkpoint_s": 0.0, "time/other_s": 0.0})
