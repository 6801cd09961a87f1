"""Training data for `train`: read local files into documents, split, tokenize, and collate.

The rules (`.txt` paragraphs, JSON records, datasets folders, block-size pieces, packing vs padding) are
stated in `hf_concept.training.recipes`' module docstring, which users read through docs/training.md.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DataCollatorWithFlattening

from hf_concept.training.errors import TrainSetupError

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSON_SUFFIXES = (".json", ".jsonl")
TXT_DOCUMENTS = ("paragraph", "file")
# How bytes that are not UTF-8 are treated: an error naming the file and offset, or U+FFFD in their place.
ENCODING_ERRORS = ("strict", "replace")


def paragraphs(text: str) -> list[str]:
    """The blank-line-separated paragraphs of `text` (a line of only whitespace counts as blank)."""
    blocks, current = [], []
    for line in text.splitlines():
        if line.strip():
            current.append(line)
        elif current:
            blocks.append("\n".join(current))
            current = []
    if current:
        blocks.append("\n".join(current))
    return blocks


def read_text(path: Path, encoding_errors: str = "strict") -> str:
    """The UTF-8 text of `path`; bytes that are not UTF-8 raise a `TrainSetupError` naming the file and
    the byte offset unless `encoding_errors="replace"` (each bad byte becomes U+FFFD)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8", errors=encoding_errors)
    except UnicodeDecodeError as error:
        raise TrainSetupError(
            f"data file {str(path)!r} is not valid UTF-8 at byte offset {error.start} "
            f"({data[error.start : error.start + 4]!r}): convert it to UTF-8, or pass "
            "--encoding-errors replace to read such bytes as U+FFFD"
        ) from None


def _json_records(path: Path, encoding_errors: str = "strict") -> list[Any]:
    text = read_text(path, encoding_errors)
    if path.suffix == ".json":
        try:
            values = json.loads(text)
        except json.JSONDecodeError:
            values = None  # JSON lines saved as .json (what `datasets`' to_json writes)
        if isinstance(values, list):
            return values
        if isinstance(values, dict):
            return [values]
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise TrainSetupError(f"{path} line {number} is not valid JSON: {error}") from None
    return records


def _record_texts(records: list[Any], text_field: str, path: Path) -> list[str]:
    """The `text_field` of every record; a columnar record ({"text": [...]}) gives its whole list."""
    texts = []
    for index, record in enumerate(records):
        if not isinstance(record, dict) or text_field not in record:
            fields = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise TrainSetupError(
                f"text field {text_field!r} is missing from record {index} of {path} (fields: {fields}); "
                "choose another with --text-field"
            )
        value = record[text_field]
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(item, str) for item in values):
            raise TrainSetupError(f"text field {text_field!r} of record {index} of {path} is not text")
        texts.extend(values)
    return texts


def load_saved_dataset(path: Path) -> Any:
    """The `Dataset` or `DatasetDict` that `save_to_disk` wrote to `path` (memory-mapped); a folder it did
    not write is one line."""
    import datasets

    try:
        return datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise TrainSetupError(
            f"data folder {str(path)!r} is not a dataset saved with datasets' save_to_disk"
        ) from None


def _dataset_texts(path: Path, text_field: str) -> list[str]:
    import datasets

    loaded = load_saved_dataset(path)
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise TrainSetupError(f"dataset {path} has splits {sorted(loaded)} but no 'train' split")
        loaded = loaded["train"]
    if text_field not in loaded.column_names:
        raise TrainSetupError(
            f"text field {text_field!r} is not a column of dataset {path} (columns: {loaded.column_names}); "
            "choose another with --text-field"
        )
    return [text for text in loaded[text_field] if isinstance(text, str)]


def read_documents(
    paths: str | Path | Sequence[str | Path],
    text_field: str = "text",
    txt_documents: str = "paragraph",
    encoding_errors: str = "strict",
) -> list[str]:
    """The non-empty documents of every data file or dataset folder in `paths` (rules: module docstring;
    `encoding_errors`: see `read_text`)."""
    if txt_documents not in TXT_DOCUMENTS:
        raise TrainSetupError(f"txt_documents={txt_documents!r} must be one of {TXT_DOCUMENTS}")
    if encoding_errors not in ENCODING_ERRORS:
        raise TrainSetupError(f"encoding_errors={encoding_errors!r} must be one of {ENCODING_ERRORS}")
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not paths:
        raise TrainSetupError("no data files given")
    documents: list[str] = []
    for path in map(Path, paths):
        if not path.exists():
            raise TrainSetupError(f"data file {str(path)!r} does not exist")
        if path.is_dir():
            documents += _dataset_texts(path, text_field)
        elif path.suffix in TEXT_SUFFIXES:
            text = read_text(path, encoding_errors)
            documents += paragraphs(text) if txt_documents == "paragraph" else [text]
        elif path.suffix in JSON_SUFFIXES:
            documents += _record_texts(_json_records(path, encoding_errors), text_field, path)
        else:
            raise TrainSetupError(
                f"data file {str(path)!r} has an unsupported suffix {path.suffix!r}: use "
                f"{', '.join(TEXT_SUFFIXES + JSON_SUFFIXES)} or a datasets folder (save_to_disk)"
            )
    documents = [document for document in documents if document.strip()]
    if not documents:
        raise TrainSetupError(f"the data files {[str(path) for path in paths]} hold no text")
    return documents


def split_indices(count: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) row numbers, each ascending: a seeded random `fraction` of `count` documents (at least
    one, never all) held out for evaluation."""
    if not (isinstance(fraction, float | int) and 0 < fraction < 1):
        raise TrainSetupError(f"eval_split_fraction={fraction!r} must be in (0, 1)")
    if count < 2:
        raise TrainSetupError(f"eval_split_fraction needs at least 2 documents, the data has {count}")
    order = list(range(count))
    random.Random(seed).shuffle(order)
    held = min(count - 1, max(1, round(fraction * count)))
    held_out = set(order[:held])
    return [index for index in range(count) if index not in held_out], sorted(held_out)


def split_documents(documents: list[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, eval): a seeded random `fraction` of the documents (at least one) held out for evaluation."""
    train, held_out = split_indices(len(documents), fraction, seed)
    return [documents[index] for index in train], [documents[index] for index in held_out]


def check_block_size(block_size: int) -> None:
    if not (isinstance(block_size, int) and block_size >= 2):
        raise TrainSetupError(f"block_size={block_size!r} must be an integer >= 2")


def document_pieces(documents: Sequence[Any], tokenizer: Any, block_size: int) -> list[list[int]]:
    """The token pieces of `documents`: each text document (blank ones and non-text values skipped; a list
    of texts, as a columnar JSON record gives, counts as its items) is tokenized with the tokenizer's own
    special tokens, gets eos appended if the tokenizer did not add it, and is cut into pieces of at most
    `block_size` tokens; a one-token piece has nothing to predict and is dropped."""
    values = [item for value in documents for item in (value if isinstance(value, list) else [value])]
    texts = [value for value in values if isinstance(value, str) and value.strip()]
    if not texts:
        return []
    eos = tokenizer.eos_token_id
    pieces = []
    # verbose=False: a document longer than the model's context is expected here (it is cut into pieces).
    for ids in tokenizer(texts, verbose=False)["input_ids"]:
        if eos is not None and (not ids or ids[-1] != eos):
            ids = [*ids, eos]
        pieces += [ids[offset : offset + block_size] for offset in range(0, len(ids), block_size)]
    return [piece for piece in pieces if len(piece) >= 2]


def tokenize_documents(documents: list[str], tokenizer: Any, block_size: int) -> list[dict[str, list[int]]]:
    """One {"input_ids": ...} sequence per piece of at most `block_size` tokens of each document."""
    check_block_size(block_size)
    sequences = []
    for start in range(0, len(documents), 256):
        pieces = document_pieces(documents[start : start + 256], tokenizer, block_size)
        sequences += [{"input_ids": piece} for piece in pieces]
    return sequences


@dataclass
class PaddingCollator:
    """Pads a batch of {"input_ids"} sequences (the `packing=False` path): pads are masked and unlabeled,
    and so is each row's first token (which no position predicts)."""

    pad_token_id: int
    padding_side: str = "right"

    def __call__(self, features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        longest = max(len(feature["input_ids"]) for feature in features)
        rows, masks, labels = [], [], []
        for feature in features:
            ids = list(feature["input_ids"])
            fill = longest - len(ids)
            pad, real = [self.pad_token_id] * fill, [1] * len(ids)
            left = self.padding_side == "left"
            rows.append(pad + ids if left else ids + pad)
            masks.append([0] * fill + real if left else real + [0] * fill)
            # A row's first token is no target (nothing before it in the row): left padding must not
            # make it one, or Trainer's num_items_in_batch (labels[..., 1:] != -100) would count it.
            labels.append([-100] * (fill + 1) + ids[1:] if left and ids else ids + [-100] * fill)
        return {
            "input_ids": torch.tensor(rows, dtype=torch.long),
            "attention_mask": torch.tensor(masks, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
        }


def data_collator(tokenizer: Any, packing: bool) -> Any:
    if packing:
        return DataCollatorWithFlattening()
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return PaddingCollator(pad_token_id=pad, padding_side=getattr(tokenizer, "padding_side", "right"))
