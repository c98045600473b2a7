"""Per-step cost of our training telemetry vs a bare autocast + GradScaler step, and MLflow's cost apart.

What is compared (one process, no Ray, fp16 autocast + dynamic loss scaling, preset O1, the same
model, weights, batches and optimizer):

- `full`: what a worker does per step apart from data loading and DDP: the training loop's own
  `train_step` (GuardedScaler: unscale, found-inf and non-finite-loss flags gathered in one vector,
  the skip decided on the device, the vector copied to the host without blocking and read late; counters,
  collapse guardrails; MemoryLedger; overflow attribution when a step
  overflows; every hook; the loss `Window`), and every `--log-every` steps a report as the loop makes
  it (the window read, every hook's `collect`: loss-scale telemetry, the replay outbox, the system
  metrics sampled every `--system-metrics-interval` seconds). On Ray the report then goes to
  `ray.train.report`; here it goes to a list, because what happens after is Ray's cost and
  MLflow's, not the loop's.
- `none`: `torch.autocast` + `scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`.

Both make one host sync per step, GradScaler's own (`scaler.step` reads found-inf; none with a fused
optimizer); GuardedScaler adds none, so the difference is the bookkeeping.

Without a GradScaler (fp32, bf16) the loop still checks every step's gradients and loss with one all-reduced
flag vector (`precision.on_nonfinite_grads`), the skip decided on the device by a scale-1 GradScaler. Its cost is measured apart, on preset O0 (fp32),
the loop's step against itself: `checked` is the loop step as it runs; `unchecked` is the same loop whose guard
steps the optimizer without computing or reading the flags (a stand-in built here, never used by training).
The difference is the check: GradScaler's non-finite kernel over the gradients, the loss's isfinite, the skip
(GradScaler's own check of its flag: one host read with an optimizer that is not fused) and the flags' copy
(plus, on several ranks, one all-reduce of 2 x world-size floats).

The step watchdog (`failure.step_timeout_s`) is measured the same way, on preset O0: `watched` is the loop step
with the watchdog hook (its thread started, a timestamp stored at each step's end), `unwatched` the same loop with
`failure.step_timeout_s: null`; and the timestamp alone (the hook's `after_step`, 1,000 calls).

The accounting of a step's time (`time/*`, `orchestrator.train.clock.WindowClock`) is measured the same way, on
preset O1: `accounted` is the loop step as it runs (timed by the clock: on the host on a CPU, between two CUDA
events on a GPU; its batch taken through the clock's timed iterator; the clock read at each report), `unaccounted`
the same loop with a clock that times nothing. Target: at most 1% (`accounting_step_time` <= 1.01).

MLflow is measured separately: in ampflow the workers never talk to MLflow. Reports travel to the
driver, where `orchestrator.tracking.writer.MlflowWriter` logs them from its own thread, off the
training loop. The harness times that writer (`enqueue` + `_flush`, one `log_batch` per report)
against a real local SQLite store, per report and amortised per training step. `--no-mlflow`
skips that part (machines without mlflow/ray).
"""

import contextlib
import itertools
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import common
from orchestrator.common.report import Report

HARNESS = "telemetry"
TARGET = "<= 1.02"
ACCOUNTING_TARGET = "<= 1.01"
"""The accounting of a step's time (`time/*`) adds at most 1% to a step."""


def time_mlflow_writer(reports: list, repeats: int) -> dict[str, float]:
    """Seconds per report for the driver's MlflowWriter against a real SQLite store in a temp dir."""
    from orchestrator.tracking.writer import MlflowWriter
    from orchestrator.tracking.tracker import RunTracker, quick_http_failures

    quick_http_failures()
    with tempfile.TemporaryDirectory() as tmp:
        uri = f"sqlite:///{Path(tmp) / 'mlflow.db'}"
        cfg = common.job_config({"model": {"name": "simple_cnn"}, "data": {"name": "synthetic"},
                          "tracking": {"experiment": "bench-telemetry"}})
        tracker = RunTracker.start(uri, cfg, run_name="bench-telemetry", tags={}, params={}, config_yaml="")
        writer = MlflowWriter(relay=None, tracker=tracker)  # no relay: the harness hands it reports directly
        writer.enqueue(replace(reports[0], step=0))  # the store's first write (tables, caches) untimed
        writer._flush(force=True)
        per_report = []
        for step, report in enumerate(itertools.islice(itertools.cycle(reports), repeats), start=1):
            started = time.perf_counter()
            writer.enqueue(replace(report, step=step))
            writer._flush(force=True)
            per_report.append(time.perf_counter() - started)
        tracker.finish("FINISHED")
    return {"median_s": common.median(per_report), "spread": common.spread(per_report), "reports": len(per_report)}


def without_grad_check(guard) -> None:
    """Make `guard` (a GuardedScaler without a scaler) step without the per-step flags: clip, step, count, as a
    loop that trusts its gradients would. The baseline of the gradient check's cost, for this harness only."""
    from orchestrator.precision.step_outcome import StepOutcome
    from orchestrator.precision.guarded_step import clip

    assert not guard.scaler.is_enabled()

    def step(optimizer, loss, number, named_tensors, clip_grad_norm=None, clip_with=clip):
        guard.counters.epoch_steps += 1
        grad_norm = clip_with(optimizer, clip_grad_norm)
        optimizer.step()
        guard._clean_step()
        one = torch.ones((), device=loss.device)
        return StepOutcome(one, one, grad_norm, lambda: None).resolve(stepped=True)

    guard.step = step


def check_alone(guard, optimizer, loss: torch.Tensor) -> None:
    """The gradient check as the guard makes it, on the latest gradients: GradScaler's non-finite kernel with a
    scale of 1, the loss's isfinite, the flags copied to the host and read (one host read here)."""
    from orchestrator.precision.step_outcome import HostCopy

    skipper = guard.skipper
    skipper.scale_tensor(loss.device)
    skipper.unscale_(optimizer)
    found = torch.stack([flag.reshape(()) for flag in skipper.found_inf_flags(optimizer)]).sum()
    HostCopy(torch.stack([found, (~torch.isfinite(loss)).float()])).values()
    skipper.update()


def time_grad_check(device, model_name: str, batch: int, batches: list, *, warmup: int, repeats: int,
                    steps: int) -> dict[str, list[float]]:
    """Seconds per loop step on preset O0 with the gradient check (`checked`) and without it (`unchecked`), and
    seconds per check alone (`alone`: the flags computed and read on the checked loop's latest gradients), the
    three interleaved round by round so that they share the machine's moments."""
    cfg = common.job_config({"model": {"name": model_name}, "data": {"name": "synthetic"},
                             "precision": {"preset": "O0"}, "run": {"batch_size": batch},
                             "tracking": {"system_metrics_interval_s": 0}})
    checked, unchecked = common.LoopStepper(cfg, device), common.LoopStepper(cfg, device)
    unchecked.training.prepared.raw.load_state_dict(checked.training.prepared.raw.state_dict())
    without_grad_check(unchecked.training.precision.guard)
    streams = {"checked": itertools.cycle(batches), "unchecked": itertools.cycle(batches)}
    guard, optimizer = checked.training.precision.guard, checked.training.optimizer
    loss = torch.tensor(1.0, device=device)
    try:
        return common.interleaved({"checked": lambda: checked.step(*next(streams["checked"])),
                                   "unchecked": lambda: unchecked.step(*next(streams["unchecked"])),
                                   "alone": lambda: check_alone(guard, optimizer, loss)},
                                  warmup=warmup, repeats=repeats, steps=steps, sync=common.synchronize(device))
    finally:
        checked.close()
        unchecked.close()


def time_watchdog(device, model_name: str, batch: int, batches: list, *, warmup: int, repeats: int,
                  steps: int) -> dict[str, list[float]]:
    """Seconds per loop step on preset O0 with the step watchdog (`watched`, the job's default timeout) and
    without it (`unwatched`, `failure.step_timeout_s: null`), and seconds per progress timestamp (`tick`: the
    hook's `after_step`), interleaved round by round."""
    from orchestrator.train.hooks.watchdog import Watchdog

    def stepper(timeout_s):
        return common.LoopStepper(common.job_config({
            "model": {"name": model_name}, "data": {"name": "synthetic"}, "precision": {"preset": "O0"},
            "run": {"batch_size": batch}, "tracking": {"system_metrics_interval_s": 0},
            "failure": {"step_timeout_s": timeout_s}}), device)

    watched, unwatched = stepper(600.0), stepper(None)
    unwatched.training.prepared.raw.load_state_dict(watched.training.prepared.raw.state_dict())
    (hook,) = [hook for hook in watched.loop.hooks.hooks if isinstance(hook, Watchdog)]
    assert hook.thread is not None and hook.thread.is_alive() and not [
        h for h in unwatched.loop.hooks.hooks if isinstance(h, Watchdog) and h.thread is not None]
    streams = {"watched": itertools.cycle(batches), "unwatched": itertools.cycle(batches)}

    def ticks() -> None:
        for _ in range(1000):
            hook.after_step(None, None)

    try:
        times = common.interleaved({"watched": lambda: watched.step(*next(streams["watched"])),
                                    "unwatched": lambda: unwatched.step(*next(streams["unwatched"])),
                                    "tick": ticks}, warmup=warmup, repeats=repeats, steps=steps,
                                   sync=common.synchronize(device))
    finally:
        watched.close()
        unwatched.close()
    times["tick"] = [t / 1000 for t in times["tick"]]
    return times


class Unaccounted:
    """A stand-in for the loop's `WindowClock` that times nothing (never used by training): the loop's step
    without the accounting of its time."""

    def step(self):
        return contextlib.nullcontext()


def accounting_alone_s(device, calls: int = 2000) -> float:
    """Seconds of the clock's own work per step (a batch taken through its timed iterator, the step timed: two
    host timestamps on a CPU, two events recorded on the stream on CUDA), best of 5 rounds of `calls`."""
    from orchestrator.train.clock import WindowClock

    clock = WindowClock(device)
    batches = clock.batches(itertools.repeat(None))
    sync = common.synchronize(device)
    rounds = []
    for _ in range(5):
        sync()
        started = time.perf_counter()
        for _ in range(calls):
            next(batches)
            with clock.step():
                pass
        sync()
        rounds.append((time.perf_counter() - started) / calls)
        clock.read()
    return min(rounds)


def time_accounting(device, model_name: str, batch: int, batches: list, *, warmup: int, repeats: int,
                    steps: int, log_every: int) -> dict[str, list[float]]:
    """Seconds per loop step on preset O1 with the accounting of its time (`accounted`: the step timed by the
    loop's `WindowClock`, on CUDA between two events on the stream, its batch taken through the clock's timed
    iterator, the clock read every `log_every` steps) and without it (`unaccounted`), interleaved round by
    round."""
    def stepper():
        return common.LoopStepper(common.job_config({
            "model": {"name": model_name}, "data": {"name": "synthetic"}, "precision": {"preset": "O1"},
            "run": {"batch_size": batch}, "tracking": {"system_metrics_interval_s": 0}}), device)

    accounted, unaccounted = stepper(), stepper()
    unaccounted.training.prepared.raw.load_state_dict(accounted.training.prepared.raw.state_dict())
    unaccounted.loop.clock = Unaccounted()
    clock = accounted.loop.clock
    timed, plain = clock.batches(itertools.cycle(batches)), itertools.cycle(batches)

    def accounted_step() -> None:
        accounted.step(*next(timed))
        if accounted.loop.global_step % log_every == 0:
            accounted.training.precision.settle()  # as before a report: the window's read waits for the device
            clock.read()

    def unaccounted_step() -> None:
        unaccounted.step(*next(plain))
        if unaccounted.loop.global_step % log_every == 0:
            unaccounted.training.precision.settle()

    try:
        return common.interleaved({"accounted": accounted_step, "unaccounted": unaccounted_step},
                                  warmup=warmup, repeats=repeats, steps=steps, sync=common.synchronize(device))
    finally:
        accounted.close()
        unaccounted.close()


def poison(grad: torch.Tensor) -> None:
    """Make `grad`'s first element inf in place, whatever its memory format (a channels_last gradient is no view of
    a flat tensor)."""
    grad[(0,) * grad.dim()] = float("inf")


def main(argv=None) -> int:
    cli = common.with_device(common.parser(HARNESS, "full training telemetry vs a bare autocast+GradScaler step; MLflow cost apart"))
    cli.add_argument("--model", help="registry name (default: simple_cnn on cpu, resnet18 on cuda)")
    cli.add_argument("--batch-size", type=int, help="default 64 on cpu, 256 on cuda, 8 with --smoke")
    cli.add_argument("--log-every", type=int, default=10, help="steps between reports (tracking.log_every_n_steps)")
    cli.add_argument("--repeats", type=int,
                     help="timed rounds per candidate (default 21 on cuda, 9 on cpu; 2 with --smoke)")
    cli.add_argument("--steps", type=int, help="steps per round, a multiple of --log-every (default 20 on cpu, "
                                              "50 on cuda; 10 with --smoke)")
    cli.add_argument("--warmup", type=int, help="untimed steps per candidate (default 40; 10 with --smoke)")
    cli.add_argument("--no-mlflow", action="store_true", help="skip the MLflow writer measurement")
    cli.add_argument("--system-metrics-interval", type=float, default=1.0,
                     help="seconds between system metric samples during the run (tracking.system_metrics_interval_s; "
                          "default 1, ten times as often as a job's default; 0: off)")
    args = cli.parse_args(argv)
    device = common.chosen_device(args)
    if device is None:
        return 2
    gpu = device.type == "cuda"
    model_name = args.model or ("resnet18" if gpu and not args.smoke else "simple_cnn")
    batch = args.batch_size or (8 if args.smoke else 256 if gpu else 64)
    repeats = args.repeats or (2 if args.smoke else 21 if gpu else 9)  # a GPU figure: 20 rounds or more
    steps = args.steps or (args.log_every if args.smoke else 50 if gpu else 20)
    warmup = args.warmup or (10 if args.smoke else 40)

    from orchestrator.train.models import build_model
    from orchestrator.train.system import SystemSampler

    cfg = common.job_config({"model": {"name": model_name}, "data": {"name": "synthetic"}, "precision": {"preset": "O1"},
                      "run": {"batch_size": batch}, "tracking": {"system_metrics_interval_s": args.system_metrics_interval}})
    # The worker's loop, stepped on the batches below. Its system-metrics sampler runs all along: its wake-ups
    # land in both candidates' rounds, so its own cost is measured apart below (per sample); `full` pays its
    # per-step part (the step it samples at) and the take.
    stepper = common.LoopStepper(cfg, device)
    training = stepper.training
    amp = training.precision.policy.amp
    sink: list = []

    bare_model = build_model(cfg.model)
    bare_model.load_state_dict(training.precision.fp32_state_dict())
    bare_model.to(device)
    o = cfg.optim
    bare_opt = torch.optim.SGD(bare_model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    bare_scaler = torch.amp.GradScaler(device.type, init_scale=amp.init_scale, growth_factor=amp.growth_factor,
                                       backoff_factor=amp.backoff_factor, growth_interval=amp.growth_interval)

    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(batch, 3, 32, 32, generator=generator).to(device),
                torch.randint(0, cfg.model.num_classes, (batch,), generator=generator).to(device)) for _ in range(4)]
    full_batches, bare_batches = itertools.cycle(batches), itertools.cycle(batches)

    def full_step() -> None:
        stepper.step(*next(full_batches))
        if stepper.loop.global_step % args.log_every == 0:  # the worker's periodic report, minus ray.train.report
            sink.append(stepper.report())

    def bare_step() -> None:
        inputs, targets = next(bare_batches)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = F.cross_entropy(bare_model(inputs).float(), targets)
        bare_opt.zero_grad(set_to_none=True)
        bare_scaler.scale(loss).backward()
        bare_scaler.step(bare_opt)
        bare_scaler.update()

    from orchestrator.train.hooks.system import SystemMetrics

    (metrics_hook,) = [hook for hook in stepper.loop.hooks.hooks if isinstance(hook, SystemMetrics)]
    sampler = metrics_hook.sampler  # None when off
    try:
        times = common.interleaved({"full": full_step, "none": bare_step}, warmup=warmup, repeats=repeats,
                                   steps=steps, sync=common.synchronize(device))
    finally:
        stepper.close()
    samples_taken = sum(len(report.system_samples) for report in sink)
    probe = sampler or SystemSampler(0, device, 1.0)  # not started: only its reading is timed
    sample_started = time.perf_counter()
    for _ in range(20):
        probe.sample()
    sample_ms = (time.perf_counter() - sample_started) / 20 * 1e3
    med = {name: common.median(values) for name, values in times.items()}

    # Overflow attribution only runs on a skipped step: time it apart, on a real gradient with one inf.
    from orchestrator.precision.guarded_step import first_nonfinite

    grads = [t.grad for _, t in training.precision.named_tensors if t.grad is not None]
    attribution_ms = float("nan")
    if grads:
        poison(grads[0])
        sync = common.synchronize(device)
        sync()
        started = time.perf_counter()
        for _ in range(5):
            first_nonfinite(training.precision.named_tensors)
        sync()
        attribution_ms = (time.perf_counter() - started) / 5 * 1e3

    print(f"bench.telemetry on {common.device_description(device)}: {model_name}, batch {batch}, O1 (fp16 + dynamic "
          f"scale), report every {args.log_every} steps, {repeats} rounds x {steps} steps")
    rows = [[name, med[name] * 1e3, batch / med[name], f"{common.spread(values) * 100:.1f}%"]
            for name, values in times.items()]
    common.print_table(["candidate", "ms/step", "samples/s", "spread"], rows)
    figures = {"full_ms_per_step": med["full"] * 1e3, "none_ms_per_step": med["none"] * 1e3,
               "overhead_ms_per_step": (med["full"] - med["none"]) * 1e3,
               "full_ms_per_step_repeats": [t * 1e3 for t in times["full"]],
               "none_ms_per_step_repeats": [t * 1e3 for t in times["none"]],
               "overflow_attribution_ms": attribution_ms,
               "skipped_steps_full": training.precision.guard.counters.skipped_steps, "reports": len(sink),
               "system_metrics_interval_s": args.system_metrics_interval, "system_samples_taken": samples_taken,
               "system_sample_ms": sample_ms}
    print(f"overflow attribution (skipped steps only): {attribution_ms:.3g} ms")

    check_times = time_grad_check(device, model_name, batch, batches, warmup=warmup, repeats=repeats, steps=steps)
    check_med = {name: common.median(values) for name, values in check_times.items()}
    print("gradient check without a scaler (preset O0, the loop step with and without it):")
    common.print_table(["candidate", "ms/step", "spread"], [[name, check_med[name] * 1e3,
                                                             f"{common.spread(values) * 100:.1f}%"]
                                                            for name, values in check_times.items()
                                                            if name != "alone"])
    alone_share = common.median([a / u for a, u in zip(check_times["alone"], check_times["unchecked"])])
    print(f"the check alone (flags computed and read on the step's gradients): {check_med['alone'] * 1e3:.3g} ms, "
          f"{alone_share * 100:.2g}% of an unchecked step (median over rounds)")
    figures.update({"grad_check_alone_ms": check_med["alone"] * 1e3, "grad_check_alone_share": alone_share,
                    "fp32_checked_ms_per_step": check_med["checked"] * 1e3,
                    "fp32_unchecked_ms_per_step": check_med["unchecked"] * 1e3,
                    "grad_check_ms_per_step": (check_med["checked"] - check_med["unchecked"]) * 1e3})
    watch_times = time_watchdog(device, model_name, batch, batches, warmup=warmup, repeats=repeats, steps=steps)
    watch_med = {name: common.median(values) for name, values in watch_times.items()}
    print("step watchdog (failure.step_timeout_s, preset O0, the loop step with and without it):")
    common.print_table(["candidate", "ms/step", "spread"], [[name, watch_med[name] * 1e3,
                                                             f"{common.spread(values) * 100:.1f}%"]
                                                            for name, values in watch_times.items()
                                                            if name != "tick"])
    print(f"the watchdog's per-step work alone (one timestamp): {watch_med['tick'] * 1e9:.0f} ns, "
          f"{watch_med['tick'] / watch_med['unwatched'] * 100:.2g}% of a step")
    figures.update({"watchdog_tick_ns": watch_med["tick"] * 1e9,
                    "watchdog_tick_share": watch_med["tick"] / watch_med["unwatched"],
                    "watched_ms_per_step": watch_med["watched"] * 1e3,
                    "unwatched_ms_per_step": watch_med["unwatched"] * 1e3,
                    "watched_spread": common.spread(watch_times["watched"]),
                    "unwatched_spread": common.spread(watch_times["unwatched"])})
    account_times = time_accounting(device, model_name, batch, batches, warmup=warmup, repeats=repeats,
                                    steps=steps, log_every=args.log_every)
    account_med = {name: common.median(values) for name, values in account_times.items()}
    print("accounting of a step's time (time/*, preset O1, the loop step with and without it):")
    common.print_table(["candidate", "ms/step", "spread"], [[name, account_med[name] * 1e3,
                                                             f"{common.spread(values) * 100:.1f}%"]
                                                            for name, values in account_times.items()])
    alone = accounting_alone_s(device)
    print(f"the accounting's per-step work alone: {alone * 1e6:.3g} us, "
          f"{alone / account_med['unaccounted'] * 100:.2g}% of a step")
    figures.update({"accounting_alone_us": alone * 1e6, "accounting_alone_share": alone / account_med["unaccounted"],
                    "accounted_ms_per_step": account_med["accounted"] * 1e3,
                    "unaccounted_ms_per_step": account_med["unaccounted"] * 1e3,
                    "accounted_spread": common.spread(account_times["accounted"]),
                    "unaccounted_spread": common.spread(account_times["unaccounted"])})
    print(f"system metrics: {samples_taken} samples during the run; one sample takes {sample_ms:.3g} ms on the "
          f"sampler's thread (every 10 s by default: {sample_ms / 100:.2g}% of one core)")
    if not args.no_mlflow:
        writer = time_mlflow_writer(sink or [Report(metrics={"train/loss": 0.0})], repeats=6 if args.smoke else 30)
        figures.update({"mlflow_ms_per_report": writer["median_s"] * 1e3,
                        "mlflow_ms_per_step_amortised": writer["median_s"] * 1e3 / args.log_every,
                        "mlflow_reports_timed": writer["reports"], "mlflow_spread": writer["spread"]})
        print(f"MLflow writer (driver thread, off the loop; local SQLite): {writer['median_s'] * 1e3:.3g} ms per "
              f"report = {writer['median_s'] * 1e3 / args.log_every:.3g} ms per step amortised")
    common.finish(
        HARNESS, device=common.device_description(device),
        config={"model": model_name, "batch_size": batch, "preset": "O1", "log_every_n_steps": args.log_every,
                "warmup": warmup, "repeats": repeats, "steps_per_repeat": steps, "mlflow": not args.no_mlflow,
                "smoke": args.smoke},
        figures=figures, ratios={"telemetry_step_time": med["full"] / med["none"],
                                 "grad_check_step_time": check_med["checked"] / check_med["unchecked"],
                                 "watchdog_step_time": watch_med["watched"] / watch_med["unwatched"],
                                 "accounting_step_time": account_med["accounted"] / account_med["unaccounted"]},
        targets={"telemetry_step_time": TARGET, "accounting_step_time": ACCOUNTING_TARGET}, json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
