"""`--corpus DIR`: the reproductions' data from a corpus saved by `hf-concept build-corpus`.

The corpus is a `datasets` `DatasetDict` (`save_to_disk`) with splits train / validation / held_out and
columns text, language, kind, source, document. From it:

- the tokenizer: the same kind as the bundled runs use (`hf_concept.data.bpe`: byte-level BPE, 3072 ids,
  `<pad>`, `<s>`, `</s>`), trained on a sample of the train split instead of the bundled text: per
  (language, kind) cell, whole documents in the order of the SHA-256 of their `document` id, until the
  cell has `SAMPLE_CHARACTERS` characters (the last document cut there). Cached in
  `hf_concept.data.bpe.default_cache_dir()` under a name hashed from the corpus and the settings.
- the train split tokenised once (`Dataset.map`, batched, into a cache file named the same way; ids as
  int16, which 3072 ids fit, so that each worker process holds ~2 bytes per token) and cut into
  non-overlapping windows of `--context` tokens inside each document (a document's remainder that does not
  fill a window is left out; no window crosses documents, as the bundled crops do not).
- training batches **without replacement**: a model's steps read the windows in a shuffled order fixed by
  its seed (numpy's PCG64), batch i of a run `batch_size` consecutive windows of that order from
  `skip + i · batch_size`. A continued run (CT, Hidden Decoding's arms) starts where its pretraining
  stopped, so no window is read twice by a model and its ancestors; a run asking for more windows than
  the split has is refused with the figures (`require_windows`).
- held-out: the `held_out` split (never the source of a choice), `--heldout-tokens` tokens in all,
  shared among the (language, kind) cells in proportion to their train tokens (at least one context
  each), labelled "language/kind", taken by `--heldout-sample`: `spread` (the default) takes windows
  spread evenly over all of a cell's documents (`spread_windows`), `first` each cell's first tokens in the
  split's document order (the cut before the flag existed; the split's order is the sources' file order,
  so the first documents are the first collections, not a sample of the cell). The pooled held-out loss
  is then over the training mixture, so that `gap` = held-out − training loss measures overfitting, not
  the difference between two mixtures (classical Chinese is ~70% of the train tokens). The LSLM's byte
  held-out text per cell is taken the same way: `first`, its first bytes (`heldout_texts`); `spread`,
  1 KB pieces spread evenly over all of its documents' text, a document's remainder shorter than the
  context dropped as the train windows drop it (`spread_texts`; the LSLM's first second-cut sweep took
  the first KB of n documents instead, which over-weights document starts). The validation split is the
  one to use for a choice; these scripts make none.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import eval_bits_per_byte as runner

SPLITS = ("train", "validation", "held_out")
SAMPLE_CHARACTERS = 1_000_000
HELDOUT_TOKENS = 1 << 19
# How a cell's held-out text is taken (`--heldout-sample`); the default is `spread`, listed first.
HELDOUT_SAMPLES = ("spread", "first")
MAP_BATCH = 64


class CorpusError(ValueError):
    """A corpus that cannot give what a run asks (one line naming the figures)."""


def add_corpus_flags(parser: argparse.ArgumentParser) -> None:
    """`--corpus DIR` and `--heldout-tokens N`, for a reproduction script."""
    parser.add_argument(
        "--corpus",
        default=None,
        help="train and score on this saved corpus (hf-concept build-corpus) instead of the bundled text: "
        "a BPE of the bundled kind trained on a sample of its train split, each training window read at "
        "most once (one epoch at most), held-out figures on its held_out split per language/kind",
    )
    parser.add_argument(
        "--heldout-tokens",
        type=int,
        default=HELDOUT_TOKENS,
        help="with --corpus: held-out tokens scored, shared among the language/kind cells in proportion "
        "to their train tokens",
    )
    add_heldout_sample_flag(parser)


def add_heldout_sample_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--heldout-sample",
        choices=HELDOUT_SAMPLES,
        default=HELDOUT_SAMPLES[0],
        help="with --corpus: how each cell's held-out text is taken: spread evenly over all its documents "
        "(default), or its first documents in split order (the cut of sweeps begun before this flag)",
    )


def heldout_sample(args: argparse.Namespace) -> str:
    """`args.heldout_sample`, the default (`spread`) for a namespace built without it."""
    return getattr(args, "heldout_sample", HELDOUT_SAMPLES[0])


def heldout_sample_setting(args: argparse.Namespace) -> dict:
    """`heldout_sample` for a sweep's manifest, left out for `first` so that a sweep begun before the
    flag existed (its manifest has no such key) resumes with `--heldout-sample first`."""
    sample = heldout_sample(args)
    return {} if sample == "first" else dict(heldout_sample=sample)


def corpus_settings(args: argparse.Namespace) -> dict:
    """The corpus flags a sweep's manifest records (none without `--corpus`, as before it existed)."""
    if getattr(args, "corpus", None) is None:
        return {}
    settings = dict(corpus=str(Path(args.corpus).resolve()), heldout_tokens=args.heldout_tokens)
    return settings | heldout_sample_setting(args)


# ---------------------------------------------------------------------------------------------- windows


class WindowOrder:
    """Non-overlapping windows of `context` tokens of the documents in `tokens` (flat, one document after
    another, `offsets[d]:offsets[d + 1]` for document d), read in a seed's shuffled order."""

    def __init__(self, tokens: numpy.ndarray, offsets: numpy.ndarray, context: int) -> None:
        self.tokens, self.context = tokens, context
        lengths = numpy.diff(offsets)
        starts = [
            numpy.arange(offsets[index], offsets[index] + (length // context) * context, context)
            for index, length in enumerate(lengths)
        ]
        self.starts = numpy.concatenate(starts) if starts else numpy.zeros(0, dtype=numpy.int64)
        self._orders: dict[int, numpy.ndarray] = {}

    def __len__(self) -> int:
        return len(self.starts)

    def order(self, seed: int) -> numpy.ndarray:
        """The windows' indices in `seed`'s order (a permutation: each window once)."""
        if seed not in self._orders:
            self._orders[seed] = numpy.random.Generator(numpy.random.PCG64(seed)).permutation(len(self))
        return self._orders[seed]

    def ids(self, index: int) -> torch.Tensor:
        """Window `index`'s ids, (L,) int64."""
        start = int(self.starts[index])
        return torch.from_numpy(self.tokens[start : start + self.context].astype(numpy.int64))

    def documents(self, offsets: numpy.ndarray) -> numpy.ndarray:
        """The document of each window, (N,): the one whose `offsets` span holds its start."""
        return numpy.searchsorted(offsets, self.starts, side="right") - 1

    def batch(self, seed: int, first: int, batch_size: int) -> torch.Tensor:
        """Windows `first` .. `first + batch_size - 1` of `seed`'s order, as a (B, L) batch of ids."""
        if first + batch_size > len(self):
            raise CorpusError(
                f"window {first + batch_size} of {len(self)} asked: the train split has {len(self)} "
                f"windows of {self.context} tokens, and no window is read twice"
            )
        rows = [
            self.tokens[start : start + self.context]
            for start in self.starts[self.order(seed)[first:][:batch_size]]
        ]
        return torch.from_numpy(numpy.stack(rows).astype(numpy.int64))  # (B, L)


class WindowBatches(Sequence):
    """`count` batches of `batch_size` windows of `seed`'s order from window `first`: batch i is read
    when it is asked for (a run's steps, without holding them all)."""

    def __init__(self, windows: WindowOrder, seed: int, first: int, count: int, batch_size: int) -> None:
        self.windows, self.seed, self.first, self.count, self.batch_size = (
            windows,
            seed,
            first,
            count,
            batch_size,
        )

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, stride = index.indices(self.count)
            if stride != 1:
                raise ValueError("WindowBatches slices are contiguous")
            first = self.first + start * self.batch_size
            return WindowBatches(self.windows, self.seed, first, max(0, stop - start), self.batch_size)
        if not -self.count <= index < self.count:
            raise IndexError(f"batch {index} of {self.count}")
        index %= self.count
        return self.windows.batch(self.seed, self.first + index * self.batch_size, self.batch_size)


def require_windows(data: dict, args: argparse.Namespace, steps: int, what: str) -> None:
    """Exit 2 with one line naming the figures when `steps` steps of `args.batch_size` windows of
    `args.context` tokens (`what`: the steps a model and its ancestors take) exceed the train split."""
    windows = data.get("windows")
    if windows is None or steps * args.batch_size <= len(windows):
        return
    asked = steps * args.batch_size
    print(
        f"--corpus {args.corpus}: {what} = {steps} steps x {args.batch_size} x {args.context} tokens = "
        f"{asked * args.context} tokens ({asked} windows), but the train split has {len(windows)} windows "
        f"of {args.context} tokens ({len(windows) * args.context} tokens); no training token is read "
        "twice: ask for fewer steps, a smaller --batch-size or a shorter --context",
        file=sys.stderr,
    )
    raise SystemExit(2)


def batch_source(
    data: dict, args: argparse.Namespace, seed: int, order_seed: int | None = None, skip_steps: int = 0
) -> tuple[dict, Callable[[int], torch.Tensor]]:
    """The state a sweep checkpoints for a run's batches, and `draw(i)`, the (B, L) batch of its step i.

    Bundled text: random crops (`runner.sample_batch`) from `random.Random(seed)`, the generator being
    the state. Corpus: windows of `order_seed`'s order (default `seed`) after the `skip_steps` steps of
    the run's ancestors, a pure function of i (no state)."""
    windows = data.get("windows")
    if windows is None:
        rng = random.Random(seed)
        return {"batches": rng}, lambda index: runner.sample_batch(
            data["rows"], args.batch_size, args.context, rng
        )
    order = seed if order_seed is None else order_seed
    steps = WindowBatches(windows, order, skip_steps * args.batch_size, sys.maxsize, args.batch_size)
    return {}, steps.__getitem__


# ---------------------------------------------------------------------------------------------- loading


def corpus_key(folder: Path) -> str:
    """A hash of the saved corpus's split records (their fingerprints) and provenance: names its caches."""
    digest = hashlib.sha256()
    for name in ("dataset_dict.json", "provenance.json", *(f"{split}/state.json" for split in SPLITS)):
        path = folder / name
        digest.update(name.encode() + (path.read_bytes() if path.exists() else b""))
    return digest.hexdigest()[:16]


def tokenizer_sample(train) -> list[str]:
    """Per (language, kind) cell, whole documents in SHA-256 order of their id, up to
    `SAMPLE_CHARACTERS` characters per cell (a deterministic sample of every cell, balanced)."""
    keys = sorted(
        (hashlib.sha256(document.encode()).hexdigest(), index)
        for index, document in enumerate(train["document"])
    )
    cells: dict[tuple[str, str], int] = {}
    sample = []
    languages, kinds = list(train["language"]), list(train["kind"])
    for _, index in keys:
        cell = (languages[index], kinds[index])
        room = SAMPLE_CHARACTERS - cells.get(cell, 0)
        if room > 0:
            text = train[index]["text"][:room]
            cells[cell] = cells.get(cell, 0) + len(text)
            sample.append(text)
    return sample


def corpus_tokenizer(folder: Path, train):
    """The corpus's BPE (see the module docstring), trained once and cached."""
    from transformers import PreTrainedTokenizerFast

    from hf_concept.data.bpe import default_cache_dir, tokenizer_settings, train_bpe, wrap_tokenizer

    settings = json.dumps(dict(tokenizer_settings(), sample_characters=SAMPLE_CHARACTERS), sort_keys=True)
    name = hashlib.sha256((corpus_key(folder) + settings).encode()).hexdigest()[:16]
    path = default_cache_dir() / f"corpus-tokenizer-{name}"
    if not (path / "tokenizer.json").is_file():
        print(f"training the corpus BPE on a sample of {folder}'s train split", flush=True)
        runner.save_whole(wrap_tokenizer(train_bpe(tokenizer_sample(train))), path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    # Whole documents are tokenised at once and cut into windows here: no length warning for them.
    tokenizer.model_max_length = 1 << 30
    return tokenizer, path


def tokenized(split, tokenizer, cache: Path):
    """`split` with an int16 `input_ids` column in place of its text (`Dataset.map`, cached in `cache`:
    a later run reads the file instead of tokenising again)."""
    import datasets

    features = split.features.copy()
    del features["text"]
    features["input_ids"] = datasets.Sequence(datasets.Value("int16"))

    def encode(batch: dict) -> dict:
        return {"input_ids": tokenizer(batch["text"], add_special_tokens=False)["input_ids"]}

    cache.parent.mkdir(parents=True, exist_ok=True)
    return split.map(
        encode, batched=True, batch_size=MAP_BATCH, remove_columns=["text"], features=features,
        cache_file_name=str(cache), load_from_cache_file=True, desc=f"tokenising {cache.name}",
    )  # fmt: skip


def tokenized_splits(folder: Path, corpus, names: Sequence[str]) -> tuple[Any, dict]:
    """The corpus's tokenizer and its `names` splits tokenised (`tokenized`, each cached as
    `<name>.arrow` in a folder named from the corpus, beside the tokenizer)."""
    tokenizer, path = corpus_tokenizer(folder, corpus["train"])
    caches = path / f"ids-{corpus_key(folder)}"
    return tokenizer, {name: tokenized(corpus[name], tokenizer, caches / f"{name}.arrow") for name in names}


def flat_ids(split) -> tuple[numpy.ndarray, numpy.ndarray]:
    """The `input_ids` of every document one after another, and the documents' offsets (D + 1,)."""
    column = split.data.column("input_ids").combine_chunks()
    lengths = column.value_lengths().to_numpy(zero_copy_only=False).astype(numpy.int64)
    offsets = numpy.concatenate([[0], numpy.cumsum(lengths)])
    return column.flatten().to_numpy(zero_copy_only=False), offsets


def cells_of(split) -> list[str]:
    """Each document's "language/kind" cell."""
    return [f"{language}/{kind}" for language, kind in zip(split["language"], split["kind"], strict=True)]


def cell_members(split) -> dict[str, list[int]]:
    """Each cell's document indices, in split order."""
    members: dict[str, list[int]] = {}
    for index, cell in enumerate(cells_of(split)):
        members.setdefault(cell, []).append(index)
    return members


def cell_sizes(cells: Sequence[str], offsets: numpy.ndarray) -> dict[str, int]:
    """Tokens (or bytes) per cell, sorted by cell, of the documents with these cells and offsets (D + 1,)."""
    sizes: dict[str, int] = {}
    for cell, length in zip(cells, numpy.diff(offsets).tolist(), strict=True):
        sizes[cell] = sizes.get(cell, 0) + length
    return dict(sorted(sizes.items()))


def evenly_spaced(length: int, count: int) -> numpy.ndarray:
    """`count` indices into `length` items, spread evenly, the first and the last included."""
    return numpy.linspace(0, length - 1, count).round().astype(numpy.int64)


def heldout_limits(train_tokens: dict[str, int], total: int, context: int) -> dict[str, int]:
    """Held-out tokens per cell: `total` shared in proportion to the cells' train tokens, at least
    `context` each (a cell too small for its share still gets one window)."""
    whole = sum(train_tokens.values())
    return {cell: max(context, round(total * count / whole)) for cell, count in train_tokens.items()}


def heldout_documents(split, limits: dict[str, int]) -> list[tuple[str, torch.Tensor]]:
    """("language/kind", ids) of the first `limits[cell]` tokens of each cell (none of a cell not in
    `limits`), in the split's document order."""
    tokens, offsets = flat_ids(split)
    taken: dict[str, int] = {}
    documents = []
    for index, cell in enumerate(cells_of(split)):
        room = limits.get(cell, 0) - taken.get(cell, 0)
        ids = tokens[offsets[index] : offsets[index + 1]][:room]
        if len(ids) > 0:
            taken[cell] = taken.get(cell, 0) + len(ids)
            documents.append((cell, torch.from_numpy(ids.astype(numpy.int64))))
    return sorted(documents, key=lambda document: document[0])


def spread_windows(split, limits: dict[str, int], context: int) -> list[tuple[str, torch.Tensor]]:
    """("language/kind", ids) windows of `context` tokens, `ceil(limits[cell] / context)` per cell, spread
    evenly over all the cell's non-overlapping windows in the split (cut as the train windows are), so
    that every document of a cell has its share, where `heldout_documents` takes the first documents."""
    tokens, offsets = flat_ids(split)
    windows = WindowOrder(tokens, offsets, context)
    of_window = numpy.array(cells_of(split))[windows.documents(offsets)]
    chosen = []
    for cell, limit in sorted(limits.items()):
        indices = numpy.flatnonzero(of_window == cell)
        if len(indices) == 0:
            continue
        count = min(len(indices), -(-limit // context))
        for index in indices[evenly_spaced(len(indices), count)].tolist():
            chosen.append((cell, windows.ids(index)))
    return chosen


def load_corpus(args: argparse.Namespace) -> dict:
    """The reproductions' data dict from `args.corpus` (see the module docstring): `windows` (training),
    `heldout` ((cell, ids) pairs), `vocab_size`, `pad_id`, `heldout_tokens` and `train_tokens` per cell,
    and the train documents' cells and offsets (`window_cells`)."""
    from hf_concept.training.data import load_saved_dataset

    folder = Path(args.corpus)
    corpus = load_saved_dataset(folder)
    missing = [split for split in ("train", "held_out") if split not in corpus]
    if missing:
        raise SystemExit(f"--corpus {folder}: no {' or '.join(missing)} split (it has {sorted(corpus)})")
    tokenizer, ids = tokenized_splits(folder, corpus, ("train", "held_out"))
    train = ids["train"]
    tokens, offsets = flat_ids(train)
    windows = WindowOrder(tokens, offsets, args.context)
    cells = cells_of(train)
    train_tokens = cell_sizes(cells, offsets)
    limits = heldout_limits(train_tokens, args.heldout_tokens, args.context)
    if heldout_sample(args) == "first":
        heldout = heldout_documents(ids["held_out"], limits)
    else:
        heldout = spread_windows(ids["held_out"], limits, args.context)
    sizes = {}
    for cell, ids in heldout:
        sizes[cell] = sizes.get(cell, 0) + len(ids)
    print(f"corpus {folder}: train {len(tokens)} tokens {train_tokens}, "
          f"{len(windows)} windows of {args.context}; held-out tokens {sizes}", flush=True)  # fmt: skip
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return dict(rows=None, windows=windows, heldout=heldout, vocab_size=len(tokenizer), pad_id=pad_id,
                heldout_tokens=sizes, train_tokens=train_tokens,
                document_cells=cells, document_offsets=offsets)  # fmt: skip


def window_cells(data: dict, picked: numpy.ndarray) -> list[str]:
    """The "language/kind" cell of each train window in `picked` (indices into `data["windows"]`)."""
    documents = data["windows"].documents(data["document_offsets"])[picked]
    return [data["document_cells"][index] for index in documents.tolist()]


# ------------------------------------------------------------------------------------------------ bytes

HELDOUT_BYTES = 1 << 15
# Bytes per piece of a spread byte held-out sample (`spread_texts`).
SPREAD_PIECE_BYTES = 1024


class ByteIds:
    """The LSLM byte ids of texts (byte b -> b + `BYTE_OFFSET`, as `ByteTokenizer` without specials), in
    the call form `tokenized` uses; numpy per text instead of a Python loop per byte."""

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict:
        from hf_concept.modeling.tokenization_lslm import BYTE_OFFSET

        return {
            "input_ids": [
                numpy.frombuffer(text.encode("utf-8"), dtype=numpy.uint8).astype(numpy.int16) + BYTE_OFFSET
                for text in texts
            ]
        }


def heldout_texts(split, limit: int) -> dict[str, str]:
    """ "language/kind" -> the first `limit` bytes of the cell's held-out documents (split order) joined by
    line breaks, cut at a character boundary."""
    pieces: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    for text, cell in zip(split["text"], cells_of(split), strict=True):
        if sizes.get(cell, 0) < limit:
            pieces.setdefault(cell, []).append(text)
            sizes[cell] = sizes.get(cell, 0) + len(text.encode("utf-8")) + 1
    return {
        cell: "\n".join(texts).encode("utf-8")[:limit].decode("utf-8", errors="ignore")
        for cell, texts in sorted(pieces.items())
    }


def document_pieces(text: str, context: int) -> list[bytes]:
    """`text`'s UTF-8 bytes cut from its start into pieces of `SPREAD_PIECE_BYTES`; a last piece shorter
    than `context` is dropped, as the train windows drop a document's remainder."""
    data = text.encode("utf-8")
    pieces = [data[start : start + SPREAD_PIECE_BYTES] for start in range(0, len(data), SPREAD_PIECE_BYTES)]
    return [piece for piece in pieces if len(piece) >= context]


def spread_texts(split, limit: int, context: int) -> dict[str, str]:
    """ "language/kind" -> about `limit` bytes of the cell's held-out text, in pieces spread evenly over
    all of it: every document cut into `document_pieces`, then as many of the cell's pieces, evenly
    spaced, as make `limit` bytes at their mean length (all of them in a smaller cell), each trimmed to
    whole characters, joined by line breaks and cut to `limit` bytes at a character boundary. A
    document's start is then as likely to be scored as any other piece of it, as in the train windows;
    a cell whose documents are all shorter than `context` is left out, as it has no train windows."""
    documents, texts = split["text"], {}  # the column read once, not a row per document
    for cell, members in sorted(cell_members(split).items()):
        pieces = [piece for index in members for piece in document_pieces(documents[index], context)]
        if not pieces:
            continue
        mean = sum(map(len, pieces)) / len(pieces)
        count = min(len(pieces), max(1, -(-limit // round(mean))))
        picked = evenly_spaced(len(pieces), count).tolist()
        chosen = [pieces[index].decode("utf-8", errors="ignore") for index in picked]
        texts[cell] = "\n".join(chosen).encode("utf-8")[:limit].decode("utf-8", errors="ignore")
    return texts


def load_byte_corpus(args: argparse.Namespace) -> dict:
    """The LSLM reproduction's data from `args.corpus`: `windows` of `args.context` bytes of the train split
    (read without replacement, as `load_corpus`'s), `heldout` texts per "language/kind" cell
    (`args.heldout_bytes` bytes each, `heldout_texts`) and `train_bytes` per cell (the training mix)."""
    from hf_concept.data.bpe import default_cache_dir
    from hf_concept.training.data import load_saved_dataset

    folder = Path(args.corpus)
    corpus = load_saved_dataset(folder)
    missing = [split for split in ("train", "held_out") if split not in corpus]
    if missing:
        raise SystemExit(f"--corpus {folder}: no {' or '.join(missing)} split (it has {sorted(corpus)})")
    cache = default_cache_dir() / f"corpus-bytes-{corpus_key(folder)}" / "train.arrow"
    train = tokenized(corpus["train"], ByteIds(), cache)
    tokens, offsets = flat_ids(train)
    windows = WindowOrder(tokens, offsets, args.context)
    train_bytes = cell_sizes(cells_of(train), offsets)
    if heldout_sample(args) == "first":
        heldout = heldout_texts(corpus["held_out"], args.heldout_bytes)
    else:
        heldout = spread_texts(corpus["held_out"], args.heldout_bytes, args.context)
    print(f"corpus {folder}: train {len(tokens)} bytes {train_bytes}, "
          f"{len(windows)} windows of {args.context}; held-out bytes per cell {args.heldout_bytes}",
          flush=True)  # fmt: skip
    return dict(rows=None, windows=windows, heldout=heldout, train_bytes=train_bytes)
