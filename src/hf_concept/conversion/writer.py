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
- Tensors are streamed: `ShardWriter` keeps at most one shard's tensors in memory. The shards, their
  names and the index are those `huggingface_hub.split_torch_state_dict_into_shards` (what
  `save_pretrained` uses) gives for the same tensors in the same order: one shard is written as
  `model.safetensors`; several as `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`.
- The config and its remote code are written as `save_pretrained` writes them for classes registered
  with `register_for_auto_class`: through transformers' `custom_object_save`.

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
from huggingface_hub import constants
from huggingface_hub.serialization import split_state_dict_into_shards_factory
from huggingface_hub.serialization._base import parse_size_to_int
from safetensors.torch import save_file

from hf_concept.progress import progress_bar
from hf_concept.staging import staged

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
# huggingface_hub's size parser knows the decimal units only (KB, MB, GB, TB).
_BINARY_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
# Marks the staging and retired folders this module makes, so that leftovers of a killed process can be
# told apart from anything else and removed safely.
MARKER = ".hf-concept-writer.json"
_WRITER = __name__
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-.+$")

logger = logging.getLogger(__name__)


def parse_size(size: int | str) -> int:
    """Bytes in `size`: a positive int, or a string as `save_pretrained(max_shard_size=...)` takes it
    ("2GB", "500MB", "1.5GB": huggingface_hub's `parse_size_to_int`), in binary units ("1GiB",
    "512MiB"), or a plain byte count ("1000", "1000B")."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size={size!r} must be positive")
        return size
    value = 0
    if isinstance(size, str):
        with contextlib.suppress(ValueError, OverflowError):
            value = _size_in_bytes(size)
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r} must be a positive size such as '2GB', '500MB' or '1GiB'")
    return value


def _size_in_bytes(size: str) -> int:
    text = size.strip()
    if text.upper().removesuffix("B").isdigit():
        return int(text.upper().removesuffix("B"))
    unit = text[-3:].upper()
    if unit in _BINARY_UNITS:
        return int(float(text[:-3]) * _BINARY_UNITS[unit])
    return parse_size_to_int(text)


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
    try:
        with staged(dst, staging / dst.name, aside=_retired_folder) as folder:
            folder.mkdir()
            yield folder
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for parent in made_parents:
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise
    shutil.rmtree(staging, ignore_errors=True)


def _retired_folder(dst: Path) -> Path:
    """Where an old `dst` waits while the new one is renamed in: marked, so a kill's leftover is known."""
    return _marked_folder(dst.parent, dst.name, "old")


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
        if process_alive(owner["pid"]):
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


def process_alive(pid: int) -> bool:
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
    """Writes named tensors, as they come, into safetensors shards of at most `max_shard_size` bytes
    (a single tensor larger than the limit gets a shard of its own).

    huggingface_hub's `split_torch_state_dict_into_shards` plans shards for a whole state dict; a
    conversion would have to hold every converted tensor in memory to hand it one. This writer keeps
    at most one shard's tensors (plus the tensor being added) and applies the planner's rule as the
    tensors arrive: a tensor over the limit is written to a shard of its own at once; any other closes
    the open shard first when it would push it past the limit. `finish` then runs the planner on the
    names and sizes seen, and the shard file names and the index are the planner's.
    """

    def __init__(self, folder: str | Path, max_shard_size: int | str = "2GB") -> None:
        self.folder = Path(folder)
        self.max_bytes = parse_size(max_shard_size)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []
        # Every tensor's size in bytes, in the order added: what the planner is run on.
        self.sizes: dict[str, int] = {}

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes.values())

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.sizes:
            raise ValueError(f"tensor name {name!r} was written twice")
        size = _tensor_bytes(tensor)
        if size <= self.max_bytes and self.pending_bytes + size > self.max_bytes:
            self.flush()
        # A private contiguous copy: safetensors refuses views that share storage (split expert tensors).
        copy = tensor.detach().to("cpu", copy=True).contiguous()
        self.sizes[name] = size
        if size > self.max_bytes:
            self._write_shard({name: copy})
            return
        self.pending[name] = copy
        self.pending_bytes += size

    def flush(self) -> None:
        if self.pending:
            self._write_shard(self.pending)
        self.pending, self.pending_bytes = {}, 0

    def _write_shard(self, tensors: dict[str, torch.Tensor]) -> None:
        path = self.folder / f".shard-{len(self.written):05d}.safetensors"
        save_file(tensors, str(path), metadata={"format": "pt"})
        self.written.append((path, list(tensors)))

    def finish(self) -> list[Path]:
        """Flush, give the shards their final names, write the index when there are several."""
        self.flush()
        if not self.written:
            raise ValueError("no tensors were written")
        plan = split_state_dict_into_shards_factory(
            self.sizes,
            get_storage_size=lambda size: size,
            filename_pattern=constants.SAFETENSORS_WEIGHTS_FILE_PATTERN,
            max_shard_size=self.max_bytes,
        )
        if list(plan.filename_to_tensors.values()) != [names for _, names in self.written]:
            raise RuntimeError("the shards written differ from huggingface_hub's plan for the same tensors")
        finals = []
        for (path, _), file_name in zip(self.written, plan.filename_to_tensors, strict=True):
            os.replace(path, self.folder / file_name)
            finals.append(self.folder / file_name)
        if plan.is_sharded:
            index = {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename}
            # The layout save_pretrained writes; from_pretrained reads only the weight map.
            text = json.dumps(index, indent=2, sort_keys=True) + "\n"
            (self.folder / constants.SAFETENSORS_INDEX_FILE).write_text(text)
        return finals


def write_tensors(
    folder: Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    max_shard_size: int | str = "2GB",
    total: int | None = None,
    description: str = "writing tensors",
) -> list[Path]:
    """Stream (name, tensor) pairs into shards under `folder`, with a progress bar over tensors."""
    writer = ShardWriter(folder, max_shard_size)
    with progress_bar(total=total, desc=description, unit="tensor") as progress:
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
    {"AutoModel": XModel, "AutoModelForCausalLM": XForCausalLM}) and copy the code it needs, flat.

    This is what `save_pretrained` does for classes registered with `register_for_auto_class`, through
    transformers' `custom_object_save`: it copies the module defining an object and, transitively,
    every sibling module imported with `from .x import`, and records the object's class in `auto_map`.
    The config goes through it as `config.save_pretrained` sends it. A streaming conversion never
    builds the model (that would hold all its weights in memory), so there is no model object to save:
    `custom_object_save` copies each model class's module (given no config it reads only the module of
    what it is given, a class as well as an instance), and the model classes' `auto_map` entries are
    written here, in the same "<module>.<Class>" form."""
    from transformers.dynamic_module_utils import custom_object_save

    if getattr(config, "_auto_class", None) != "AutoConfig":
        name = type(config).__name__
        raise ValueError(f"{name} is not registered for AutoConfig: call {name}.register_for_auto_class()")
    # Only the entries written here: a stale entry would name a module that is not copied.
    config.auto_map = {}
    custom_object_save(config, folder, config=config)
    for auto_class, cls in model_classes.items():
        custom_object_save(cls, folder)
        config.auto_map[auto_class] = f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"
    # Every field, not only those that differ from today's defaults (save_pretrained writes the
    # difference): a checkpoint must not change meaning when a default does.
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
