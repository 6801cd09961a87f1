"""Write a converted checkpoint atomically: shards, index, config with remote code, side files.

Contract:
- Everything is written into a hidden temporary sibling of the destination (`.<name>.tmp-XXXX`) and
  renamed to the destination only once complete. Any error (or interrupt) removes the temporary folder
  and leaves the destination untouched; nothing that looks like a checkpoint is left behind.
- An existing non-empty destination is refused (ValueError naming it) before anything is written,
  unless `overwrite=True`; then the old folder is replaced only after the new one is complete.
- Tensors are streamed: `ShardWriter` keeps at most one shard's tensors in memory and flushes a shard
  when the next tensor would push it past `max_shard_size`. One shard is written as
  `model.safetensors`; several as `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`.

Nothing here knows a model family: the ConceptMoE and Hidden Decoding converters both use it.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import shutil
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


def check_destination(dst: str | Path, overwrite: bool) -> Path:
    """The destination as a Path; ValueError when it is a file, or a non-empty folder without overwrite."""
    dst = Path(dst)
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"dst={str(dst)!r} exists and is not a folder")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise ValueError(f"dst={str(dst)!r} exists and is not empty; pass overwrite=True to replace it")
    return dst


@contextlib.contextmanager
def atomic_folder(dst: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling folder of `dst`; on success it becomes `dst`, on any error it is removed."""
    dst = check_destination(dst, overwrite).absolute()
    # Parent folders made here are removed again on failure (innermost first), if still empty.
    made_parents = [parent for parent in dst.parents if not parent.exists()]
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        yield staging
        _replace(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for parent in made_parents:
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise


def _replace(staging: Path, dst: Path) -> None:
    """Move the complete `staging` folder to `dst`, replacing an old `dst` only after the move."""
    if not dst.exists():
        os.replace(staging, dst)
        return
    if not any(dst.iterdir()):
        dst.rmdir()
        os.replace(staging, dst)
        return
    retired = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
    retired.rmdir()
    os.replace(dst, retired)
    try:
        os.replace(staging, dst)
    except BaseException:
        os.replace(retired, dst)
        raise
    shutil.rmtree(retired, ignore_errors=True)


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
