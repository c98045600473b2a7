"""The run's record stays true: a dataset profile says `variable` for a dim that varies from sample to sample, and
a command that its deadline ends while the run is still closing after a signal still says how to `--resume`."""

import subprocess
import sys

import torch

from conftest import REPO


def test_a_dataset_profile_marks_a_length_that_varies_between_samples_variable(monkeypatch):
    from omegaconf import OmegaConf

    from orchestrator.tracking.lineage import describe
    from orchestrator.train.batch import BatchLayout

    monkeypatch.syspath_prepend(str(REPO / "examples" / "text-classification"))
    import textcls

    train, _ = textcls.make_datasets(train_samples=32, eval_samples=8)
    layout = BatchLayout(("input_ids", "attention_mask"), "labels")
    batch = layout.batch(textcls.pad_collate([train[0], train[1]]))
    assert len({len(train[i]["input_ids"]) for i in range(8)}) > 1  # the subject: sentences of several lengths
    (lineage,) = describe(OmegaConf.create({"name": "textcls:make_datasets"}), [("train", train)], [batch])
    assert lineage.input_shape == ["variable"]
    images = [(i * torch.ones(3, 4, 4), 0) for i in range(4)]  # equal shapes stay numbers
    (fixed,) = describe(OmegaConf.create({"name": "mine:images"}), [("train", images)])
    assert fixed.input_shape == [3, 4, 4]


def test_the_deadline_that_ends_a_command_still_prints_the_resume_line():
    script = """
import os, signal, time
from orchestrator.errors import Interrupted, exit_within, interrupt_on_sigterm, resume_hint_on_exit
interrupt_on_sigterm()
exit_within(0.5)
resume_hint_on_exit("Run r closed KILLED; continue it with: python -m orchestrator.submit job.yaml --resume")
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
except Interrupted:
    time.sleep(30)  # closing the run hangs past the deadline
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 143, done.stderr
    assert "still closing 0.5 s after the signal" in done.stderr
    assert "python -m orchestrator.submit job.yaml --resume" in done.stderr
