"""`hf-concept train --resume` / `--resume-from` compare the run's settings with those its checkpoint records.

- Every checkpoint holds `run_settings.json`: the data's fingerprint (by content), the per-device batch
  size, the gradient accumulation steps and the world size.
- Another `--data`, batch size or accumulation is refused (exit 2, one line naming the checkpoint and each
  change, old -> new), and nothing in the output folder changes; `--resume-changed-settings` continues and
  names each change; the same settings resume without a word; a checkpoint without the record (written
  before it existed) resumes with one notice. World size is checked through the comparison itself, with a
  faked record (one process here).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_concept import cli
from hf_concept.training import run_settings
from hf_concept.training.errors import TrainSetupError
from hf_concept.training.output_lock import LOCK_PREFIX
from hf_concept.training.run_settings import (
    SETTINGS_NAME,
    check_run_settings,
    current_settings,
    data_fingerprint,
    settings_changes,
)
from tests.conformance.families import _plain_config
from tests.test_train_command import _paragraphs, make_workspace

NOTICE = "its settings could not be checked"
CONTINUED = "--resume-changed-settings: continuing from"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = make_workspace(tmp_path_factory.mktemp("resume-settings"))
    (root / "plain.json").write_text(_plain_config().to_json_string())
    (root / "other.txt").write_text("\n\n".join(_paragraphs(7, 40)))
    return root


def _run(workspace: Path, out: Path, *extra: str, data: str = "corpus.txt", batch: str = "4") -> int:
    argv = [
        "train", str(workspace / "plain.json"), "--data", str(workspace / data),
        "--tokenizer", str(workspace / "tokenizer"), "--output-dir", str(out), "--block-size", "32",
        "--per-device-train-batch-size", batch, "--logging-steps", "1", "--learning-rate", "3e-3", *extra,
    ]  # fmt: skip
    return cli.main(argv)


@pytest.fixture(scope="module")
def first_run(workspace, tmp_path_factory) -> Path:
    """A finished run of 2 steps with checkpoint-2 (batch size 4, no accumulation, corpus.txt)."""
    out = tmp_path_factory.mktemp("first") / "out"
    assert _run(workspace, out, "--max-steps", "2", "--save-steps", "2") == 0
    return out


@pytest.fixture
def out(first_run, tmp_path) -> Path:
    """A private copy of the first run's output folder (file times kept), free to resume into."""
    return Path(shutil.copytree(first_run, tmp_path / "out"))


def _listing(folder: Path) -> dict[str, tuple]:
    """Every entry under `folder` (the lock's own files aside) with its kind, size, mtime and content."""
    listing = {}
    for path in sorted(folder.rglob("*")):
        if path.name.startswith(LOCK_PREFIX):
            continue
        stat = path.stat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        listing[path.relative_to(folder).as_posix()] = (path.is_dir(), stat.st_size, stat.st_mtime_ns, digest)
    return listing


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if ": error:" in line]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def _global_step(out: Path) -> int:
    return json.loads((out / "checkpoints" / "trainer_state.json").read_text())["global_step"]


def _recorded(checkpoint: Path) -> dict:
    return json.loads((checkpoint / SETTINGS_NAME).read_text())


def test_a_checkpoint_records_the_settings_of_its_run(workspace, first_run):
    recorded = _recorded(first_run / "checkpoints" / "checkpoint-2")
    assert recorded["data"] == [str(workspace / "corpus.txt")]
    assert recorded["data_fingerprint"] == data_fingerprint([workspace / "corpus.txt"])
    assert (recorded["per_device_train_batch_size"], recorded["gradient_accumulation_steps"]) == (4, 1)
    assert recorded["world_size"] == 1


def test_other_data_is_refused_naming_it_and_nothing_changes(workspace, out, capsys):
    before = _listing(out)
    status = _run(workspace, out, "--max-steps", "4", "--save-steps", "1", "--resume", data="other.txt")
    line = _error_line(capsys.readouterr().err)
    checkpoint = out / "checkpoints" / "checkpoint-2"
    assert status == 2 and f"{checkpoint} was written by a run with other settings: data fingerprint" in line
    assert f"(--data {workspace / 'corpus.txt'} -> {workspace / 'other.txt'})" in line, line
    assert line.endswith(
        "resume with the same settings, or pass --resume-changed-settings to continue anyway"
    )
    assert "batch_size" not in line and "accumulation" not in line, line
    assert _listing(out) == before


def test_another_batch_size_and_accumulation_are_refused_naming_each(workspace, out, capsys):
    before = _listing(out)
    extra = ("--max-steps", "4", "--save-steps", "1", "--gradient-accumulation-steps", "2", "--resume")
    status = _run(workspace, out, *extra, batch="2")
    line = _error_line(capsys.readouterr().err)
    assert status == 2, line
    assert "per_device_train_batch_size 4 -> 2, gradient_accumulation_steps 1 -> 2:" in line, line
    assert "data fingerprint" not in line, line
    assert _listing(out) == before


def test_resume_from_another_folder_is_refused_and_leaves_no_folder(workspace, first_run, tmp_path, capsys):
    checkpoint = first_run / "checkpoints" / "checkpoint-2"
    before = _listing(first_run)
    new_out = tmp_path / "new"
    status = _run(workspace, new_out, "--max-steps", "4", "--resume-from", str(checkpoint), batch="2")
    line = _error_line(capsys.readouterr().err)
    assert status == 2 and f"{checkpoint} was written by a run with other settings" in line, line
    assert "per_device_train_batch_size 4 -> 2" in line, line
    assert not new_out.exists() and _listing(first_run) == before


def test_the_flag_continues_and_names_each_change(workspace, out, capsys):
    extra = ("--max-steps", "3", "--save-steps", "1", "--resume", "--resume-changed-settings")
    status = _run(workspace, out, *extra, data="other.txt", batch="2")
    stderr = capsys.readouterr().err
    assert status == 0, stderr
    continued = [line for line in stderr.splitlines() if CONTINUED in line]
    assert len(continued) == 2, stderr
    assert "data fingerprint" in continued[0] and str(workspace / "other.txt") in continued[0]
    assert continued[1].endswith("with per_device_train_batch_size 4 -> 2"), continued
    assert _global_step(out) == 3
    # The checkpoint the continued run wrote records its own settings.
    recorded = _recorded(out / "checkpoints" / "checkpoint-3")
    assert recorded["per_device_train_batch_size"] == 2
    assert recorded["data"] == [str(workspace / "other.txt")]


def test_the_same_settings_resume_without_a_word(workspace, out, capsys):
    status = _run(workspace, out, "--max-steps", "3", "--save-steps", "1", "--resume")
    stderr = capsys.readouterr().err
    assert status == 0, stderr
    assert NOTICE not in stderr and "other settings" not in stderr and CONTINUED not in stderr, stderr
    assert _global_step(out) == 3
    assert _recorded(out / "checkpoints" / "checkpoint-3") == _recorded(out / "checkpoints" / "checkpoint-2")


def test_a_checkpoint_without_the_record_resumes_with_one_notice(workspace, out, capsys):
    (out / "checkpoints" / "checkpoint-2" / SETTINGS_NAME).unlink()
    status = _run(workspace, out, "--max-steps", "3", "--save-steps", "1", "--resume", data="other.txt")
    stderr = capsys.readouterr().err
    assert status == 0, stderr
    notices = [line for line in stderr.splitlines() if NOTICE in line]
    assert len(notices) == 1 and f"no {SETTINGS_NAME}" in notices[0], stderr
    assert _global_step(out) == 3


def test_the_flag_without_resuming_is_refused(workspace, tmp_path, capsys):
    status = _run(workspace, tmp_path / "out", "--max-steps", "1", "--resume-changed-settings")
    line = _error_line(capsys.readouterr().err)
    assert status == 2 and "--resume-changed-settings goes with --resume or --resume-from" in line, line
    assert not (tmp_path / "out").exists()


def _settings(data: Path, world_size: int = 1) -> dict:
    args = SimpleNamespace(
        per_device_train_batch_size=4, gradient_accumulation_steps=1, world_size=world_size
    )
    return current_settings(data, args)


def test_another_world_size_is_a_change(workspace, tmp_path, caplog):
    current = _settings(workspace / "corpus.txt")
    recorded = {**current, "world_size": 2}
    assert settings_changes(recorded, current) == ["world_size 2 -> 1"]
    assert settings_changes(current, current) == []
    checkpoint = tmp_path / "checkpoint-8"
    checkpoint.mkdir()
    (checkpoint / SETTINGS_NAME).write_text(json.dumps(recorded))
    with pytest.raises(
        TrainSetupError, match=r"checkpoint-8 was written by a run with other settings: world_size 2 -> 1:"
    ):
        check_run_settings(checkpoint, current, allow_changes=False)
    with caplog.at_level(logging.WARNING, logger="hf_concept.train"):
        check_run_settings(checkpoint, current, allow_changes=True)
    assert [record.getMessage() for record in caplog.records] == [
        f"{CONTINUED} {checkpoint} with world_size 2 -> 1"
    ]


def test_the_data_fingerprint_follows_the_contents(workspace, tmp_path, monkeypatch):
    original = workspace / "corpus.txt"
    copy = Path(shutil.copy(original, tmp_path / "moved.txt"))
    # Moved or copied data is the same data; one changed byte is other data, and so is another order.
    assert data_fingerprint([copy]) == data_fingerprint([original])
    changes = settings_changes(_settings(original), _settings(copy))
    assert changes == []
    copy.write_bytes(copy.read_bytes()[:-1] + b"!")
    changes = settings_changes(
        _settings(copy), {**_settings(copy), "data_fingerprint": data_fingerprint([original])}
    )
    assert len(changes) == 1 and f"(--data {copy}, its contents changed)" in changes[0], changes
    other = workspace / "other.txt"
    assert data_fingerprint([original, other]) != data_fingerprint([other, original])
    # A large file counts by its size and both ends (a pass over a large corpus at every start is too slow).
    monkeypatch.setattr(run_settings, "FULL_HASH_BYTES", 64)
    monkeypatch.setattr(run_settings, "SAMPLE_BYTES", 16)
    large = tmp_path / "large.txt"
    large.write_bytes(b"a" * 200)
    first = data_fingerprint([large])
    large.write_bytes(b"a" * 100 + b"b" + b"a" * 99)
    assert data_fingerprint([large]) == first
    large.write_bytes(b"a" * 199 + b"b")
    assert data_fingerprint([large]) != first


def test_a_dataset_folder_counts_by_its_data_files(tmp_path):
    import datasets

    folder = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": ["one two", "three four"]}).save_to_disk(str(folder))
    first = data_fingerprint([folder])
    # A map's cache file beside the data, and hidden files, are not the dataset.
    (folder / "cache-0123.arrow").write_bytes(b"cache")
    (folder / ".lock").write_bytes(b"")
    assert data_fingerprint([folder]) == first
    other = tmp_path / "other"
    datasets.Dataset.from_dict({"text": ["five six"]}).save_to_disk(str(other))
    assert data_fingerprint([other]) != first
