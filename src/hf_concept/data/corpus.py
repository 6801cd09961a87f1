"""The bundled training corpus: English prose, technical docs and code, plus the zh/ja samples.

Everything here ships with the package (see README.md and LICENSE.md in this folder), so the demo and the
tests train a tokenizer and small models with no download.

Files: `corpus/*.txt` (written for this project: English prose, Markdown docs, Python / JavaScript /
shell / SQL programs) and the byte-level samples `en.txt`, `zh.txt`, `ja.txt` of `hf_concept.data`.

Split rule (fixed, so validation figures are comparable across runs):
- `corpus/*.txt`: with N a file's size in UTF-8 bytes, validation starts at the first line start at or
  after byte ⌊(1 - VALIDATION_FRACTION)·N⌋; train is everything before it.
- `en/zh/ja.txt`: their own `train` / `heldout` splits (`hf_concept.data.load_text`), so that a model
  trained on this corpus never saw the text that bits-per-byte figures are measured on.
The two splits are disjoint, neither cuts a line, and every file contributes to both.
`corpus_text(split)` joins the documents of a split, in `corpus_documents` order, with one blank line.
"""

from __future__ import annotations

import hashlib
from functools import cache
from importlib import resources

from hf_concept.data import LANGUAGES, load_text

CORPUS_SPLITS = ("train", "validation")
VALIDATION_FRACTION = 0.1
CORPUS_FOLDER = "corpus"
SEPARATOR = "\n\n"


@cache
def corpus_files() -> tuple[str, ...]:
    """Names of the `corpus/*.txt` files, sorted (the order every split is joined in)."""
    folder = resources.files("hf_concept.data").joinpath(CORPUS_FOLDER)
    names = sorted(entry.name for entry in folder.iterdir() if entry.name.endswith(".txt"))
    if not names:
        raise FileNotFoundError(f"no corpus files found in {folder}: the package data is incomplete")
    return tuple(names)


@cache
def _corpus_file(name: str) -> str:
    data = resources.files("hf_concept.data").joinpath(CORPUS_FOLDER, name).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{CORPUS_FOLDER}/{name} is not valid UTF-8 at byte {error.start}") from None


def validation_offset(text: str) -> int:
    """Character offset in `text` where its validation part starts (the byte rule of the module doc)."""
    data = text.encode("utf-8")
    newline = data.find(b"\n", int(len(data) * (1 - VALIDATION_FRACTION)))
    if newline == -1 or newline + 1 == len(data):
        raise ValueError(f"no line break in the last {VALIDATION_FRACTION:.0%} of the text: cannot split it")
    return len(data[: newline + 1].decode("utf-8"))


def corpus_documents(split: str = "train") -> list[tuple[str, str]]:
    """(name, text) of every piece of the `split` ("train" or "validation"), in a fixed order."""
    if split not in CORPUS_SPLITS:
        raise ValueError(f"split={split!r} is not one of {list(CORPUS_SPLITS)}")
    documents = []
    for name in corpus_files():
        text = _corpus_file(name)
        cut = validation_offset(text)
        documents.append((f"{CORPUS_FOLDER}/{name}", text[:cut] if split == "train" else text[cut:]))
    sample_split = "train" if split == "train" else "heldout"
    for language in LANGUAGES:
        documents.append((f"{language}.txt", load_text(language, sample_split)))
    return [(name, text.strip("\n")) for name, text in documents]


def corpus_text(split: str = "train") -> str:
    """The bundled mixed corpus's `split` ("train" or "validation") as one string."""
    return SEPARATOR.join(text for _, text in corpus_documents(split))


def corpus_fingerprint() -> str:
    """SHA-256 of the train split: names a tokenizer cache, so an edited corpus gets a fresh one."""
    return hashlib.sha256(corpus_text("train").encode("utf-8")).hexdigest()
