"""Fault injection (slow): `hf-concept train` killed with SIGKILL during a checkpoint save, between
checkpoints (from outside, while steps run) and during the final save, then continued with `--resume`
each time, ends with the same final weights (file hash) and the same last logged loss as a run that was
never interrupted — for ConceptMoE, DLCM and LSLM, seeded, single process."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conformance.families import _conceptmoe_config, _dlcm_config
from tests.test_train_command import make_workspace
from tests.workers.kill_worker import KILL_AT_ENV, STEP_SLEEP_ENV

REPO = Path(__file__).resolve().parents[1]
STEPS = 8


def _lslm_config():
    from hf_concept.modeling.configuration_lslm import LSLMConfig
    from tests.test_lslm_model import TINY

    return LSLMConfig(**TINY, update_schedule=2)


FAMILIES = {"conceptmoe": (_conceptmoe_config, 32), "dlcm": (_dlcm_config, 32), "lslm": (_lslm_config, 96)}


def _start(workspace: Path, family: str, out: Path, kill_at: str = "", *extra: str) -> subprocess.Popen:
    make_config, block_size = FAMILIES[family]
    config = workspace / f"{family}.json"
    if not config.exists():
        config.write_text(make_config().to_json_string())
    tokenizer = [] if family == "lslm" else ["--tokenizer", str(workspace / "tokenizer")]
    argv = [
        str(config), "--data", str(workspace / "corpus.txt"), *tokenizer, "--output-dir", str(out),
        "--block-size", str(block_size), "--per-device-train-batch-size", "2", "--learning-rate", "3e-3",
        "--max-steps", str(STEPS), "--save-steps", "2", "--logging-steps", "2", "--seed", "3", *extra,
    ]  # fmt: skip
    env = dict(os.environ, **{KILL_AT_ENV: kill_at, STEP_SLEEP_ENV: "0.4"})
    command = [sys.executable, "-m", "tests.workers.kill_worker", *argv]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(process: subprocess.Popen) -> int:
    _, stderr = process.communicate(timeout=300)
    if process.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(stderr.decode()[-3000:])
    return process.returncode


def _kill_when(process: subprocess.Popen, path: Path) -> None:
    """SIGKILL `process` as soon as `path` exists (while its later steps are running)."""
    deadline = time.monotonic() + 300
    while not path.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert process.poll() is None, "the run ended before the kill"
    process.send_signal(signal.SIGKILL)
    process.wait()


def _outcome(out: Path) -> tuple[str, float]:
    history = json.loads((out / "checkpoints" / "trainer_state.json").read_text())["log_history"]
    losses = [(entry["step"], entry["loss"]) for entry in history if "loss" in entry]
    assert losses[-1][0] == STEPS
    return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest(), losses[-1][1]


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_killed_runs_resume_to_the_uninterrupted_result(tmp_path, family):
    workspace = make_workspace(tmp_path / "workspace")
    reference = tmp_path / "reference"
    assert _finish(_start(workspace, family, reference)) == 0

    out = tmp_path / "out"
    checkpoints = out / "checkpoints"
    # 1. Killed while checkpoint-4 is written: only checkpoint-2 is complete.
    assert _finish(_start(workspace, family, out, "save:4")) == -signal.SIGKILL
    assert sorted(path.name for path in checkpoints.glob("checkpoint-*")) == ["checkpoint-2"]
    # 2. Resumed, and killed from outside once checkpoint-6 is in place (step 7 is running).
    process = _start(workspace, family, out, "", "--resume")
    _kill_when(process, checkpoints / "checkpoint-6")
    assert not (out / "model.safetensors").exists()
    # 3. Resumed, and killed while the final model is saved.
    assert _finish(_start(workspace, family, out, "final", "--resume")) == -signal.SIGKILL
    assert not (out / "config.json").exists()
    # 4. Resumed to the end.
    assert _finish(_start(workspace, family, out, "", "--resume")) == 0
    assert not list(checkpoints.glob(".staging-*")) and not (out / ".final-staging").exists()
    assert _outcome(out) == _outcome(reference)
