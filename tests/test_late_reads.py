"""A step makes no host read that a hand-written torch.amp loop does not make: the skip of a step with non-finite
gradients (or a non-finite loss) is decided on the device, and the flags are read late; counters, the overflow
log, the guardrails and the schedule stay exactly what a read in the step would give.

On the CPU a copy to the host is complete at once; these tests make it look in flight (as on a GPU, where the
host runs ahead of the device) so that the flags are only read where the product reads late values."""

import contextlib
import time
from typing import Iterator

import pytest
import torch

from conftest import drill, small_job
from orchestrator.config import load_job
from orchestrator.precision import step_outcome
from orchestrator.train.local import LocalSession
from orchestrator.train.loop import TrainingLoop
from orchestrator.train.step import Step, accumulated_step
from orchestrator.train.batch import Batch
from orchestrator.train.clock import WindowClock
from orchestrator.train.training import build_training

CPU = torch.device("cpu")
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


HOST_BUFFERS: dict[int, torch.Tensor] = {}
"""The host copies' buffers by id (pinned memory on a GPU): reading those waits for nothing."""


@contextlib.contextmanager
def counted_reads() -> Iterator[list[str]]:
    """Every host read of a device tensor's value (`.item()`, `.tolist()`, `bool()`, `float()`, `int()`) while
    inside; the host copies' own buffers are host memory and not counted."""
    seen: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            if id(self) not in HOST_BUFFERS:
                seen.append(name)
            return original(self, *args, **kwargs)
        return read

    for name in READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@pytest.fixture
def copies_in_flight(monkeypatch):
    """Copies to the host look in flight until read (a GPU's: the host runs ahead of the device)."""
    monkeypatch.setattr(step_outcome.HostCopy, "ready", lambda self: False)
    original = step_outcome.HostCopy.__init__

    def init(self, tensor):
        original(self, tensor)
        if self.host is tensor:  # on the CPU the tensor is its own copy: a buffer of its own, as pinned memory is
            self.host = tensor.clone()
        HOST_BUFFERS[id(self.host)] = self.host
    monkeypatch.setattr(step_outcome.HostCopy, "__init__", init)


def build(write_job, preset: str, implementation: str = "auto", **precision):
    cfg = load_job(write_job(small_job(precision={"preset": preset, "init_scale": 1024.0, **precision},
                                       scaling={"num_workers": 1},
                                       optim={"implementation": implementation, "lr": 0.05, "schedule": "cosine"})))
    torch.manual_seed(0)
    return cfg, build_training(cfg, CPU, total_steps=8)


def batch() -> Batch:
    generator = torch.Generator().manual_seed(0)
    return Batch.pair(torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator))


def run_step(training, number: int, poison=None) -> Step:
    step = Step(number, 0, number - 1, [batch()])
    accumulated_step(training, step, CPU, poison)
    return step


def inf_gradient(step: Step, training) -> None:
    with torch.no_grad():
        name, tensor = training.precision.named_tensors[-1]
        tensor.grad.view(-1)[0] = float("inf")


@pytest.mark.parametrize("preset, implementation, own_reads", [
    ("O1", "fused", 0), ("O1", "foreach", 1), ("O0", "fused", 0), ("bf16-mixed", "fused", 0), ("O2", "fused", 0)])
def test_a_step_reads_nothing_on_the_host_but_gradscaler_s_own_check(write_job, copies_in_flight, preset,
                                                                      implementation, own_reads):
    """Steady-state steps (after the first, audited one) read no tensor value on the host, but for GradScaler's own
    check of its found-inf flag (one `.item()`, made only by an optimizer that is not fused); a step with an inf
    gradient is still not applied, and the skip is counted once the flags are read."""
    _, training = build(write_job, preset, implementation)
    run_step(training, 1)
    training.precision.settle()
    for number in (2, 3):
        with counted_reads() as reads:
            step = run_step(training, number)
        assert len(reads) == own_reads, reads
        assert not step.outcome.known or number == 2  # the step before was read before this step's update
    before = {k: v.clone() for k, v in training.precision.fp32_state_dict().items()}
    with counted_reads() as reads:
        skipped = run_step(training, 4, lambda step: inf_gradient(step, training))
    assert len(reads) == own_reads, reads
    assert skipped.outcome.taken.item() == 0.0  # decided on the device
    after = training.precision.fp32_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if not k.endswith("num_batches_tracked")
               and "running" not in k)
    counters = training.precision.guard.metrics()  # read here, at the "report"
    assert skipped.outcome.known and not skipped.outcome.stepped
    assert counters["amp/skipped_steps"] == 1.0
    assert counters["amp/nonfinite_grad_steps"] == (0.0 if preset in ("O1", "O2") else 1.0)


def test_read_late_the_overflow_record_names_the_layer_and_the_scale_backs_off(write_job, copies_in_flight):
    """O1 with a fused optimizer (no host read at all): step 2 overflows; its flags are read before step 3's
    update, when step 3's backward has replaced its gradients: the record still names the layer and the kind (from
    a per-gradient maximum kept on the device), its counts are null; the scale backed off on the device."""
    _, training = build(write_job, "O1", "fused")
    guard = training.precision.guard
    run_step(training, 1)
    overflowed = run_step(training, 2, lambda step: inf_gradient(step, training))
    assert not overflowed.outcome.known
    run_step(training, 3)
    assert overflowed.outcome.known and overflowed.outcome.overflow
    (record,) = guard.drain_overflow_log()
    name = training.precision.named_tensors[-1][0]
    assert (record["step"], record["param"], record["kind"], record["loss_scale"]) == (2, name, "inf", 1024.0)
    assert record["max_abs_grad"] is None and record["nonfinite_count"] is None
    assert guard.loss_scale() == 512.0
    assert guard.metrics()["amp/skipped_steps"] == 1.0


def test_a_nan_loss_read_late_skips_and_keeps_the_scale(write_job, copies_in_flight):
    """O1, a fused optimizer, a NaN loss at step 2: not applied, the scale stays (both on the device, before the
    flags are read); read later, the step counts as a skipped non-finite loss."""
    _, training = build(write_job, "O1", "fused", scaler={"on_nan_loss": "skip"})
    run_step(training, 1)
    before = {k: v.clone() for k, v in training.precision.fp32_state_dict().items()}
    step = run_step(training, 2, lambda s: setattr(s, "loss", s.loss * float("nan")))
    assert step.outcome.taken.item() == 0.0 and not step.outcome.known
    assert training.precision.guard.loss_scale() == 1024.0  # on the device: not an overflow
    after = training.precision.fp32_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if "running" not in k and "num_batches" not in k)
    assert step.outcome.nan_loss and training.precision.guard.metrics()["amp/nan_loss_steps"] == 1.0


def reports_of(cfg, tmp_path):
    session = LocalSession(0, 1, CPU, tmp_path)
    training = TrainingLoop(cfg, session).run()
    return training, [(r.step, {k: v for k, v in r.metrics.items() if k.startswith(("amp/", "optim/", "train/"))})
                      for r in session.reports]


@pytest.mark.parametrize("preset", ["O0", "O2"])
def test_a_first_step_skipped_on_the_device_leaves_fused_sgd_s_momentum_as_foreach_leaves_it(write_job, preset):
    """Fused SGD makes its momentum buffers uninitialised on its first step and fills them in the kernel the
    found-inf flag skips: an overflow on the very first step must not leave garbage there (it turned the weights
    into NaN one step later). Fused and foreach end the same after a skipped first step and a taken second."""
    finals = {}
    for implementation in ("fused", "foreach"):
        cfg, training = build(write_job, preset, implementation)
        assert run_step(training, 1, lambda step: inf_gradient(step, training)).outcome.stepped is False
        assert run_step(training, 2).outcome.stepped is True
        training.precision.settle()
        finals[implementation] = {name: p.detach().float().clone() for name, p in training.prepared.raw.named_parameters()}
    for name, fused in finals["fused"].items():
        assert torch.isfinite(fused).all(), name
        torch.testing.assert_close(fused, finals["foreach"][name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_loop_reads_late_and_reports_exactly_what_it_reported_reading_in_the_step(write_job, tmp_path,
                                                                                     monkeypatch):
    """The same run (fp16 with a fused optimizer, an overflow at step 3, a NaN loss skipped at step 6, a schedule),
    once with the flags read at once and once read late: the same reports (counters at the log interval, the loss,
    the learning rate), the same schedule position and the same weights."""
    cfg = load_job(write_job(small_job(
        precision={"preset": "O1", "init_scale": 1024.0, "scaler": {"on_nan_loss": "skip"}}, scaling={"num_workers": 1},
        optim={"implementation": "fused", "lr": 0.05, "warmup_fraction": 0.25, "clip_grad_norm": 5.0},
        run={"batch_size": 8, "max_steps_per_epoch": 8}, tracking={"log_every_n_steps": 2},
        callbacks=[drill("Overflow", at_steps=[3]), drill("NanLoss", at_step=6)])))
    first, reports = reports_of(cfg, tmp_path / "now")
    monkeypatch.setattr(step_outcome.HostCopy, "ready", lambda self: False)
    second, late_reports = reports_of(cfg, tmp_path / "late")
    assert late_reports == reports
    assert any(metrics.get("amp/skipped_steps") == 2.0 for _, metrics in reports)
    assert first.scheduler.last_epoch == second.scheduler.last_epoch == 6  # 8 steps, 2 skipped
    a, b = first.precision.fp32_state_dict(), second.precision.fp32_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("preset, implementation, allowed", [
    ("O1", "fused", 0), ("O1", "foreach", 1), ("bf16-mixed", "fused", 0), ("O0", "fused", 0), ("O0", "foreach", 1)])
def test_steady_state_steps_make_no_cuda_sync_but_gradscaler_s_own(write_job, preset, implementation, allowed):
    """Under `torch.cuda.set_sync_debug_mode("warn")`, steady-state steps of the product's step (`accumulated_step`)
    on batches already on the GPU make no synchronizing call, but for GradScaler's own check of its found-inf flag
    (one per step, only where the optimizer is not fused; fp32 and bf16 skip through a scale-1 GradScaler)."""
    import warnings

    cfg = load_job(write_job(small_job(precision={"preset": preset}, scaling={"num_workers": 1},
                                       optim={"implementation": implementation, "schedule": "cosine"})))
    device = torch.device("cuda")
    training = build_training(cfg, device, total_steps=20)
    inputs, targets = torch.randn(32, 3, 32, 32, device=device), torch.randint(0, 10, (32,), device=device)
    for number in (1, 2):  # the audited first step and the warm-up
        accumulated_step(training, Step(number, 0, number - 1, [Batch.pair(inputs, targets)]), device)
    training.precision.settle()
    torch.cuda.synchronize()
    steps = 5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for number in range(3, 3 + steps):
                accumulated_step(training, Step(number, 0, number - 1, [Batch.pair(inputs, targets)]), device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= allowed * steps, syncs
    training.precision.settle()
    assert training.precision.guard.metrics()["amp/skipped_steps"] <= 1.0  # fp16 may skip its first steps once



@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_accounting_of_a_steps_time_makes_no_cuda_sync_and_its_parts_add_up(write_job):
    """The loop's `WindowClock` times each step between two CUDA events and each wait for a batch on the host:
    under `set_sync_debug_mode("warn")` steady-state steps timed by it make no synchronizing call (fused
    optimizer, O1), and once the device has caught up its parts add up to the window's wall time."""
    import warnings

    cfg = load_job(write_job(small_job(precision={"preset": "O1"}, scaling={"num_workers": 1},
                                       optim={"implementation": "fused"})))
    device = torch.device("cuda")
    training = build_training(cfg, device, total_steps=20)
    inputs, targets = torch.randn(32, 3, 32, 32, device=device), torch.randint(0, 10, (32,), device=device)
    clock = WindowClock(device)
    batches = clock.batches([Batch.pair(inputs, targets)] * 7)
    for number in (1, 2):  # the audited first step and the warm-up
        with clock.step():
            accumulated_step(training, Step(number, 0, number - 1, [next(batches)]), device)
    training.precision.settle()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for number, batch in enumerate(batches, start=3):
                with clock.step():
                    accumulated_step(training, Step(number, 0, number - 1, [batch]), device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    training.precision.settle()
    torch.cuda.synchronize()
    began = clock.opened
    parts = clock.read()
    assert sum(parts.values()) == pytest.approx(time.perf_counter() - began, rel=0.05)
    assert parts["time/compute_s"] > 0
