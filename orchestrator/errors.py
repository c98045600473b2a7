"""Errors the CLI turns into exit codes, and the exit codes themselves (one definition for every command).

Bad input exits 2 before Ray starts; a run that trained and failed exits 1; Ctrl-C exits 130 and
SIGTERM 143 (128 + the signal's number, as shells report a process a signal ended).
"""

import logging
import os
import signal
import sys
import threading
from typing import NoReturn, Optional

EXIT_OK = 0
"""Done: the run finished, the job SUCCEEDED, the command did what was asked."""

EXIT_FAILED = 1
"""Training (or a remote job, or an export's accuracy check) failed; the MLflow run says FAILED."""

EXIT_BAD_INPUT = 2
"""Refused before anything started: no Ray, no MLflow run, nothing submitted."""

EXIT_INTERRUPTED = 130
"""Ctrl-C (SIGINT), numbered as shells number it (128 + 2)."""

EXIT_TERMINATED = 143
"""SIGTERM (`jobs stop`, Kubernetes, `kill`), 128 + 15."""


class BadInput(Exception):
    """A job file, override or name that cannot run: exit 2, nothing started.

    The message says what is wrong, where (file and key path) and what to do.
    """


class DataUnavailable(BadInput):
    """A dataset that cannot be found or downloaded; the message says where to put it."""


class Interrupted(KeyboardInterrupt):
    """Stopped by a signal: Ctrl-C (SIGINT) or SIGTERM. A KeyboardInterrupt, so every `except KeyboardInterrupt`
    that closes a run KILLED sees it; the CLI turns it into one line and `exit_code`."""

    def __init__(self, signum: int = signal.SIGINT, resume_hint: str = ""):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = int(signum)
        self.resume_hint = resume_hint
        """What to run to continue (set once a run exists), or empty."""

    @property
    def exit_code(self) -> int:
        return EXIT_TERMINATED if self.signum == signal.SIGTERM else EXIT_INTERRUPTED

    def describe(self) -> str:
        name = signal.Signals(self.signum).name
        return f"interrupted ({name}). {self.resume_hint}" if self.resume_hint else \
            f"interrupted ({name}) before training started; nothing to resume."

    @classmethod
    def of(cls, exc: BaseException) -> "Interrupted":
        """`exc` as an Interrupted: ours as it is; a bare KeyboardInterrupt, or the SystemExit the SIGTERM handler
        of `ray.init` raises, as the signal our handlers last caught (Ray's blocking calls may raise a plain
        KeyboardInterrupt in its place), else SIGINT."""
        return exc if isinstance(exc, Interrupted) else cls(_caught.get("signum", signal.SIGINT))


_caught: dict[str, int] = {}
"""The signal `interrupt_on_sigterm`'s (or `interrupt_on_sigint`'s) handler last caught."""

INTERRUPT_DEADLINE_S = 25.0
"""The commands (submit, sweep) exit at the latest this long after the first Ctrl-C or SIGTERM, with 128 + its
number, whatever is still closing: within the 30 s that Kubernetes, `jobs stop` and people give a process before
they kill it. Closing takes a few seconds (the workers stopped, the MLflow run closed KILLED, Ray shut down); the
deadline is for what hangs. The processes of a Ray the command started are then stopped by Ray's reaper."""

_deadline: dict[str, object] = {}
"""`exit_within`'s limit ("seconds"), and the timer the first interrupt started ("timer")."""


def interrupted_by(signum: int) -> "Interrupted":
    """The Interrupted for `signum`, caught by a handler other than ours (ray.init's SIGTERM handler exits with
    the signal's number): recorded as ours record it, and `exit_within`'s deadline started."""
    _caught["signum"] = signum
    _start_deadline(signum)
    return Interrupted(signum)


def _interrupt(signum, frame):
    _caught["signum"] = signum
    _start_deadline(signum)
    if frame is not None and frame.f_code in _NOT_HERE:
        # Raised here, the exception would be dropped ("Exception ignored") and logging's module lock left held,
        # so every other thread's next logging call would wait forever (MLflow's, creating the run beside Ray's
        # start, which forks its processes). The signal is sent again a moment later, to land elsewhere.
        _send_again(signum)
        return
    raise Interrupted(signum)


_NOT_HERE = frozenset({logging._acquireLock.__code__, logging._releaseLock.__code__})
"""Code an interrupt must not be raised in: logging's lock calls, which Python runs around each fork (ray.init
starts its processes with one) as at-fork callbacks, where an exception cannot propagate."""


def _send_again(signum: int) -> None:
    """Send `signum` to this process's main thread again in `REDELIVERY_DELAY_S`."""
    timer = threading.Timer(REDELIVERY_DELAY_S, signal.pthread_kill, (threading.main_thread().ident, signum))
    timer.daemon = True
    timer.start()


def interrupt_on_sigterm():
    """`jobs stop`, Kubernetes and `kill` end a job with SIGTERM: raise `Interrupted(SIGTERM)` instead, so the
    MLflow run is closed KILLED rather than left RUNNING. Returns the previous handler (None off the main
    thread, where no handler can be installed: a notebook's or a service's own threads).

    Also installs `redeliver_swallowed_interrupts`: a signal can land while Python runs a weakref callback or a
    `__del__` (SQLAlchemy's run after most MLflow calls), where Python cannot raise its exception and drops it;
    the signal is then sent again, so that it reaches the code that closes the run."""
    if threading.current_thread() is not threading.main_thread():
        return None
    redeliver_swallowed_interrupts()
    return signal.signal(signal.SIGTERM, _interrupt)


def interrupts_on_sigterm() -> bool:
    """Whether SIGTERM raises `Interrupted` here (`interrupt_on_sigterm`'s handler is the one installed)."""
    return signal.getsignal(signal.SIGTERM) is _interrupt


def interrupt_on_sigint():
    """Ctrl-C raises `Interrupted(SIGINT)` (a KeyboardInterrupt, as Python's own handler raises), and starts
    `exit_within`'s deadline when one is set. Returns the previous handler (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    redeliver_swallowed_interrupts()
    return signal.signal(signal.SIGINT, _interrupt)


def exit_within(seconds: Optional[float]) -> None:
    """From now on, the process ends at the latest `seconds` after the first Ctrl-C or SIGTERM its handlers
    (`interrupt_on_sigterm`, `interrupt_on_sigint`) catch, with 128 + that signal's number; None: never forced.
    For commands only: a notebook or service that calls `run()` is never exited."""
    _deadline["seconds"] = seconds


def resume_hint_on_exit(hint: str) -> None:
    """What to run to continue the run this process trains (`--resume`), printed however the process ends after a
    signal: also when `exit_within`'s deadline ends it while the run is still closing. Empty: no run yet."""
    _deadline["resume_hint"] = hint


def was_interrupted() -> bool:
    """Whether this process caught Ctrl-C or SIGTERM (its handlers' `Interrupted`): what fails after it (a relay
    that went down with the workers) is part of stopping, not news."""
    return "signum" in _caught


def _start_deadline(signum: int) -> None:
    seconds = _deadline.get("seconds")
    if seconds is None or "timer" in _deadline:
        return
    timer = threading.Timer(seconds, _exit_now, (signum, seconds))
    timer.daemon = True
    _deadline["timer"] = timer
    timer.start()


def _exit_now(signum: int, seconds: float) -> None:
    # Straight to file descriptor 2: the main thread may hold sys.stderr's lock (that may be what hangs).
    hint = _deadline.get("resume_hint")
    message = (f"\ninterrupted ({signal.Signals(signum).name}): still closing {seconds:g} s after the signal; "
               f"exiting now with {128 + signum}.{' ' + str(hint) if hint else ''}\n")
    try:
        os.write(2, message.encode())
    except OSError:
        pass
    os._exit(128 + signum)


def command_exit(code: int) -> NoReturn:
    """End a command's process with `code` (its `__main__` and console-script entry point).

    After Ctrl-C or SIGTERM (a signal our handlers caught, exit 130 or 143), the command has closed its run KILLED
    and released Ray by the time it returns: the process then ends without Python's finalization. Tearing down
    torch's, Ray's and MLflow's modules takes a second or two of CPU on a quiet machine, and on a loaded one it was
    seen to take 20 s, past the 25 s a signal promises (`INTERRUPT_DEADLINE_S`). Streams and log handlers are
    flushed first; any other exit is `sys.exit(code)`."""
    if code in (EXIT_INTERRUPTED, EXIT_TERMINATED) and "signum" in _caught:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said there
                pass
        os._exit(code)
    sys.exit(code)


REDELIVERY_DELAY_S = 0.05
"""How long after a swallowed interrupt its signal is sent again: time for the callback that swallowed it to
return, so the next one lands in ordinary code."""


def redeliver_swallowed_interrupts() -> None:
    """Chain a `sys.unraisablehook` that sends the signal of a KeyboardInterrupt (an `Interrupted`: its signal;
    a plain one: SIGINT), or of ray.init's SIGTERM exit, that Python could not raise, from a short timer, to this
    process's main thread. Other unraisable exceptions go to the previous hook unchanged. Idempotent."""
    previous = sys.unraisablehook
    if getattr(previous, "redelivers_interrupts", False):
        return

    def hook(unraisable) -> None:
        exc = unraisable.exc_value
        if isinstance(exc, KeyboardInterrupt):
            signum = getattr(exc, "signum", signal.SIGINT)
        elif isinstance(exc, SystemExit) and exc.code == signal.SIGTERM:  # ray.init's SIGTERM handler's
            signum = signal.SIGTERM
        else:
            previous(unraisable)  # the "Exception ignored in ..." lines, as before
            return
        # The interrupt is not lost (it is sent again), so nothing is printed: one line ends the command.
        interrupted_by(signum)
        _send_again(signum)

    hook.redelivers_interrupts = True
    sys.unraisablehook = hook
