"""`hf-concept train` under bad input and faults: divergence stops the run and saves nothing non-finite,
`--max-steps 0` and a non-positive learning rate are refused, a non-empty output folder needs `--resume`,
`--resume-from` or `--overwrite-output-dir`, checkpoints are written atomically and only complete ones are
resumed, a run interrupted between or during checkpoint saves resumes to the uninterrupted run's weights,
and data that is not UTF-8 is named by file and byte offset."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Trainer, TrainerCallback

from hf_concept import cli
from hf_concept.training.checkpoints import checkpoint_problems, latest_checkpoint
from hf_concept.training.data import read_documents
from hf_concept.training.output_lock import LOCK_FILES
from hf_concept.training.recipes import check_schedule
from tests.conformance.families import _conceptmoe_config
from tests.test_train_command import make_workspace


class SimulatedKill(BaseException):
    """Stands for the process dying: nothing in the library catches a BaseException of this kind."""


class KillAfterStep3(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            raise SimulatedKill


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = make_workspace(tmp_path_factory.mktemp("faults"))
    (root / "conceptmoe.json").write_text(_conceptmoe_config().to_json_string())
    return root


def _run(workspace: Path, out: Path, *extra: str) -> int:
    argv = [
        "train", str(workspace / "conceptmoe.json"), "--data", str(workspace / "corpus.txt"),
        "--tokenizer", str(workspace / "tokenizer"), "--output-dir", str(out), "--block-size", "32",
        "--per-device-train-batch-size", "4", "--logging-steps", "2", "--learning-rate", "3e-3", *extra,
    ]  # fmt: skip
    return cli.main(argv)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _last_loss(out: Path) -> float:
    history = json.loads((out / "checkpoints" / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry][-1]


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if ": error:" in line]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_divergence_stops_at_the_first_non_finite_step_and_saves_nothing_non_finite(
    workspace, tmp_path, capsys
):
    out = tmp_path / "out"
    status = _run(workspace, out, "--max-steps", "6", "--save-steps", "1", "--learning-rate", "1e38")
    captured = capsys.readouterr()
    assert status == 1, captured.err
    line = _error_line(captured.err)
    assert "diverged at optimizer step" in line and "learning rate (1e+38)" in line, line
    assert "final train loss" not in captured.out
    assert not (out / "config.json").exists() and not list(out.glob("*.safetensors"))
    for checkpoint in (out / "checkpoints").glob("checkpoint-*"):
        for name, tensor in load_file(checkpoint / "model.safetensors").items():
            assert torch.isfinite(tensor).all(), (checkpoint.name, name)
    assert not list((out / "checkpoints").glob(".staging-*"))


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_max_steps_that_mean_nothing_are_refused(workspace, tmp_path, capsys, steps):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as raised:
        _run(workspace, out, "--max-steps", steps)
    assert raised.value.code == 2
    assert f"--max-steps: {steps!r} must be a positive number" in _error_line(capsys.readouterr().err)
    assert not out.exists()


@pytest.mark.parametrize(("rate", "named"), [("0", "=0.0"), ("-1e-3", "=-0.001"), ("nan", "=nan")])
def test_learning_rates_that_cannot_train_are_refused(workspace, tmp_path, capsys, rate, named):
    out = tmp_path / "out"
    assert _run(workspace, out, f"--learning-rate={rate}") == 2
    assert f"learning_rate{named} must be a positive finite number" in _error_line(capsys.readouterr().err)
    assert not out.exists()


def test_a_very_large_learning_rate_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_concept.train"):
        check_schedule(5.0, 10)
    assert "learning_rate=5 is very large" in caplog.text


def test_a_non_empty_output_dir_is_refused_with_the_ways_on(workspace, tmp_path, capsys):
    out = tmp_path / "out"
    (out / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    status = _run(workspace, out, "--max-steps", "1")
    line = _error_line(capsys.readouterr().err)
    assert status == 2 and "is not empty" in line
    assert all(flag in line for flag in ("--resume", "--resume-from", "--overwrite-output-dir"))
    # Nothing written but the (hidden) lock file the refused run took the folder with.
    written = sorted(path.name for path in out.rglob("*") if path.name not in LOCK_FILES)
    assert written == ["checkpoint-2", "checkpoints"]


def _fake_checkpoint(folder: Path, step: int) -> Path:
    checkpoint = folder / f"checkpoint-{step}"
    checkpoint.mkdir(parents=True)
    save_file({"weight": torch.ones(4, 4)}, str(checkpoint / "model.safetensors"))
    torch.save({"state": {}}, checkpoint / "optimizer.pt")
    torch.save({"last_epoch": step}, checkpoint / "scheduler.pt")
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return checkpoint


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (lambda folder: (folder / "optimizer.pt").unlink(), "optimizer.pt is missing"),
        (lambda folder: (folder / "scheduler.pt").write_bytes(b""), "scheduler.pt is missing"),
        (lambda folder: (folder / "trainer_state.json").write_text("{"), "not a valid trainer state"),
        (lambda folder: (folder / "model.safetensors").unlink(), "no weights"),
        (lambda folder: _truncate(folder / "model.safetensors"), "its header needs"),
    ],
)
def test_only_complete_checkpoints_are_resumed(tmp_path, caplog, damage, named):
    older = _fake_checkpoint(tmp_path, 2)
    newer = _fake_checkpoint(tmp_path, 10)
    assert checkpoint_problems(newer) == [] and latest_checkpoint(tmp_path) == newer
    damage(newer)
    problems = checkpoint_problems(newer)
    assert any(named in problem for problem in problems), problems
    with caplog.at_level(logging.WARNING, logger="hf_concept.train"):
        assert latest_checkpoint(tmp_path) == older
    assert f"skipping incomplete checkpoint {newer}" in caplog.text


def test_resume_from_an_incomplete_checkpoint_is_refused(workspace, tmp_path, capsys):
    checkpoint = _fake_checkpoint(tmp_path / "elsewhere", 4)
    (checkpoint / "optimizer.pt").unlink()
    status = _run(workspace, tmp_path / "out", "--max-steps", "6", "--resume-from", str(checkpoint))
    line = _error_line(capsys.readouterr().err)
    assert status == 2 and "is not a complete checkpoint: optimizer.pt is missing" in line


@pytest.fixture(scope="module")
def uninterrupted(workspace, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted") / "out"
    assert _run(workspace, out, "--max-steps", "6", "--save-steps", "2") == 0
    return out


def _kill_during_save_of_step_4(monkeypatch) -> None:
    original = Trainer._save_optimizer_and_scheduler

    def save(self, output_dir):
        if self.state.global_step == 4:
            raise SimulatedKill
        return original(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", save)


@pytest.mark.parametrize("kill", ["after step 3", "while saving checkpoint-4"])
def test_an_interrupted_run_resumes_to_the_uninterrupted_weights(
    workspace, uninterrupted, tmp_path, capsys, monkeypatch, kill
):
    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        extra = []
        if kill == "after step 3":
            extra = ["--callback", f"{__name__}:KillAfterStep3"]
        else:
            _kill_during_save_of_step_4(patch)
        with pytest.raises(SimulatedKill):
            _run(workspace, out, "--max-steps", "6", "--save-steps", "2", *extra)
    checkpoints = out / "checkpoints"
    # What a kill leaves: complete checkpoints only; a save in progress is a hidden staging folder.
    assert sorted(path.name for path in checkpoints.glob("checkpoint-*")) == ["checkpoint-2"]
    assert bool(list(checkpoints.glob(".staging-checkpoint-4"))) == (kill == "while saving checkpoint-4")
    assert _run(workspace, out, "--max-steps", "6", "--save-steps", "2") == 2
    capsys.readouterr()
    assert _run(workspace, out, "--max-steps", "6", "--save-steps", "2", "--resume") == 0
    assert not list(checkpoints.glob(".staging-*"))
    assert _digest(out / "model.safetensors") == _digest(uninterrupted / "model.safetensors")
    assert _last_loss(out) == _last_loss(uninterrupted)


def test_overwrite_output_dir_removes_the_earlier_runs_checkpoints(workspace, tmp_path):
    out = tmp_path / "out"
    stale = _fake_checkpoint(out / "checkpoints", 40)
    assert _run(workspace, out, "--max-steps", "2", "--save-steps", "2", "--overwrite-output-dir") == 0
    assert not stale.exists() and (out / "checkpoints" / "checkpoint-2").is_dir()
    assert checkpoint_problems(out / "checkpoints" / "checkpoint-2") == []


def test_data_that_is_not_utf8_is_named_by_file_and_offset(workspace, tmp_path, capsys):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"the cat sat on the mat .\n\nthe dog ran caf\xe9 .\n")
    status = _run(workspace, tmp_path / "out", "--data", str(bad))
    line = _error_line(capsys.readouterr().err)
    assert (
        status == 2 and str(bad) in line and "byte offset 41" in line and "--encoding-errors replace" in line
    )
    assert read_documents(bad, encoding_errors="replace")[-1] == "the dog ran caf\ufffd ."
    records = tmp_path / "records.jsonl"
    records.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(ValueError, match="byte offset 25"):
        read_documents(records)


def test_a_run_too_short_to_log_says_why_compression_is_missing(workspace, tmp_path, capsys):
    assert _run(workspace, tmp_path / "out", "--max-steps", "1", "--save-steps", "0") == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("compression")]
    assert row and row[0].endswith(
        "| n/a (no logging step in 1 step(s) with --logging-steps 2 and no eval split)"
    ), row
