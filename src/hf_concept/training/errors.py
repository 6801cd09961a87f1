"""The errors `train` raises for problems a user can act on (the CLI prints each as one line), and the
one-line wording of a failed write that `train`, `convert` and `expand` share."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

# What torch and safetensors say when a write fails underneath them (a full disk, most often): torch's
# zip writer reports "unexpected pos" / "PytorchStreamWriter failed writing file", safetensors an IoError.
_WRITE_FAILURE_MARKERS = ("unexpected pos", "PytorchStreamWriter failed", "Error while serializing")
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


class TrainSetupError(ValueError):
    """A user input problem found before training starts (the CLI prints it as one line, exit status 2)."""


class TrainingDivergedError(RuntimeError):
    """Training produced a non-finite loss, gradient norm or weight; nothing non-finite was saved
    (the CLI prints it as one line, exit status 1)."""


class OutputWriteError(RuntimeError):
    """A file of the run could not be written (a full disk, a folder that is not writable); what was
    being written was removed again (the CLI prints it as one line, exit status 1)."""


def is_write_failure(error: BaseException) -> bool:
    """Whether `error` is a failed write: an OSError, or torch's / safetensors' wording of one."""
    if isinstance(error, OSError):
        return True
    # safetensors' SafetensorError derives from Exception only: the wording is what tells.
    return any(marker in str(error) for marker in _WRITE_FAILURE_MARKERS)


def write_failure_cause(error: BaseException, folder: str | Path) -> str:
    """The cause of a failed write into `folder` in a few words: "permission denied: /x/y", or for a full
    disk (and torch's or safetensors' wording of a failed write) the cause with the space left there."""
    if isinstance(error, OSError):
        cause = (error.strerror or str(error)).lower()
        if error.filename:
            cause += f": {error.filename}"
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            return cause
    else:
        text = str(error).strip()
        cause = f"the write failed ({text.splitlines()[0][:120] if text else type(error).__name__})"
    free = _free_mib(Path(folder))
    return cause if free is None else f"{cause}; {free} MiB free there"


def write_failure_hint(error: BaseException, flag: str) -> str:
    """What to do about a failed write into the folder given by `flag` (e.g. "--output-dir", "DST")."""
    if isinstance(error, OSError) and error.errno in _NOT_WRITABLE:
        return f"make that folder writable or choose a {flag} you can write to"
    if isinstance(error, OSError) and error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return f"check the disk that holds it or choose another {flag}"
    return f"free space on that disk or choose a {flag} on another one"


def _free_mib(folder: Path) -> int | None:
    """Free space on the disk holding `folder` (or its nearest existing parent), in MiB."""
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free // 2**20
            except OSError:
                return None
    return None


def failed_write_line(error: OSError, target: str | Path, flag: str) -> str | None:
    """One line for an OSError raised while writing the folder `target` that `flag` names (the folder,
    a file in it, a parent made for it, or a hidden staging sibling `.NAME.*` of it); None when the error
    names another file (a read, or nothing said)."""
    if not error.filename:
        return None
    target = Path(target).absolute()
    path = Path(os.fsdecode(error.filename)).absolute()
    staging = [parent for parent in (path, *path.parents) if parent.parent == target.parent]
    concerns = (
        path == target
        or target in path.parents
        or path in target.parents
        or any(parent.name.startswith(f".{target.name}.") for parent in staging)
    )
    if not concerns:
        return None
    return (
        f"cannot write {flag}={str(target)!r} ({write_failure_cause(error, target)}): "
        + write_failure_hint(error, flag)
    )
