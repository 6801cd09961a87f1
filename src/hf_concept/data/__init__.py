"""Small bundled text samples for byte-level language-model evaluation (see README.md and LICENSE.md here).

Files: `en.txt` (English), `zh.txt` (Chinese), `ja.txt` (Japanese); UTF-8, one paragraph or dialogue turn
per line, written for this project.

Split rule (fixed, so held-out figures are comparable across runs and models): with N the file's size in
UTF-8 bytes, the held-out part starts at the first line start at or after byte ⌊0.8·N⌋, i.e. just after the
first newline at or after that byte. `train` is everything before, `heldout` everything from there on, so
the two are disjoint, `train + heldout == all`, and neither cuts a line (nor, therefore, a character).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

LANGUAGES = ("en", "zh", "ja")
SPLITS = ("train", "heldout", "all")
HELDOUT_FRACTION = 0.2


@cache
def _file_bytes(language: str) -> bytes:
    if language not in LANGUAGES:
        raise ValueError(f"language={language!r} is not bundled; choose one of {list(LANGUAGES)}")
    name = f"{language}.txt"
    data = resources.files(__name__).joinpath(name).read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{name} is not valid UTF-8 at byte {error.start}: {error.reason}") from None
    return data


def heldout_offset(language: str) -> int:
    """Byte offset in `{language}.txt` where the held-out split starts (see the module docstring)."""
    data = _file_bytes(language)
    newline = data.find(b"\n", int(len(data) * (1 - HELDOUT_FRACTION)))
    if newline == -1 or newline + 1 == len(data):
        raise ValueError(
            f"{language}.txt has no line break in its last {HELDOUT_FRACTION:.0%}: cannot split it"
        )
    return newline + 1


def load_text(language: str, split: str = "train") -> str:
    """The bundled `language` text ("en", "zh" or "ja"): its "train", "heldout" or "all" split."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {list(SPLITS)}")
    data = _file_bytes(language)
    if split == "all":
        return data.decode("utf-8")
    offset = heldout_offset(language)
    return (data[:offset] if split == "train" else data[offset:]).decode("utf-8")
