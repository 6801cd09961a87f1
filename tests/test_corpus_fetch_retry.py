"""`hf-concept build-corpus`'s downloads are tried again with exponential back-off (`corpus_fetch.Backoff`).

A fake `apt-get download` that fails twice and then delivers is taken on the third try after waits of 1 and
2 (seconds, recorded rather than slept); one that always fails is tried four times and ends in the same
one-line error a single failure gave; a failure that is not the client's (it made no file) is not retried.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hf_concept.data import corpus_fetch
from hf_concept.data.corpus_fetch import Backoff

APT_ERROR = "E: Failed to fetch http://deb.debian.org/pool/bible-kjv_1.0_all.deb  Temporary failure resolving"


class FakeApt:
    """`subprocess.run` for `apt-get download`: fails `failures` times, then writes the .deb into cwd."""

    def __init__(self, failures: int, deliver: bool = True) -> None:
        self.failures, self.deliver, self.calls = failures, deliver, 0

    def __call__(self, command, cwd=None, **_) -> subprocess.CompletedProcess:
        assert command[:2] == ["apt-get", "download"], command
        self.calls += 1
        if self.calls <= self.failures:
            return subprocess.CompletedProcess(command, 100, b"", f"W: mirror slow\n{APT_ERROR}\n".encode())
        if self.deliver:
            (Path(cwd) / f"{command[2]}_1.0_all.deb").write_bytes(b"deb")
        return subprocess.CompletedProcess(command, 0, b"", b"")


@pytest.fixture
def waits() -> list[float]:
    return []


def _fetch(tmp_path: Path, monkeypatch, fake: FakeApt, waits: list[float]) -> Path:
    monkeypatch.setattr(corpus_fetch.subprocess, "run", fake)
    return corpus_fetch._cached_deb("bible-kjv", tmp_path / "debian", Backoff(sleep=waits.append))


def test_a_fetch_that_fails_twice_is_taken_on_the_third_try(tmp_path, monkeypatch, waits):
    fake = FakeApt(failures=2)
    deb = _fetch(tmp_path, monkeypatch, fake, waits)
    assert deb == tmp_path / "debian" / "bible-kjv_1.0_all.deb" and deb.read_bytes() == b"deb"
    assert fake.calls == 3 and waits == [1.0, 2.0]
    # Each try ran in a private folder of its own; none is left.
    assert sorted(path.name for path in (tmp_path / "debian").iterdir()) == [deb.name]


def test_a_fetch_that_always_fails_ends_in_the_one_line_error_of_the_last_try(tmp_path, monkeypatch, waits):
    fake = FakeApt(failures=99)
    with pytest.raises(RuntimeError) as error:
        _fetch(tmp_path, monkeypatch, fake, waits)
    assert fake.calls == 4 and waits == [1.0, 2.0, 4.0]
    assert str(error.value) == (
        f"`apt-get download bible-kjv` failed: {APT_ERROR}; "
        "run `apt-get update` and retry (or leave the source of bible-kjv out of --sources)"
    )
    assert list((tmp_path / "debian").iterdir()) == []


def test_a_client_that_succeeds_without_a_file_is_not_retried(tmp_path, monkeypatch, waits):
    fake = FakeApt(failures=0, deliver=False)
    with pytest.raises(RuntimeError, match=r"made no bible-kjv_\*\.deb file"):
        _fetch(tmp_path, monkeypatch, fake, waits)
    assert fake.calls == 1 and waits == []
