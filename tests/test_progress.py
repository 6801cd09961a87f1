"""Progress bars stay out of redirected logs (`hf_concept.progress`): a bar whose stream is not a terminal
writes (almost) nothing, the same bar on a terminal is drawn, and the converter's bar and Trainer's follow
the same policy."""

from __future__ import annotations

import io
import sys

import torch

from hf_concept.conversion.writer import write_tensors
from hf_concept.progress import progress_bar, progress_disabled
from hf_concept.training.options import TrainOptions
from hf_concept.training.recipes import training_arguments

STEPS = 5_000


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run_bar(stream: io.StringIO, **options) -> str:
    # Redraw at every step: what floods a log when the bar is not held back.
    for _ in progress_bar(range(STEPS), file=stream, mininterval=0, miniters=1, desc="steps", **options):
        pass
    return stream.getvalue()


def test_a_bar_on_a_stream_that_is_not_a_terminal_stays_small():
    log = io.StringIO()
    assert progress_disabled(log)
    written = _run_bar(log)
    assert len(written) < 200 and written.count("\n") <= 2, written[:500]


def test_the_same_bar_on_a_terminal_is_drawn_unless_turned_off():
    assert not progress_disabled(Terminal())
    assert f"{STEPS}/{STEPS}" in _run_bar(Terminal())
    assert _run_bar(Terminal(), enabled=False) == ""


def test_the_converters_bar_writes_nothing_to_a_captured_stderr(tmp_path, capsys):
    tensors = ((f"t{index}", torch.zeros(2)) for index in range(300))
    write_tensors(tmp_path, tensors, total=300)
    assert len(capsys.readouterr().err) < 200


def test_trainers_bar_is_off_when_stderr_is_not_a_terminal(tmp_path, monkeypatch):
    options = TrainOptions(data=["a.txt"], output_dir=tmp_path)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert training_arguments(tmp_path, options, has_eval=False).disable_tqdm is True
    monkeypatch.setattr(sys, "stderr", Terminal())
    # On a terminal transformers decides as before (by its log level); an explicit choice is kept.
    assert training_arguments(tmp_path, options, has_eval=False).disable_tqdm is False
    kept = TrainOptions(data=["a.txt"], output_dir=tmp_path, disable_tqdm=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert training_arguments(tmp_path, kept, has_eval=False).disable_tqdm is False
