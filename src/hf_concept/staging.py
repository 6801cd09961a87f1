"""Write a file or a folder whole or not at all: into a staging path beside it, renamed into place at the end.

`staged(path)` yields the staging path (`.<name>.partial` beside `path` unless the caller names another);
the block writes there. When the block ends normally the staging path is renamed to `path` with
`os.replace`, which is atomic within one filesystem, so a reader (or a kill) sees the old `path` or the new
one, never a half-written one. When the block raises, the staging path is removed and `path` is left as
it was.

Replacing a folder: a rename cannot replace a non-empty folder, so with `aside` the old folder is first
moved into a new hidden folder that `aside(path)` makes, the new one renamed in, and the old one deleted
(moved back if the rename fails). Without `aside` such a rename fails with OSError, which tells a caller
that another process finished the same folder first. An empty folder at `path` is always replaced.

`durable=True` also fsyncs the staged file before the rename and the parent folder after it, so that the
new contents survive a power loss as well as a kill.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def staged(
    path: str | Path,
    staging: str | Path | None = None,
    *,
    aside: Callable[[Path], Path] | None = None,
    durable: bool = False,
) -> Iterator[Path]:
    """Yield the staging path of `path`; rename it to `path` when the block succeeds, remove it when
    the block (or the rename) fails. See the module docstring for `aside` and `durable`."""
    path = Path(path)
    staging = path.with_name(f".{path.name}.partial") if staging is None else Path(staging)
    try:
        yield staging
        move_into_place(staging, path, aside=aside, durable=durable)
    except BaseException:
        remove_path(staging)
        raise


def move_into_place(
    staging: Path, path: Path, *, aside: Callable[[Path], Path] | None = None, durable: bool = False
) -> None:
    """Rename the complete `staging` to `path` (what `staged` does when its block succeeds)."""
    if durable:
        _fsync(staging)
    if staging.is_dir() and path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
        path.rmdir()
    if aside is None or not os.path.lexists(path):
        os.replace(staging, path)
    else:
        _swap(staging, path, aside(path))
    if durable:
        _fsync(path.parent)


def aside_folder(path: Path) -> Path:
    """A new hidden folder `.<name>.old-XXXX` beside `path`, to hold the old `path` while it is replaced."""
    return Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))


def _swap(staging: Path, path: Path, holder: Path) -> None:
    """Move the old `path` into `holder`, `staging` to `path`, then delete `holder` (the old one goes
    back first if the second rename fails)."""
    retired = holder / path.name
    try:
        os.replace(path, retired)
    except BaseException:
        shutil.rmtree(holder, ignore_errors=True)
        raise
    try:
        os.replace(staging, path)
    except BaseException:
        # Should this rename fail too, `holder` keeps the only copy of the old folder: it is not deleted.
        os.replace(retired, path)
        shutil.rmtree(holder, ignore_errors=True)
        raise
    shutil.rmtree(holder, ignore_errors=True)


def remove_path(path: Path) -> None:
    """Remove `path`, a file, a link or a folder, if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    # A file's contents, or a folder's entries, are durable only once fsynced (the rename needs both).
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
