"""One live progress line on the driver's console, from the newest report the driver has taken."""

import sys
import threading
import time
from typing import Any, Callable, Optional, TextIO


def format_line(metrics: dict[str, Any]) -> str:
    parts = [f"epoch {metrics.get('epoch', '?')}/{metrics.get('epochs', '?')}",
             f"step {metrics.get('step', '?')}/{metrics.get('total_steps', '?')}"]
    if "train/loss" in metrics:
        parts.append(f"loss {metrics['train/loss']:.4f}")
    if "eval/accuracy" in metrics:
        parts.append(f"acc {metrics['eval/accuracy']:.3f}")
    if "amp/loss_scale" in metrics:
        parts.append(f"scale {metrics['amp/loss_scale']:g}")
    if "perf/samples_per_s" in metrics:
        parts.append(f"{metrics['perf/samples_per_s']:.0f} samples/s")
    return " | ".join(parts)


class ConsoleProgress:
    """Shows `newest()` in a thread; rewrites one line on a TTY, prints a line every few seconds otherwise.
    Above it, the lines `lines()` gives (what the user's code printed on the workers), as they come.

    `newest` and `lines` are local (the MLflow writer's view of what the relay sent), so the console costs no
    call to the relay actor: on a small node every extra wake-up on the driver is taken from a worker.
    `show_progress=False` (-q): only the lines.
    """

    def __init__(self, newest: Callable[[], dict[str, Any]], stream: Optional[TextIO] = None,
                 interval_s: float = 1.0, lines: Callable[[], list[str]] = list, show_progress: bool = True):
        # sys.stderr looked up now, not at import: it may have been replaced since (tests, notebooks).
        self.newest, self.stream, self.interval_s = newest, stream or sys.stderr, interval_s
        self.lines, self.show_progress = lines, show_progress
        self.tty = self.stream.isatty()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ampflow-progress", daemon=True)
        self._last_line: Optional[str] = None
        self._last_print = float("-inf")
        self.plain_every_s = 10.0

    def __enter__(self) -> "ConsoleProgress":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._show(final=True)
        if self.tty and self._last_line:
            self.stream.write("\n")
            self.stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._show()

    def _show(self, final: bool = False) -> None:
        printed = self.lines()
        if printed:
            clear = "\r\033[K" if self.tty and self._last_line else ""
            self.stream.write(clear + "".join(text + "\n" for text in printed))
            if clear:
                self._last_line = None  # cleared: drawn again below
            self.stream.flush()
        metrics = self.newest() if self.show_progress else None
        line = format_line(metrics) if metrics else None
        if line is None or line == self._last_line:
            return
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r\033[K" + line)
        elif final or now - self._last_print >= self.plain_every_s:
            self.stream.write(line + "\n")  # logs and CI: a line every few seconds, not a wall
        else:
            return
        self.stream.flush()
        self._last_line, self._last_print = line, now
