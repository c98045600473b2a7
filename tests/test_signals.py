"""A signal that lands where Python cannot raise still stops the command.

Python runs weakref callbacks and `__del__` methods (SQLAlchemy's run after most MLflow calls) where an
exception cannot propagate: a SIGTERM or Ctrl-C landing there is printed as "Exception ignored in ..." and
dropped, and the driver would train on with its MLflow run RUNNING. `interrupt_on_sigterm` makes the signal be
sent again, so it reaches the code that closes the run. Each case runs in a process of its own (signal handlers
are process-wide).
"""

import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time, weakref
    from orchestrator.errors import Interrupted, interrupt_on_sigterm

    interrupt_on_sigterm()
    {where}

    class Resource:
        pass

    def callback(ref):  # the signal arrives while this runs: its exception cannot propagate
        threading.Timer(0.1, os.kill, (os.getpid(), signal.{signal})).start()
        time.sleep(2)
        print("callback finished", flush=True)  # not reached: the signal ended the callback

    resource = Resource()
    ref = weakref.ref(resource, callback)
    try:
        del resource  # runs the callback
        time.sleep(10)
    except KeyboardInterrupt as exc:
        print("interrupted by", type(exc).__name__, getattr(exc, "signum", None), flush=True)
        sys.exit(0)
    print("trained on", flush=True)
    sys.exit(3)
""")


def run(signal_name: str, where: str = "") -> subprocess.CompletedProcess:
    # The child starts with SIGINT at its default, as a command started from a terminal does: a shell without job
    # control starts background commands (`make test &`, CI scripts) with SIGINT ignored, every child inherits that,
    # and Python then installs no Ctrl-C handler of its own.
    return subprocess.run([sys.executable, "-c", SCRIPT.format(signal=signal_name, where=where)], cwd=REPO,
                          capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.parametrize("signal_name, raised", [("SIGTERM", "Interrupted 15"), ("SIGINT", "KeyboardInterrupt None")])
def test_a_signal_swallowed_by_a_weakref_callback_is_delivered_again(signal_name, raised):
    done = run(signal_name)
    # It landed in the callback (cut short), where Python dropped it; sent again, it ended the sleep after it.
    assert done.stdout.strip() == f"interrupted by {raised}", done.stdout + done.stderr
    assert "Exception ignored" not in done.stderr, "an interrupt that is sent again is not reported as lost"
    assert done.returncode == 0


def test_the_sigterm_exit_of_ray_inits_handler_swallowed_by_a_weakref_callback_is_delivered_again():
    """While ray.init runs, SIGTERM meets Ray's own handler, `sys.exit(signum)`: dropped in a callback, it is sent
    again, and the process ends with it instead of training on."""
    done = run("SIGTERM", where="signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))")
    assert done.stdout == "" and done.returncode == 15, done.stdout + done.stderr


def test_other_unraisable_exceptions_still_reach_the_previous_hook_and_nothing_is_sent():
    where = textwrap.dedent("""
        seen = []
        chained = sys.unraisablehook
        sys.unraisablehook = lambda unraisable: seen.append(type(unraisable.exc_value).__name__)
        from orchestrator.errors import redeliver_swallowed_interrupts
        redeliver_swallowed_interrupts()
        redeliver_swallowed_interrupts()  # idempotent: one hook, not two
        def failing(ref):
            raise ValueError("a callback's own error")
        class Other:
            pass
        other = Other()
        other_ref = weakref.ref(other, failing)
        del other
        time.sleep(0.5)  # a wrongly sent signal would land here
        print("seen", seen, flush=True)
        sys.unraisablehook = chained
    """)
    done = run("SIGTERM", where)
    assert done.stdout.splitlines() == ["seen ['ValueError']", "interrupted by Interrupted 15"], \
        done.stdout + done.stderr


AT_FORK = textwrap.dedent("""
    import ctypes, functools, os, signal, sys, threading, time
    # Registered before logging's own at-fork callbacks, so run first after the fork, and C all through (os.kill
    # would handle the signal itself): Python handles the signal at its next function call, logging's
    # _releaseLock, which releases the lock logging took before the fork.
    os.register_at_fork(after_in_parent=functools.partial(ctypes.CDLL(None).kill, os.getpid(), signal.SIGINT))
    import logging
    from orchestrator.errors import interrupt_on_sigint

    interrupt_on_sigint()
    try:
        pid = os.fork()  # as ray.init starts its processes
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(5)
        print("not interrupted", flush=True)
    except KeyboardInterrupt as exc:
        print("interrupted by", type(exc).__name__, flush=True)
    other = threading.Thread(target=logging.getLogger, args=("another.thread",), daemon=True)
    other.start()
    other.join(5)
    print("logging", "stuck" if other.is_alive() else "free", flush=True)
""")


def test_ctrl_c_during_a_fork_interrupts_after_it_and_leaves_loggings_lock_free():
    """Ctrl-C handled in logging's at-fork callback (ray.init forks its processes as the MLflow run is created on
    another thread): raised there, it would be dropped and leave logging's lock held, and the other thread's next
    logging call (MLflow's) would wait forever. It is sent again instead, and ends the command after the fork."""
    done = subprocess.run([sys.executable, "-c", AT_FORK], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines() == ["interrupted by Interrupted", "logging free"], done.stdout + done.stderr
    assert "Exception ignored" not in done.stderr


COMMAND_EXIT = textwrap.dedent("""
    import atexit, os, signal, sys, time
    from orchestrator.errors import command_exit, interrupt_on_sigterm

    atexit.register(print, "finalized", flush=True)  # what Python's finalization would run
    interrupt_on_sigterm()
    code = 0
    try:
        if sys.argv[1] == "signal":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
    except KeyboardInterrupt:
        code = 143
    print("closed the run", end="")  # left in the buffer: command_exit flushes it
    command_exit(code)
""")


@pytest.mark.parametrize("case", ["signal", "finished"])
def test_an_interrupted_command_ends_without_pythons_finalization_its_output_flushed(case):
    """After SIGTERM (or Ctrl-C) the command has closed its run: the process then ends at once with 143, its output
    flushed, without tearing its modules down (torch's, Ray's and MLflow's take seconds of CPU, and on a loaded
    machine took 20 s of the 25 a signal promises). A command that was not interrupted finalizes as usual."""
    done = subprocess.run([sys.executable, "-c", COMMAND_EXIT, case], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    if case == "signal":
        assert (done.returncode, done.stdout) == (143, "closed the run"), done.stdout + done.stderr
    else:
        assert (done.returncode, done.stdout) == (0, "closed the runfinalized\n"), done.stdout + done.stderr
