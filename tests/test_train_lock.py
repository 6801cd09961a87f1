"""One `hf-concept train` per output folder.

Fast (in-process and one tiny helper process): a second writer is refused at once with one line naming
the holder (pid, host, start time) and writes nothing; the hidden lock files neither make the folder
look used nor reach a saved or pushed model; a holder killed with SIGKILL leaves a lock the next run
takes at once. Slow: two real `train` processes started at the same moment into one absent folder, five
times; each time exactly one trains, the other exits non-zero with one line, and the survivor's folder
loads and resumes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hf_concept
from hf_concept import cli
from tests.conformance.families import _conceptmoe_config
from tests.test_train_command import make_workspace
from tests.workers.lock_race_worker import GO_ENV, LOAD_ENV

REPO = Path(__file__).resolve().parents[1]
# The workers import the same hf_concept as this process (and the tests package from this checkout).
PYTHONPATH = os.pathsep.join([str(Path(hf_concept.__file__).resolve().parents[1]), str(REPO)])


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = make_workspace(tmp_path_factory.mktemp("lock"))
    (root / "conceptmoe.json").write_text(_conceptmoe_config().to_json_string())
    return root


def _argv(workspace: Path, out: Path, *extra: str) -> list[str]:
    return [
        str(workspace / "conceptmoe.json"), "--data", str(workspace / "corpus.txt"),
        "--tokenizer", str(workspace / "tokenizer"), "--output-dir", str(out), "--block-size", "32",
        "--per-device-train-batch-size", "4", "--max-steps", "1", "--save-steps", "1", *extra,
    ]  # fmt: skip


def _error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if ": error:" in line]


def _global_step(out: Path) -> int:
    return json.loads((out / "checkpoints" / "trainer_state.json").read_text())["global_step"]


def test_a_second_writer_is_refused_at_once_naming_the_holder(workspace, tmp_path, capsys):
    from hf_concept.training.output_lock import LOCK_FILES, lock_output_dir

    out = tmp_path / "out"
    with lock_output_dir(out):
        status = cli.main(["train", *_argv(workspace, out)])
        lines = _error_lines(capsys.readouterr().err)
        assert status == 2 and len(lines) == 1, lines
        holder = f"(pid {os.getpid()} on host {socket.gethostname()}, started "
        assert f"output_dir={str(out)!r} is in use by another hf-concept train run {holder}" in lines[0]
        assert "another --output-dir" in lines[0]
        assert {path.name for path in out.iterdir()} == LOCK_FILES
    # Released: the holder record goes, the lock file stays for the next run to share.
    assert [path.name for path in out.iterdir()] == [".hf-concept-train.lock"]


def test_the_lock_files_neither_make_the_folder_used_nor_reach_the_model(workspace, tmp_path, capsys):
    from hf_concept.hub import files_to_upload
    from hf_concept.training.output_lock import LOCK_FILES, lock_output_dir

    out = tmp_path / "out"
    with lock_output_dir(out):
        pass
    assert cli.main(["train", *_argv(workspace, out)]) == 0, capsys.readouterr().err
    everything = {path.name for path in out.rglob("*")}
    assert ".hf-concept-train.lock" in everything and ".hf-concept-train.holder.json" not in everything
    assert not {path.name for path in files_to_upload(out)} & LOCK_FILES
    assert not {path.name for path in (out / "checkpoints" / "checkpoint-1").iterdir()} & LOCK_FILES


def _hold_in_a_child(out: Path) -> int:
    """Fork a process that takes the lock on `out` and sleeps; its pid once it holds the lock. (A fork
    of this process needs no imports, so the test takes a fraction of a second.)"""
    from hf_concept.training.output_lock import lock_output_dir

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            with lock_output_dir(out):
                os.write(write_end, b"held")
                time.sleep(120)
        finally:
            os._exit(0)
    os.close(write_end)
    assert os.read(read_end, 4) == b"held"
    os.close(read_end)
    return pid


def test_a_holder_killed_with_sigkill_does_not_block_the_next_run(tmp_path):
    from hf_concept.training.errors import TrainSetupError
    from hf_concept.training.output_lock import holder_of, lock_output_dir

    out = tmp_path / "out"
    pid = _hold_in_a_child(out)
    try:
        refused = f"in use by another hf-concept train run \\(pid {pid} on host "
        with pytest.raises(TrainSetupError, match=refused), lock_output_dir(out):
            pass
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    # The kernel dropped the dead process's lock; its holder record is stale and no longer reported.
    assert holder_of(out) is None
    with lock_output_dir(out):
        assert holder_of(out)["pid"] == os.getpid()


@pytest.mark.slow
def test_two_runs_started_together_into_one_folder_one_trains_one_is_refused(workspace, tmp_path, capsys):
    """Five rounds of two `train` processes released at the same moment into one absent folder (loading
    the model takes a second in each, as a real checkpoint's does)."""
    from transformers import AutoModelForCausalLM

    for round_ in range(5):
        out, go = tmp_path / f"out-{round_}", tmp_path / f"go-{round_}"
        env = dict(os.environ, PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1", **{GO_ENV: str(go), LOAD_ENV: "1"})
        command = [sys.executable, "-m", "tests.workers.lock_race_worker", *_argv(workspace, out)]
        workers = [
            subprocess.Popen(
                command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for _ in range(2)
        ]
        for worker in workers:
            assert worker.stdout.readline().strip() == "ready"
        go.touch()
        results = [(worker.wait(timeout=300), *worker.communicate()) for worker in workers]
        statuses = sorted(status for status, _, _ in results)
        assert statuses[0] == 0 and statuses[1] != 0, [(status, err[-2000:]) for status, _, err in results]
        refused = next(err for status, _, err in results if status != 0)
        lines = _error_lines(refused)
        assert len(lines) == 1 and (
            "is in use by another hf-concept train run" in lines[0] or "not empty" in lines[0]
        )
        # The survivor's folder is whole: it loads, and it resumes to the next step.
        AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
        assert _global_step(out) == 1
        status = cli.main(["train", *_argv(workspace, out, "--resume"), "--max-steps", "2"])
        assert status == 0, capsys.readouterr().err
        assert _global_step(out) == 2
