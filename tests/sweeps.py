"""Shared step of the reproductions' kill-and-resume tests: start a sweep, SIGKILL it at its first
checkpoint."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path


def kill_at_first_checkpoint(command: list[str], folder: Path, timeout: float = 300) -> None:
    """Run `command` (a sweep writing into `folder`) and SIGKILL it as soon as a checkpoint file exists
    (or it exits, or `timeout` seconds pass); assert it was killed before any run finished."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while (
        not list(folder.glob("checkpoints/*.json")) and process.poll() is None and time.monotonic() < deadline
    ):
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL and not (folder / "results.jsonl").exists()
