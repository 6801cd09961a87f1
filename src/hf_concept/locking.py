"""The one lock mechanism of the tools: `filelock`'s OS lock (`flock` on Unix), taken without waiting.

The kernel drops such a lock when the holding process ends, however it ends (a SIGKILL included), so a
lock left by a dead process never blocks the next one; the lock file itself stays (filelock keeps it so
that contenders share one inode), and holding the lock, not the file's existence, is what counts.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from filelock import FileLock


def try_lock(path: str | Path) -> FileLock | None:
    """Take the exclusive lock on `path` (created if absent) at once: the held lock, released by its
    `release()` or when it is garbage-collected, or None when another process holds it. OSError when
    `path` cannot be created or opened."""
    from filelock import FileLock, Timeout

    lock = FileLock(path, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        return None
    return lock
