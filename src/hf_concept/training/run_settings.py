"""The settings a checkpoint was trained with, recorded in it, and compared when a run resumes from it.

Trainer resumes a run by skipping the batches its checkpoint has already seen, and the learning-rate
schedule and `max_steps` count optimizer steps: both mean the same only with the same data, per-device
batch size, gradient accumulation steps and number of processes. Trainer resumes under any other ones
without a word, so every checkpoint holds `run_settings.json` (`SETTINGS_NAME`): the data's fingerprint
(`data_fingerprint`: of the contents, not the names, so moved or copied data still resumes) with the paths
as given (for the message only), `per_device_train_batch_size`, `gradient_accumulation_steps` and
`world_size` (Trainer's processes). `SafeCheckpointsMixin` writes it into the checkpoint's staging folder,
so it appears in the same rename as the rest of the checkpoint; a run continued with other settings
records its own in the checkpoints it writes.

`check_run_settings` refuses a resume where one of them differs, with one line naming each change
(old -> new), unless `--resume-changed-settings`, which continues and names each change in a warning. A
checkpoint written before settings were recorded resumes as before, with one warning saying so.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf_concept.staging import staged
from hf_concept.training.errors import TrainSetupError

logger = logging.getLogger("hf_concept.train")

SETTINGS_NAME = "run_settings.json"
SETTINGS_FORMAT = 1
COMPARED = ("data_fingerprint", "per_device_train_batch_size", "gradient_accumulation_steps", "world_size")
# Choice for speed: a file up to FULL_HASH_BYTES is hashed whole (read in CHUNK_BYTES pieces); a larger
# one by its size and its first and last SAMPLE_BYTES, so that starting a run on a large corpus costs two
# small reads, not a pass over it. The price: an edit inside a large file that keeps its size and both
# ends goes unnoticed.
FULL_HASH_BYTES = 64 * 2**20
SAMPLE_BYTES = 2**20
CHUNK_BYTES = 2**20
# Hex digits of a fingerprint a message shows (the file keeps all of them).
SHOWN_DIGITS = 12


def _hash_file(path: Path, digest: Any) -> None:
    size = path.stat().st_size
    digest.update(f"{size}\n".encode())
    with path.open("rb") as handle:
        if size <= FULL_HASH_BYTES:
            while chunk := handle.read(CHUNK_BYTES):
                digest.update(chunk)
            return
        digest.update(handle.read(SAMPLE_BYTES))
        handle.seek(size - SAMPLE_BYTES)
        digest.update(handle.read(SAMPLE_BYTES))


def _folder_files(folder: Path) -> list[Path]:
    """The files of a `save_to_disk` folder that hold its data, in a fixed order. Hidden files and the
    `cache-*.arrow` files a `datasets` map without a cache file name writes beside the data are left out:
    they come and go without the dataset changing."""
    files = []
    for path in sorted(folder.rglob("*")):
        parts = path.relative_to(folder).parts
        hidden = any(part.startswith(".") for part in parts)
        if path.is_file() and not hidden and not (path.name.startswith("cache-") and path.suffix == ".arrow"):
            files.append(path)
    return files


def data_fingerprint(paths: Sequence[str | Path]) -> str:
    """A sha256 hex digest of the contents of the data files and `save_to_disk` folders in `paths`, in
    their order (the order of the training documents); a path that is neither counts by its name."""
    digest = hashlib.sha256()
    for path in map(Path, paths):
        if path.is_file():
            digest.update(b"file\n")
            _hash_file(path, digest)
        elif path.is_dir():
            for file in _folder_files(path):
                digest.update(f"folder file {file.relative_to(path).as_posix()}\n".encode())
                _hash_file(file, digest)
        else:
            digest.update(f"name {path}\n".encode())
    return digest.hexdigest()


def current_settings(
    data: str | Path | Sequence[str | Path], args: Any, distill_from: str | Path | None = None
) -> dict[str, Any]:
    """The settings of this run that a checkpoint records; `args` are its `TrainingArguments`,
    `distill_from` the source that teaches it (`--distill-from`)."""
    paths = [data] if isinstance(data, (str, Path)) else list(data)
    return {
        "distill_from": None if distill_from is None else str(distill_from),
        "format": SETTINGS_FORMAT,
        "data": [str(path) for path in paths],
        "data_fingerprint": data_fingerprint(paths),
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "world_size": args.world_size,
    }


def write_run_settings(folder: Path, settings: dict[str, Any]) -> None:
    """`settings` as `folder/run_settings.json`, through a temporary file renamed into place: a reader
    sees the whole record or none."""
    with staged(folder / SETTINGS_NAME, folder / f".{SETTINGS_NAME}.tmp-{os.getpid()}") as partial:
        partial.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")


def read_run_settings(checkpoint: Path) -> tuple[dict[str, Any] | None, str]:
    """(the settings `checkpoint` records, "") or (None, why there are none)."""
    path = checkpoint / SETTINGS_NAME
    if not path.is_file():
        return None, f"it has no {SETTINGS_NAME}: it was written before runs recorded their settings"
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        return None, f"its {SETTINGS_NAME} is unreadable ({error})"
    if not isinstance(recorded, dict):
        return None, f"its {SETTINGS_NAME} is not a JSON object"
    return recorded, ""


def _shown(value: Any) -> str:
    return "unrecorded" if value is None else str(value)


def _short(fingerprint: Any) -> str:
    return f"{fingerprint[:SHOWN_DIGITS]}…" if isinstance(fingerprint, str) else _shown(fingerprint)


def _data_change(recorded: dict[str, Any], current: dict[str, Any]) -> str:
    old, new = (" ".join(map(str, settings.get("data") or [])) for settings in (recorded, current))
    where = f"--data {new}, its contents changed" if old == new else f"--data {old} -> {new}"
    before, after = (_short(settings.get("data_fingerprint")) for settings in (recorded, current))
    return f"data fingerprint {before} -> {after} ({where})"


def settings_changes(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One "name old -> new" per compared setting (`COMPARED`) where `current` differs from `recorded`."""
    changes = []
    for name in COMPARED:
        if recorded.get(name) == current[name]:
            continue
        if name == "data_fingerprint":
            changes.append(_data_change(recorded, current))
        else:
            changes.append(f"{name} {_shown(recorded.get(name))} -> {current[name]}")
    return changes


def _notice(message: str) -> None:
    # Every process checks (they must take the same decision); the main one speaks.
    if int(os.environ.get("RANK", "0")) == 0:
        logger.warning(message)


def check_run_settings(checkpoint: Path, current: dict[str, Any], allow_changes: bool) -> None:
    """Refuse to resume from `checkpoint` with settings other than those it records (one line naming
    each change), or with `allow_changes` name each in a warning and go on; a checkpoint that records
    none gets one warning that its settings could not be checked."""
    recorded, why = read_run_settings(checkpoint)
    if recorded is None:
        _notice(
            f"{checkpoint}: its settings could not be checked ({why}); resuming without comparing the data, "
            "batch size, gradient accumulation steps and world size"
        )
        return
    if recorded.get("distill_from") and not current.get("distill_from"):
        # Its loss had the teacher's terms: going on without them is another recipe, not a resume.
        raise TrainSetupError(
            f"{checkpoint} was written by a distilled run (--distill-from {recorded['distill_from']}): "
            "resume it with --distill-from SOURCE"
        )
    changes = settings_changes(recorded, current)
    if changes and not allow_changes:
        raise TrainSetupError(
            f"{checkpoint} was written by a run with other settings: {', '.join(changes)}: resume with the "
            "same settings, or pass --resume-changed-settings to continue anyway"
        )
    for change in changes:
        _notice(f"--resume-changed-settings: continuing from {checkpoint} with {change}")
