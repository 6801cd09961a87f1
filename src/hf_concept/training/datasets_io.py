"""Training data through `datasets`: read, filter, split, tokenize once, and stream.

Reading: a folder written by `save_to_disk` is opened with `datasets.load_from_disk` (a `DatasetDict` gives
the split `split`, default "train"); `.json`/`.jsonl`, `.parquet` and `.txt`/`.text`/`.md` files go
through `datasets.load_dataset` ("json", "parquet", "text"). A `.txt` document is a blank-line-separated
paragraph (`txt_documents="paragraph"`, the rule `hf_concept.training.data.paragraphs` states) or the whole
file. `filters` keep the rows whose column holds one of the given values (`language=en`). Every source is
reduced to one "text" column before the sources are concatenated.

Tokenizing: one batched `Dataset.map` per run turns documents into pieces of at most `block_size` tokens
(`hf_concept.training.data.document_pieces`). Its result is cached by `datasets` in an Arrow file under
`HF_DATASETS_CACHE/hf_concept_tokenized/`, named by a fingerprint of the source data's own fingerprint, the
tokenizer (class, vocabulary and rules, special tokens), `block_size` and `PIPELINE_VERSION`: the next run
with the same data, tokenizer and settings loads that file instead of tokenizing again. (`datasets` would
otherwise hash the tokenizer object, whose pickled state is not stable across runs.)

Streaming (`streaming=True`): an `IterableDataset` read lazily, tokenized on the fly (nothing cached) and
shuffled in a seeded buffer; it has no length, so the run needs `max_steps`.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf_concept.training.data import (
    ENCODING_ERRORS,
    TXT_DOCUMENTS,
    check_block_size,
    document_pieces,
    load_saved_dataset,
    paragraphs,
    split_indices,
)
from hf_concept.training.errors import TrainSetupError

logger = logging.getLogger("hf_concept.train")

BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
}
# Part of every cache fingerprint: change it whenever the piece rule or the document rule changes.
PIPELINE_VERSION = "1"
CACHE_FOLDER = "hf_concept_tokenized"
DEFAULT_SPLIT = "train"
# Rows a streamed dataset is shuffled within (a map-style dataset is shuffled whole by Trainer).
STREAM_SHUFFLE_BUFFER = 1000
UTF8_CHUNK = 1 << 20
STREAM_SHARDS = 64
STREAM_BATCH = 16


def parse_filters(specs: Sequence[str]) -> dict[str, frozenset[str]]:
    """`["language=en,ja", "kind=prose"]` -> {"language": {"en", "ja"}, "kind": {"prose"}}: a row is kept
    when every named column holds one of its values."""
    filters: dict[str, frozenset[str]] = {}
    for spec in specs:
        column, sep, values = spec.partition("=")
        if not sep or not column.strip() or not values.strip():
            raise TrainSetupError(f"--data-filter {spec!r} must be COLUMN=VALUE[,VALUE...], e.g. language=en")
        chosen = frozenset(value.strip() for value in values.split(",") if value.strip())
        filters[column.strip()] = filters.get(column.strip(), frozenset()) | chosen
    return filters


def _fingerprint(*parts: Any) -> str:
    text = json.dumps(parts, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def _cache_file(fingerprint: str) -> str:
    import datasets

    folder = Path(datasets.config.HF_DATASETS_CACHE) / CACHE_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder / f"{fingerprint}.arrow")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what decides the token ids: the class, the vocabulary and rules (a fast tokenizer's whole
    `tokenizer.json`), the special tokens and the settings the tokenizer was built with."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    rules = backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items())
    settings = {
        key: value
        for key, value in getattr(tokenizer, "init_kwargs", {}).items()
        if key not in ("name_or_path", "tokenizer_file", "vocab_file")
    }
    special = [tokenizer.eos_token_id, tokenizer.bos_token_id, sorted(tokenizer.all_special_tokens)]
    return _fingerprint(type(tokenizer).__qualname__, rules, settings, special)


def _check_utf8(path: Path) -> None:
    """Raise the one-line error naming `path` and the byte offset of its first byte that is not UTF-8;
    read in chunks, so a large file costs one pass and little memory."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with path.open("rb") as file:
        while True:
            chunk = file.read(UTF8_CHUNK)
            # The decoder carries up to 3 bytes of a character split across chunks; error offsets count them.
            carried = len(decoder.getstate()[0])
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as error:
                start = offset - carried + error.start
                file.seek(start)
                raise TrainSetupError(
                    f"data file {str(path)!r} is not valid UTF-8 at byte offset {start} ({file.read(4)!r}): "
                    "convert it to UTF-8, or pass --encoding-errors replace to read such bytes as U+FFFD"
                ) from None
            if not chunk:
                return
            offset += len(chunk)


def _load_saved(path: Path, split: str | None, streaming: bool) -> Any:
    """A split of a `save_to_disk` folder (memory-mapped, never read whole)."""
    import datasets

    loaded = load_saved_dataset(path)
    if isinstance(loaded, datasets.DatasetDict):
        split = split or DEFAULT_SPLIT
        if split not in loaded:
            raise TrainSetupError(
                f"--data-split {split!r} is not a split of {path} (splits: {', '.join(loaded)}); choose one "
                "with --data-split"
            )
        loaded = loaded[split]
    elif split not in (None, DEFAULT_SPLIT):
        raise TrainSetupError(
            f"--data-split {split!r}: {path} is a single dataset with no splits; drop the flag"
        )
    if not streaming:
        return loaded
    # Shards let the stream's shuffle reorder whole stretches of the data, not only a buffer of rows.
    return loaded.to_iterable_dataset(num_shards=max(1, min(STREAM_SHARDS, len(loaded))))


def _load_file(path: Path, txt_documents: str, encoding_errors: str, streaming: bool, text_field: str) -> Any:
    """One data file through `datasets.load_dataset` (its Arrow copy is cached by `datasets`), after the
    checks whose errors name the byte or line (datasets' own name a row of its count)."""
    import datasets

    builder = BUILDERS.get(path.suffix)
    if builder is None:
        raise TrainSetupError(
            f"data file {str(path)!r} has an unsupported suffix {path.suffix!r}: use "
            f"{', '.join(BUILDERS)} or a datasets folder (save_to_disk)"
        )
    if path.is_file() and path.stat().st_size == 0:
        raise TrainSetupError(f"data file {str(path)!r} is empty: there is nothing to train on")
    if builder != "parquet" and encoding_errors == "strict":
        _check_utf8(path)
    if path.suffix == ".jsonl":
        check_json_lines(path, text_field, encoding_errors)
    options: dict[str, Any] = {}
    if builder == "text":
        options = {"sample_by": "paragraph" if txt_documents == "paragraph" else "document"}
        options["encoding_errors"] = encoding_errors
    elif builder == "json" and encoding_errors == "replace":
        # The json builder decodes (and so honours encoding_errors) only for an encoding other than "utf-8".
        options = {"encoding": "utf-8-sig", "encoding_errors": "replace"}
    try:
        return datasets.load_dataset(
            builder, data_files=str(path.resolve()), split="train", streaming=streaming, **options
        )
    except StopIteration:
        # datasets' json builder infers the schema from the first record; a file of blank lines has none.
        raise TrainSetupError(f"data file {str(path)!r} holds no {builder} record to train on") from None
    except (ValueError, datasets.exceptions.DatasetGenerationError) as error:
        cause = error.__cause__ or error
        raise TrainSetupError(f"data file {str(path)!r} cannot be read as {builder}: {cause}") from None


def _column_names(dataset: Any) -> list[str]:
    """The columns of a dataset; a stream whose features are not known yet is asked for its first row."""
    if dataset.column_names is not None:
        return list(dataset.column_names)
    first = next(iter(dataset), None)
    return [] if first is None else list(first)


def _filtered(dataset: Any, filters: dict[str, frozenset[str]], columns: list[str], path: Path) -> Any:
    for column, values in filters.items():
        if column not in columns:
            raise TrainSetupError(
                f"--data-filter column {column!r} is not a column of {path} (columns: {', '.join(columns)})"
            )
        if hasattr(dataset, "cache_files"):
            fingerprint = _fingerprint(dataset._fingerprint, "filter", column, sorted(values))
            dataset = dataset.filter(
                _keep_rows,
                batched=True,
                input_columns=[column],
                fn_kwargs={"values": values},
                new_fingerprint=fingerprint,
                cache_file_name=_cache_file(fingerprint),
                desc=f"Filtering {column}",
            )
        else:
            dataset = dataset.filter(
                _keep_rows, batched=True, input_columns=[column], fn_kwargs={"values": values}
            )
    return dataset


def _keep_rows(column: list[Any], values: frozenset[str]) -> list[bool]:
    return [value in values for value in column]


def _split_paragraphs(batch: dict[str, list[Any]]) -> dict[str, list[str]]:
    # datasets' "paragraph" samples split at "\n\n" only; a line of spaces also ends a paragraph here.
    return {"text": [part for text in batch["text"] if isinstance(text, str) for part in paragraphs(text)]}


def check_json_lines(path: Path, text_field: str, encoding_errors: str) -> None:
    """`TrainSetupError` naming the first line of a JSON-lines file that is no object with a string
    `text_field` (datasets would fill a missing field with None, or cast a number, and train on the rest)."""
    with path.open(encoding="utf-8-sig", errors=encoding_errors) as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"data file {str(path)!r} line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise TrainSetupError(f"{where} is not JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise TrainSetupError(f"{where} is a JSON {type(record).__name__}, not an object")
            if text_field not in record:
                raise TrainSetupError(
                    f"{where} has no {text_field!r} field (choose another with --text-field)"
                )
            if not isinstance(record[text_field], str):
                kind = type(record[text_field]).__name__
                raise TrainSetupError(f"{where}: {text_field!r} is a {kind}, not a string")


def _text_only(dataset: Any, text_field: str, columns: list[str], path: Path, paragraph_file: bool) -> Any:
    """`dataset` reduced to one "text" column (a .txt file's samples re-split into paragraphs)."""
    if text_field not in columns:
        raise TrainSetupError(
            f"text field {text_field!r} is not a column of {path} (columns: {', '.join(columns)}); choose "
            "another with --text-field"
        )
    dataset = dataset.select_columns([text_field])
    if text_field != "text":
        dataset = dataset.rename_column(text_field, "text")
    if not paragraph_file:
        return dataset
    if hasattr(dataset, "cache_files"):
        fingerprint = _fingerprint(dataset._fingerprint, "paragraphs", PIPELINE_VERSION)
        return dataset.map(
            _split_paragraphs,
            batched=True,
            new_fingerprint=fingerprint,
            cache_file_name=_cache_file(fingerprint),
            desc="Splitting paragraphs",
        )
    return dataset.map(_split_paragraphs, batched=True)


def load_documents(
    paths: str | Path | Sequence[str | Path],
    *,
    split: str | None = None,
    filters: dict[str, frozenset[str]] | None = None,
    text_field: str = "text",
    txt_documents: str = "paragraph",
    encoding_errors: str = "strict",
    streaming: bool = False,
) -> Any:
    """The documents of every data file or dataset folder in `paths` as one `datasets.Dataset` (an
    `IterableDataset` when `streaming`) with a single "text" column (rules: module docstring)."""
    import datasets

    if txt_documents not in TXT_DOCUMENTS:
        raise TrainSetupError(f"txt_documents={txt_documents!r} must be one of {TXT_DOCUMENTS}")
    if encoding_errors not in ENCODING_ERRORS:
        raise TrainSetupError(f"encoding_errors={encoding_errors!r} must be one of {ENCODING_ERRORS}")
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not paths:
        raise TrainSetupError("no data files given")
    parts = []
    for path in map(Path, paths):
        if not path.exists():
            raise TrainSetupError(f"data file {str(path)!r} does not exist")
        if path.is_dir():
            dataset = _load_saved(path, split, streaming)
        else:
            dataset = _load_file(path, txt_documents, encoding_errors, streaming, text_field)
        columns = _column_names(dataset)
        dataset = _filtered(dataset, filters or {}, columns, path)
        is_paragraph_file = BUILDERS.get(path.suffix) == "text" and txt_documents == "paragraph"
        parts.append(_text_only(dataset, text_field, columns, path, is_paragraph_file))
    documents = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    if not streaming and len(documents) == 0:
        chosen = f" with --data-filter {_describe(filters)}" if filters else ""
        raise TrainSetupError(f"the data {[str(path) for path in paths]}{chosen} holds no documents")
    return documents


def _describe(filters: dict[str, frozenset[str]] | None) -> str:
    return " ".join(f"{column}={','.join(sorted(values))}" for column, values in (filters or {}).items())


def _pieces_batch(batch: dict[str, list[Any]], tokenizer: Any, block_size: int) -> dict[str, list[list[int]]]:
    return {"input_ids": document_pieces(batch["text"], tokenizer, block_size)}


def tokenize_dataset(documents: Any, tokenizer: Any, block_size: int) -> Any:
    """`documents` (one "text" column) as {"input_ids"} pieces of at most `block_size` tokens: one batched
    map, cached under a fingerprint of the data, the tokenizer and the settings (module docstring)."""
    check_block_size(block_size)
    options = {
        "batched": True,
        "remove_columns": ["text"],
        "fn_kwargs": {"tokenizer": tokenizer, "block_size": block_size},
    }
    if not hasattr(documents, "cache_files"):
        # Small batches: a stream yields its first pieces after tokenizing one batch of documents.
        return documents.map(_pieces_batch, batch_size=STREAM_BATCH, **options)
    fingerprint = _fingerprint(
        documents._fingerprint, "pieces", tokenizer_fingerprint(tokenizer), block_size, PIPELINE_VERSION
    )
    return documents.map(
        _pieces_batch,
        **options,
        new_fingerprint=fingerprint,
        cache_file_name=_cache_file(fingerprint),
        desc="Tokenizing",
    )


def split_dataset(documents: Any, fraction: float, seed: int) -> tuple[Any, Any]:
    """(train, eval) documents: the same seeded choice of held-out rows as `data.split_documents`."""
    if not hasattr(documents, "cache_files"):
        raise TrainSetupError(
            "--eval-split-fraction cannot split a stream (--streaming): give --eval-data, or a --data-split "
            "of its own for evaluation"
        )
    train, held_out = split_indices(len(documents), fraction, seed)
    return documents.select(train), documents.select(held_out)


def token_count(sequences: Any) -> int:
    """The tokens of a tokenized `datasets.Dataset`, summed by Arrow (no Python pass over the rows)."""
    import pyarrow.compute as compute

    lengths = compute.list_value_length(sequences.with_format("arrow")[:]["input_ids"])
    return int(compute.sum(lengths).as_py() or 0)


def prepare_datasets(
    data: str | Path | Sequence[str | Path],
    tokenizer: Any,
    *,
    eval_data: str | Path | Sequence[str | Path] | None = None,
    eval_split_fraction: float | None = None,
    text_field: str = "text",
    txt_documents: str = "paragraph",
    block_size: int = 512,
    seed: int = 0,
    encoding_errors: str = "strict",
    data_split: str | None = None,
    eval_data_split: str | None = None,
    data_filter: Sequence[str] = (),
    streaming: bool = False,
    max_steps: int = -1,
) -> tuple[Any, Any]:
    """(train sequences, eval sequences or None) as `datasets` datasets (the train one an
    `IterableDataset` when `streaming`). `data_filter` holds "COLUMN=VALUE[,VALUE...]" strings and applies to
    the eval data too; `data_split`/`eval_data_split` name the split of a saved `DatasetDict`."""
    if eval_data and eval_split_fraction:
        raise TrainSetupError("give eval_data or eval_split_fraction, not both")
    if streaming and max_steps < 1:
        raise TrainSetupError("--streaming needs --max-steps N: a stream has no length to count epochs from")
    check_block_size(block_size)
    filters = parse_filters(data_filter)
    reading = {"filters": filters, "text_field": text_field, "txt_documents": txt_documents}
    reading["encoding_errors"] = encoding_errors
    documents = load_documents(data, split=data_split, streaming=streaming, **reading)
    eval_documents = None
    if eval_data:
        eval_documents = load_documents(eval_data, split=eval_data_split, **reading)
    elif eval_split_fraction:
        documents, eval_documents = split_dataset(documents, eval_split_fraction, seed)
    train_set = tokenize_dataset(documents, tokenizer, block_size)
    eval_set = tokenize_dataset(eval_documents, tokenizer, block_size) if eval_documents is not None else None
    # Every rank prepares the data; only the main one says so.
    say = logger.info if int(os.environ.get("RANK", "0")) == 0 else logger.debug
    if streaming:
        say(f"streaming {data}: documents are tokenized as training reads them")
        return train_set.shuffle(seed=seed, buffer_size=STREAM_SHUFFLE_BUFFER), eval_set
    if len(train_set) == 0:
        raise TrainSetupError(f"the data gives no training sequence of 2 or more tokens (data={data!r})")
    say(f"{len(documents)} documents -> {len(train_set)} training sequences, {token_count(train_set)} tokens")
    return train_set, eval_set
