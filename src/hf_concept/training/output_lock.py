"""One `train` run per output folder: an exclusive lock held for the whole run.

- The lock is `hf_concept.locking.try_lock` (filelock's OS lock, `flock` on Unix) on
  `OUTPUT/.hf-concept-train.lock`. The kernel drops it when the holding process ends, however it ends (a
  SIGKILL included), so a lock left by a dead run never blocks the next one. The lock file itself stays
  (filelock keeps it so that waiters share one inode); holding the lock, not the file's existence, is what
  counts.
- Who holds it (pid, host, start time) is written beside it, `.hf-concept-train.holder.json`, replaced
  atomically; a second run is refused at once with one line naming that holder. The holder file is
  removed when the run ends.
- Both files are hidden: the "folder not empty" check ignores them (`LOCK_FILES`), `push` skips hidden
  files, and the saved model is published from its own staging folder, so neither ends up in a model.
- A folder the run created is removed again when the run fails before training starts (nothing in it
  but the lock and what Trainer made when it was built); once training started, checkpoints are kept.
- Only the main process of a multi-process run (RANK 0) takes the lock; the other ranks write into the
  folder under it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from hf_concept.locking import try_lock
from hf_concept.staging import staged
from hf_concept.training.errors import (
    TrainSetupError,
    failed_write_line,
    write_failure_cause,
    write_failure_hint,
)

LOCK_NAME = ".hf-concept-train.lock"
HOLDER_NAME = ".hf-concept-train.holder.json"
LOCK_FILES = frozenset({LOCK_NAME, HOLDER_NAME})
# Every name the lock uses starts so (the holder record is written under a temporary name first).
LOCK_PREFIX = ".hf-concept-train."
# How long a refused run waits for the holder to finish writing who it is (it does so right after locking).
HOLDER_WAIT_S = 1.0


@dataclass
class OutputSession:
    """The locked output folder of a run: whether the run made it, and whether training has started."""

    path: Path
    created: bool
    started: bool = False


def folder_entries(folder: Path) -> list[Path]:
    """The entries of `folder` other than the lock's files (what "not empty" means for an output folder)."""
    return [entry for entry in folder.iterdir() if not entry.name.startswith(LOCK_PREFIX)]


def holder_of(folder: str | Path) -> dict | None:
    """The live holder recorded in `folder` ({"pid", "host", "started"}), None when none is recorded.
    A record of a process that is gone (on this host) is stale and not returned."""
    from hf_concept.conversion.writer import process_alive

    try:
        holder = json.loads((Path(folder) / HOLDER_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int):
        return None
    if holder.get("host") == socket.gethostname() and not process_alive(holder["pid"]):
        return None
    return holder


def _describe_holder(folder: Path) -> str:
    deadline = time.monotonic() + HOLDER_WAIT_S
    holder = holder_of(folder)
    while holder is None and time.monotonic() < deadline:
        time.sleep(0.05)
        holder = holder_of(folder)
    if holder is None:
        return "a process that has not yet said who it is"
    return f"pid {holder['pid']} on host {holder.get('host', '?')}, started {holder.get('started', '?')}"


def _write_holder(folder: Path) -> None:
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }
    # A refused run reads the holder file at any moment: it sees the whole record or none.
    with staged(folder / HOLDER_NAME, folder / f"{HOLDER_NAME}.tmp-{os.getpid()}") as partial:
        partial.write_text(json.dumps(record))


def _not_writable(out: Path, error: OSError) -> TrainSetupError:
    line = failed_write_line(error, out, "--output-dir")
    cause, hint = write_failure_cause(error, out), write_failure_hint(error, "--output-dir")
    return TrainSetupError(line or f"cannot write --output-dir={str(out)!r} ({cause}): {hint}")


def _remove_created(out: Path, made_parents: list[Path]) -> None:
    shutil.rmtree(out, ignore_errors=True)
    for parent in made_parents:
        with contextlib.suppress(OSError):
            parent.rmdir()


@contextlib.contextmanager
def lock_output_dir(output_dir: str | Path, main_process: bool = True) -> Iterator[OutputSession]:
    """Hold the exclusive lock on `output_dir` (made if absent) for the `with` block; raise
    `TrainSetupError` naming the holder when another run has it, or when the folder cannot be written."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise TrainSetupError(f"output_dir={str(out)!r} exists and is not a folder")
    session = OutputSession(out, created=not out.exists())
    if not main_process:
        yield session
        return
    made_parents = [parent for parent in out.parents if not parent.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = try_lock(out / LOCK_NAME)
    except OSError as error:
        if session.created:
            _remove_created(out, made_parents)
        raise _not_writable(out, error) from None
    if lock is None:
        raise TrainSetupError(
            f"output_dir={str(out)!r} is in use by another hf-concept train run ({_describe_holder(out)}): "
            "wait for it to finish, or choose another --output-dir"
        )
    try:
        try:
            _write_holder(out)
        except OSError as error:
            raise _not_writable(out, error) from None
        yield session
    except BaseException:
        if session.created and not session.started:
            _remove_created(out, made_parents)
        raise
    finally:
        with contextlib.suppress(OSError):
            (out / HOLDER_NAME).unlink(missing_ok=True)
        lock.release()
