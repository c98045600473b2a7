"""The console: `--help` lists every config key of the schema with its default and doc line; `-v` / `-q` set
how much MLflow, Ray and ampflow say; what the user's code prints on the workers reaches it prefixed by rank."""

import dataclasses
import logging
import time
import typing

import pytest

from orchestrator import console
from orchestrator.config import reference, schema


def schema_keys(cls=schema.JobConfig, prefix=""):
    """Every leaf key, walked from the dataclasses themselves (not through `reference`)."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        inner = [a for a in (hint, *typing.get_args(hint), *[b for a in typing.get_args(hint)
                                                             for b in typing.get_args(a)])
                 if dataclasses.is_dataclass(a)]
        if inner:
            listed = typing.get_origin(hint) is list
            yield from schema_keys(inner[0], f"{prefix}{field.name}{'[]' if listed else ''}.")
        else:
            yield prefix + field.name


@pytest.mark.parametrize("command", ["orchestrator.cli.submit", "orchestrator.cli.sweep"])
def test_help_names_every_schema_key_with_its_default_and_doc_line(command, capsys):
    import importlib

    with pytest.raises(SystemExit) as done:
        importlib.import_module(command).main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    names = list(schema_keys())
    assert len(names) > 90 and "run.early_stopping.patience" in names and "precision.rules[].match" in names
    for name in names:
        assert f"    {name}  (" in text, name
    # A key's line carries its default, the next its doc line, from the schema source.
    assert "    run.epochs  (int) = 1\n        Passes over the training set." in text
    assert "    tracking.system_metrics_interval_s  (float) = 10.0\n" in text
    assert "    model.name  (str) = required\n" in text


def test_help_config_prints_only_the_keys(capsys):
    from orchestrator.cli.submit import main

    with pytest.raises(SystemExit):
        main(["--help-config"])
    out = capsys.readouterr().out
    assert out == reference.render() and "usage:" not in out


def test_every_key_has_a_doc_line():
    undocumented = [key.name for key in reference.keys() if not key.doc]
    assert undocumented == []


@pytest.mark.parametrize("level,mlflow_level,ray_level,progress", [
    (console.QUIET, logging.ERROR, logging.ERROR, False),
    (console.NORMAL, logging.WARNING, logging.ERROR, True),
    (console.VERBOSE, logging.INFO, logging.INFO, True),
])
def test_verbosity_reaches_mlflow_ray_and_the_progress_line(level, mlflow_level, ray_level, progress, monkeypatch,
                                                            capsys):
    monkeypatch.setenv("MLFLOW_LOGGING_LEVEL", "INFO")  # restored after the test
    ampflow = logging.getLogger("ampflow")
    monkeypatch.setattr(ampflow, "level", ampflow.level)
    monkeypatch.setattr(logging.getLogger("mlflow"), "level", logging.getLogger("mlflow").level)
    console.set_verbosity(level)
    assert logging.getLogger("mlflow").level == mlflow_level
    assert console.ray_logging_level() == ray_level and console.progress_shown() is progress
    logging.getLogger("ampflow.runner").info("an ampflow line")
    assert ("an ampflow line" in capsys.readouterr().err) is (level <= console.NORMAL)


class _Relay:
    """The relay's `write`, recorded (`relay.write.remote(lines)`)."""

    def __init__(self):
        self.lines = []
        self.write = type("Write", (), {"remote": staticmethod(self.lines.extend)})()


@pytest.mark.parametrize("which,rank,forwarded", [("rank0", 0, True), ("rank0", 1, False), ("all", 1, True),
                                                  ("none", 0, False)])
def test_what_a_rank_prints_goes_to_the_relay_by_line_prefixed_when_its_rank_is_forwarded(which, rank, forwarded,
                                                                                         capsys):
    import sys

    from orchestrator.tracking.relay import forwarded_output

    relay = _Relay()
    ray_like = logging.getLogger("test.ray_like")
    with forwarded_output(relay, rank, which):
        handler = logging.StreamHandler()  # a log handler writing to the (redirected) stderr, as Ray Train's do
        ray_like.addHandler(handler)
        try:
            print("loss", 0.5)
            sys.stdout.write("half a ")
            ray_like.warning("a log record stays in the worker's log")
            print("line", file=sys.stderr)
            sys.stdout.write("line")
        finally:
            ray_like.removeHandler(handler)
    expected = [f"[rank {rank}] loss 0.5", f"[rank {rank}] line", f"[rank {rank}] half a line"]
    assert relay.lines == (expected if forwarded else [])
    kept = capsys.readouterr()  # still written where it went before (Ray's worker log)
    assert "loss 0.5" in kept.out and "line" in kept.err and "a log record stays" in kept.err


def test_the_console_prints_worker_lines_above_the_progress_line():
    import io

    from orchestrator.tracking.progress import ConsoleProgress

    stream, pending = io.StringIO(), [["[rank 0] hello"], [], ["[rank 1] bye"]]
    progress = ConsoleProgress(lambda: {"epoch": 1, "epochs": 1, "step": 2, "total_steps": 2}, stream=stream,
                               lines=lambda: pending.pop(0) if pending else [], interval_s=0.01)
    with progress:
        deadline = time.monotonic() + 10
        while pending and time.monotonic() < deadline:
            time.sleep(0.01)
    text = stream.getvalue()
    assert text.index("[rank 0] hello\n") < text.index("epoch 1/1 | step 2/2") and "[rank 1] bye\n" in text
    assert text.count("hello") == 1
    quiet = io.StringIO()
    with ConsoleProgress(lambda: {"step": 1}, stream=quiet, lines=lambda: ["[rank 0] x"], show_progress=False):
        pass
    assert "step" not in quiet.getvalue() and "[rank 0] x" in quiet.getvalue()
