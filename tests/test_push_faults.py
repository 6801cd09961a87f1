"""`hf-concept push` when the Hub cannot be reached or the upload fails: nothing lost, nothing silently wrong.

- The command line prints one line naming the repo and the cause and exits 1, for network and Hub errors
  (the real `HfApi` against a closed port, with and without a token); a bug of ours still raises.
- The checkpoint folder changes only after a successful upload: a failure anywhere leaves every file
  byte for byte as it was, and a success uploads the new card (from memory) in the one commit.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_concept import hub
from hf_concept.cli import main
from hf_concept.model_card import write_model_card
from tests.test_push import save_tiny

REPO_ROOT = Path(__file__).resolve().parents[1]


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_cli_offline(tmp_path: Path, folder: Path, token: str | None) -> subprocess.CompletedProcess:
    """`hf-concept push` in a fresh process whose Hub endpoint is a closed local port."""
    environment = {
        name: value
        for name, value in os.environ.items()
        if name not in ("HF_HUB_OFFLINE", "HF_TOKEN", "HF_TOKEN_PATH", "HF_ENDPOINT")
    }
    # HF_HOME without a saved login, so only HF_TOKEN can supply a token.
    environment |= {"HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}", "HF_HOME": str(tmp_path / "hf")}
    if token is not None:
        environment["HF_TOKEN"] = token
    command = [sys.executable, "-m", "hf_concept.cli", "push", str(folder), "org/tiny"]
    return subprocess.run(
        command, cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=300
    )


def fingerprint(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, hidden and skipped ones included."""
    return {
        path.relative_to(folder).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny("plain", tmp_path_factory.mktemp("faults") / "ckpt")


def test_cli_without_network_prints_one_line_and_exits_1(tmp_path, checkpoint):
    before = fingerprint(checkpoint)
    for token, cause in (("hf_fake", "Connection refused"), (None, "no Hub token")):
        result = run_cli_offline(tmp_path, checkpoint, token)
        err = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 1, result.stderr[-3000:]
        assert len(err) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert err[0].startswith("hf-concept push: error: upload to 'org/tiny' failed: "), err
        assert cause in err[0], err
        assert "pushed" not in result.stdout
    assert fingerprint(checkpoint) == before


class FakeHfApi:
    """A stand-in HfApi: `fail_at` names the call that raises `error`; every call is recorded, and a
    commit keeps its operations and what the folder's README.md held at that moment."""

    def __init__(
        self, folder: Path | None = None, fail_at: str | None = None, error: BaseException | None = None
    ) -> None:
        self.folder = folder
        self.fail_at = fail_at
        self.error = error or ConnectionError("[Errno 111] Connection refused")
        self.calls: list[str] = []
        self.operations: list = []
        self.readme_during_commit: bytes | None = None

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail_at:
            raise self.error

    def create_repo(self, **kwargs):
        self._call("create_repo")
        return SimpleNamespace(repo_id=kwargs["repo_id"])

    def create_branch(self, **kwargs):
        self._call("create_branch")

    def create_commit(self, **kwargs):
        self._call("create_commit")
        self.operations = list(kwargs["operations"])
        if self.folder is not None and (self.folder / "README.md").is_file():
            self.readme_during_commit = (self.folder / "README.md").read_bytes()
        return SimpleNamespace(commit_url=f"https://huggingface.co/{kwargs['repo_id']}/commit/abc123")

    # Any other way of uploading fails like the commit would.
    def upload_folder(self, **kwargs):
        self._call("create_commit")
        raise AssertionError("the upload is expected to be one create_commit")

    upload_file = upload_folder


def card_cases(tmp_path: Path, checkpoint: Path) -> dict[str, Path]:
    """A folder without a card (push writes one) and one with an untouched card naming the local path
    (push rewrites it)."""
    written = Path(shutil.copytree(checkpoint, tmp_path / "written"))
    rewritten = Path(shutil.copytree(checkpoint, tmp_path / "rewritten"))
    write_model_card(rewritten)
    assert hub.plan_upload(written, "org/tiny").card_action == "written"
    assert hub.plan_upload(rewritten, "org/tiny").card_action == "rewritten"
    return {"written": written, "rewritten": rewritten}


@pytest.mark.parametrize("fail_at", ["create_repo", "create_branch", "create_commit"])
def test_a_failed_push_leaves_the_folder_untouched(tmp_path, checkpoint, fail_at):
    for action, folder in card_cases(tmp_path, checkpoint).items():
        before = fingerprint(folder)
        api = FakeHfApi(fail_at=fail_at)
        with pytest.raises(ConnectionError):
            hub.push_checkpoint(folder, "org/tiny", revision="dev", api=api, report=lambda message: None)
        assert fail_at in api.calls
        assert fingerprint(folder) == before, f"{action}: the folder changed although {fail_at} failed"


def test_a_successful_push_sends_the_new_card_in_its_one_commit(tmp_path, checkpoint):
    for action, folder in card_cases(tmp_path, checkpoint).items():
        old_card = (folder / "README.md").read_bytes() if (folder / "README.md").exists() else None
        plan = hub.plan_upload(folder, "org/tiny")
        messages: list[str] = []
        api = FakeHfApi(folder)
        url = hub.push_checkpoint(folder, "org/tiny", api=api, report=messages.append)
        assert url == "https://huggingface.co/org/tiny/commit/abc123"
        assert api.calls == ["create_repo", "create_commit"], action
        sent = {operation.path_in_repo: operation.path_or_fileobj for operation in api.operations}
        assert sorted(sent) == [path for path, _ in plan.files]
        card = plan.card_text.encode("utf-8")
        assert sent["README.md"] == card and b'from_pretrained("org/tiny"' in card
        # The card went from memory; the folder got it only once the commit was made.
        assert api.readme_during_commit in (None, old_card)
        assert (folder / "README.md").read_bytes() == card
        verb = "wrote a model card" if action == "written" else "rewrote the model card"
        assert messages == [f"{verb} at {folder / 'README.md'} (its load snippet names 'org/tiny')"]


def test_hub_errors_are_one_line_and_bugs_still_raise(tmp_path, checkpoint, monkeypatch, capsys):
    wrapped = RuntimeError("Error while uploading 'model.safetensors' to the Hub.")
    wrapped.__cause__ = ConnectionError("[Errno 104] Connection reset by peer")
    api = FakeHfApi(fail_at="create_commit", error=wrapped)
    monkeypatch.setattr(hub, "HfApi", lambda token=None: api)
    folder = Path(shutil.copytree(checkpoint, tmp_path / "ckpt"))
    capsys.readouterr()
    assert main(["push", str(folder), "org/tiny", "--token", "hf_fake"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "upload to 'org/tiny' failed: " in err[0], err
    assert "model.safetensors" in err[0] and "Connection reset by peer" in err[0], err
    api.error = KeyError("a bug of ours")
    with pytest.raises(KeyError, match="a bug of ours"):
        main(["push", str(folder), "org/tiny", "--token", "hf_fake"])
