"""A signal that lands where Python cannot raise still stops the command.

Python runs weakref callbacks and `__del__` methods (SQLAlchemy's run after most MLflow calls) where an
exception cannot propagate: a SIGTERM or Ctrl-C landing there is printed as "Exception ignored in ..." and
dropped, and the driver would train on with its MLflow run RUNNING. `interrupt_on_sigterm` makes the signal be
sent again, so it reaches the code that closes the run. Each case runs in a process of its own (signal handlers
are process-wide).
"""

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
    return subprocess.run([sys.executable, "-c", SCRIPT.format(signal=signal_name, where=where)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("signal_name, raised", [("SIGTERM", "Interrupted 15"), ("SIGINT", "KeyboardInterrupt None")])
def test_a_signal_swallowed_by_a_weakref_callback_is_delivered_again(signal_name, raised):
    done = run(signal_name)
    assert "Exception ignored" in done.stderr  # it did land in the callback, and Python dropped it there
    assert done.stdout.strip() == f"interrupted by {raised}", done.stdout + done.stderr
    assert done.returncode == 0


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
