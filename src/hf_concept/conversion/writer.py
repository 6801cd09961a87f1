"""Write a converted checkpoint atomically: shards, index, config with remote code, side files.

Contract:
- Everything is written into `.<name>.tmp-XXXX/<name>`, inside a hidden temporary sibling of the
  destination, and renamed to the destination only once complete. Any error (or interrupt) removes the
  temporary folder and leaves the destination untouched; nothing that looks like a checkpoint is left
  behind.
- An existing non-empty destination is refused (ValueError naming it) before anything is written,
  unless `overwrite=True`; then the old folder is replaced only after the new one is complete (it is
  moved into `.<name>.old-XXXX/<name>` first and deleted once the new one is in place).
- A destination that is the source, contains it or lies inside it is refused (ValueError naming both)
  before anything is touched, with or without `overwrite` (symlinks resolved, folders compared by
  identity).
- A hard kill (SIGKILL, power loss) can leave a `.tmp-`/`.old-` folder behind. Each holds a marker
  (`.hf-concept-writer.json`: writer, pid, host, destination name); the next `atomic_folder` in the same
  parent removes those whose process is gone on this host. Live processes' folders, other hosts'
  folders, unmarked look-alikes and symlinks are never touched; an `.old-` folder whose destination is
  missing (killed between the two renames) holds the only copy of the old checkpoint and is only
  reported.
- Tensors are streamed: `ShardWriter` keeps at most one shard's tensors in memory and flushes a shard
  when the next tensor would push it past `max_shard_size`. One shard is written as
  `model.safetensors`; several as `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`.

Nothing here knows a model family: the ConceptMoE and Hidden Decoding converters both use it.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

# Files a tokenizer or a generation setup may consist of; whichever exist in the source are copied.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
SIDE_FOLDERS = ("additional_chat_templates",)
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_SIZE = re.compile(r"^\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[KMGT]?I?B?)\s*$", re.IGNORECASE)
# Marks the staging and retired folders this module makes, so that leftovers of a killed process can be
# told apart from anything else and removed safely.
MARKER = ".hf-concept-writer.json"
_WRITER = __name__
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-.+$")

logger = logging.getLogger(__name__)


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or a string such as "2GB", "500MB", "40KB", "1GiB"."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size={size!r} must be positive")
        return size
    match = _SIZE.match(size) if isinstance(size, str) else None
    if match is None or float(match["number"]) <= 0:
        raise ValueError(f"max_shard_size={size!r} must be a positive size such as '2GB' or '500MB'")
    return int(float(match["number"]) * _SIZE_UNITS[match["unit"].upper()])


def check_destination(dst: str | Path, overwrite: bool, source: str | Path | None = None) -> Path:
    """The destination as a Path; ValueError when it is the `source` folder, contains it or lies inside
    it, when it is a file, or when it is a non-empty folder without overwrite."""
    dst = Path(dst)
    if source is not None:
        check_apart(Path(source), dst)
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"dst={str(dst)!r} exists and is not a folder")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise ValueError(f"dst={str(dst)!r} exists and is not empty; pass overwrite=True to replace it")
    return dst


def check_apart(src: Path, dst: Path) -> None:
    """ValueError naming both paths when writing `dst` would replace, delete or add to `src`."""
    if _within(src, dst):
        relation = "is" if _within(dst, src) else "contains"
    elif _within(dst, src):
        relation = "lies inside"
    else:
        return
    raise ValueError(
        f"dst={str(dst)!r} {relation} the source src={str(src)!r} (resolved: {dst.resolve()} and "
        f"{src.resolve()}); writing there would modify or delete the source, even with overwrite=True: "
        "choose a destination outside it"
    )


def _within(inner: Path, outer: Path) -> bool:
    """Whether `inner` is `outer` or lies inside it: symlinks resolved, and existing folders compared by
    identity, so that bind mounts and case-insensitive names are caught too."""
    inner, outer = inner.resolve(), outer.resolve()
    if inner == outer or outer in inner.parents:
        return True
    if not outer.exists():
        return False
    return any(path.exists() and os.path.samefile(path, outer) for path in (inner, *inner.parents))


@contextlib.contextmanager
def atomic_folder(
    dst: str | Path, overwrite: bool = False, source: str | Path | None = None
) -> Iterator[Path]:
    """Yield an empty folder inside a hidden temporary sibling of `dst`; on success it becomes `dst`, on
    any error it is removed. `source`, when given, is a folder that `dst` must stay apart from."""
    dst = check_destination(dst, overwrite, source).absolute()
    # Parent folders made here are removed again on failure (innermost first), if still empty.
    made_parents = [parent for parent in dst.parents if not parent.exists()]
    dst.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_folders(dst.parent)
    staging = _marked_folder(dst.parent, dst.name, "tmp")
    folder = staging / dst.name
    try:
        folder.mkdir()
        yield folder
        _replace(folder, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for parent in made_parents:
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise
    shutil.rmtree(staging, ignore_errors=True)


def _replace(folder: Path, dst: Path) -> None:
    """Move the complete `folder` to `dst`, replacing an old `dst` only after the move."""
    if dst.is_dir() and not dst.is_symlink() and not any(dst.iterdir()):
        dst.rmdir()
    if not dst.exists():
        os.replace(folder, dst)
        return
    retired = _marked_folder(dst.parent, dst.name, "old")
    os.replace(dst, retired / dst.name)
    try:
        os.replace(folder, dst)
    except BaseException:
        os.replace(retired / dst.name, dst)
        shutil.rmtree(retired, ignore_errors=True)
        raise
    shutil.rmtree(retired, ignore_errors=True)


def _marked_folder(parent: Path, name: str, kind: str) -> Path:
    """A new hidden folder `.<name>.<kind>-XXXX` in `parent`, marked as this process's."""
    folder = Path(tempfile.mkdtemp(prefix=f".{name}.{kind}-", dir=parent))
    owner = {"writer": _WRITER, "pid": os.getpid(), "host": socket.gethostname(), "destination": name}
    try:
        (folder / MARKER).write_text(json.dumps(owner))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def remove_stale_folders(parent: str | Path) -> list[Path]:
    """Remove the staging and retired folders in `parent` that a process on this host, now dead, left
    behind (see the module contract for what is kept); returns the folders removed."""
    parent = Path(parent)
    removed = []
    for folder in sorted(parent.iterdir()):
        match = _LEFTOVER.match(folder.name)
        owner = _owner(folder) if match else None
        if owner is None or owner["destination"] != match["name"] or owner["host"] != socket.gethostname():
            continue
        if _process_alive(owner["pid"]):
            continue
        if match["kind"] == "old" and not (parent / owner["destination"]).exists():
            logger.warning(
                "kept %s: process %d that made it is no longer running, and it holds the only copy "
                "of %s; move %s back by hand",
                folder,
                owner["pid"],
                parent / owner["destination"],
                folder / owner["destination"],
            )
            continue
        shutil.rmtree(folder, ignore_errors=True)
        logger.warning(
            "removed %s, left behind by process %d, which is no longer running", folder, owner["pid"]
        )
        removed.append(folder)
    return removed


def _owner(folder: Path) -> dict | None:
    """The marker of a folder this module made; None for anything else (symlinks included)."""
    if folder.is_symlink() or not folder.is_dir():
        return None
    try:
        owner = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(owner, dict) or owner.get("writer") != _WRITER:
        return None
    pid, host, name = owner.get("pid"), owner.get("host"), owner.get("destination")
    if not (isinstance(pid, int) and pid > 0 and isinstance(host, str) and isinstance(name, str)):
        return None
    return owner


def _process_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host; True whenever that cannot be told."""
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class ShardWriter:
    """Accumulates named tensors and writes safetensors shards of at most `max_shard_size` bytes
    (a single tensor larger than the limit gets a shard of its own)."""

    def __init__(self, folder: str | Path, max_shard_size: int | str = "2GB") -> None:
        self.folder = Path(folder)
        self.max_bytes = parse_size(max_shard_size)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0
        self.names: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.names:
            raise ValueError(f"tensor name {name!r} was written twice")
        size = _tensor_bytes(tensor)
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        # A private contiguous copy: safetensors refuses views that share storage (split expert tensors).
        self.pending[name] = tensor.detach().to("cpu", copy=True).contiguous()
        self.pending_bytes += size
        self.total_bytes += size
        self.names.add(name)

    def flush(self) -> None:
        if not self.pending:
            return
        path = self.folder / f".shard-{len(self.written):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[Path]:
        """Flush, give the shards their final names, write the index when there are several."""
        self.flush()
        if not self.written:
            raise ValueError("no tensors were written")
        count = len(self.written)
        if count == 1:
            final = self.folder / "model.safetensors"
            os.replace(self.written[0][0], final)
            return [final]
        weight_map: dict[str, str] = {}
        finals = []
        for index, (path, names) in enumerate(self.written, start=1):
            final = self.folder / f"model-{index:05d}-of-{count:05d}.safetensors"
            os.replace(path, final)
            finals.append(final)
            weight_map.update(dict.fromkeys(names, final.name))
        index_data = {
            "metadata": {"total_size": self.total_bytes},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index_data, indent=2) + "\n")
        return finals


def write_tensors(
    folder: Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    max_shard_size: int | str = "2GB",
    total: int | None = None,
    description: str = "writing tensors",
) -> list[Path]:
    """Stream (name, tensor) pairs into shards under `folder`, with a progress bar over tensors."""
    from tqdm.auto import tqdm

    writer = ShardWriter(folder, max_shard_size)
    with tqdm(total=total, desc=description, unit="tensor") as progress:
        for name, tensor in tensors:
            writer.add(name, tensor)
            progress.update()
    return writer.finish()


def remote_code_files(*classes: type) -> list[Path]:
    """The source files defining `classes` plus every sibling they import with `from .x import y`."""
    from transformers.dynamic_module_utils import get_relative_import_files

    files: dict[Path, None] = {}
    for cls in classes:
        module_file = Path(inspect.getfile(cls))
        files[module_file] = None
        files.update(dict.fromkeys(Path(path) for path in get_relative_import_files(str(module_file))))
    return list(files)


def write_config_with_remote_code(folder: Path, config, model_classes: dict[str, type]) -> None:
    """Write config.json with `auto_map` (AutoConfig plus each auto class in `model_classes`, e.g.
    {"AutoModel": XModel, "AutoModelForCausalLM": XForCausalLM}) and copy the code it needs, flat."""
    auto_map = {"AutoConfig": f"{Path(inspect.getfile(type(config))).stem}.{type(config).__name__}"}
    for auto_class, cls in model_classes.items():
        auto_map[auto_class] = f"{Path(inspect.getfile(cls)).stem}.{cls.__name__}"
    for path in remote_code_files(type(config), *model_classes.values()):
        shutil.copyfile(path, folder / path.name)
    config.auto_map = auto_map
    # Every field, not only those that differ from today's defaults: a checkpoint must not change
    # meaning when a default does.
    config.to_json_file(str(folder / "config.json"), use_diff=False)


def copy_side_files(source: Path, folder: Path) -> list[str]:
    """Copy the tokenizer and generation files that exist in `source`; returns the names copied."""
    copied = []
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, folder / name)
            copied.append(name)
    for name in SIDE_FOLDERS:
        if (source / name).is_dir():
            shutil.copytree(source / name, folder / name)
            copied.append(name)
    return copied
