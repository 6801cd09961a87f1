"""`hf_concept.staging.staged`, the one stage-then-rename helper: a file or folder appears whole or not at
all, a failure leaves the old one and no staging path, and an old folder is replaced only once the new one
is complete (and comes back when the rename fails)."""

from __future__ import annotations

import os

import pytest

from hf_concept.staging import aside_folder, staged


def test_a_file_is_renamed_into_place_and_a_failure_leaves_the_old_one(tmp_path):
    path = tmp_path / "page.html"
    path.write_text("old")
    with staged(path) as staging:
        assert staging == tmp_path / ".page.html.partial"
        staging.write_text("new")
        assert path.read_text() == "old"
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["page.html"]
    with pytest.raises(KeyboardInterrupt), staged(path, durable=True) as staging:
        staging.write_text("half")
        raise KeyboardInterrupt
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["page.html"]


def test_a_folder_replaces_an_old_one_only_with_aside(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "old.txt").write_text("old")
    # Without `aside` a non-empty folder is not replaced (a concurrent writer finished first).
    with pytest.raises(OSError), staged(folder) as staging:
        staging.mkdir()
        (staging / "new.txt").write_text("new")
    assert os.listdir(folder) == ["old.txt"] and os.listdir(tmp_path) == ["corpus"]
    with staged(folder, aside=aside_folder) as staging:
        staging.mkdir()
        (staging / "new.txt").write_text("new")
    assert os.listdir(folder) == ["new.txt"] and os.listdir(tmp_path) == ["corpus"]


def test_the_old_folder_comes_back_when_the_rename_fails(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "old.txt").write_text("old")
    replace = os.replace

    def refuse_the_new_one(source, target):
        if str(source).endswith(".partial"):
            raise OSError("disk gone")
        replace(source, target)

    monkeypatch.setattr(os, "replace", refuse_the_new_one)
    with pytest.raises(OSError, match="disk gone"), staged(folder, aside=aside_folder) as staging:
        staging.mkdir()
    assert os.listdir(folder) == ["old.txt"] and os.listdir(tmp_path) == ["model"]
