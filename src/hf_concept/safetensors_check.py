"""Whether a safetensors file is whole: the one check behind checkpoints (train, push) and conversion sources.

`safetensors.safe_open` decides: it refuses a file cut short or padded, a header that is not one, and
offsets that do not cover the data exactly, without reading the tensors. Only when it refuses is the header
read here, as far as its length field reaches (never beyond safetensors' own 100 MB limit), to say what is
wrong in words a caller can print: the length field, the header itself, or the file's size against the one
the header needs.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# safetensors refuses headers above 100 MB; a larger length field means the file is not one.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class SafetensorsDefect:
    """Why a file is not a whole safetensors file.

    `kind` is "length" (the 8-byte header length does not fit the file), "header" (the header is not a
    valid safetensors header) or "size" (the file has `size` bytes where its header needs `expected`);
    `detail` is the reason as "ErrorName: message" for the first two."""

    kind: str
    detail: str = ""
    size: int = 0
    expected: int = 0


def safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(header length, header) of the safetensors file `path`, reading at most the header; ValueError
    saying what is wrong when the length field or the JSON is not a header's, OSError when unreadable."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{size} bytes, too short for a header")
        (header_length,) = struct.unpack("<Q", prefix)
        if header_length > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"header length field {header_length} does not fit a file of {size} bytes")
        header = json.loads(handle.read(header_length))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header_length, header


def safetensors_defect(path: Path) -> SafetensorsDefect | None:
    """What keeps `path` from being a whole safetensors file, None when `safe_open` takes it; OSError
    when the file cannot be read at all."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            return None
    except SafetensorError as refusal:
        return _describe(Path(path), refusal)


def _length_fits(path: Path) -> bool:
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
    return len(prefix) == 8 and 0 < struct.unpack("<Q", prefix)[0] <= min(MAX_HEADER_BYTES, size - 8)


def _describe(path: Path, refusal: Exception) -> SafetensorsDefect:
    """The defect of a file `safe_open` refused, told from its header."""
    try:
        header_length, header = safetensors_header(path)
        ends = [int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError) as error:
        kind = "header" if _length_fits(path) else "length"
        return SafetensorsDefect(kind, f"{type(error).__name__}: {error}")
    expected = 8 + header_length + max(ends, default=0)
    size = path.stat().st_size
    if size != expected:
        return SafetensorsDefect("size", size=size, expected=expected)
    # Sizes agree, yet safetensors refuses it (overlapping offsets, a shape that does not match its bytes).
    return SafetensorsDefect("header", f"{type(refusal).__name__}: {refusal}")
