"""The repository speaks to its readers: no code, comment, docstring or document points at a text the
repository does not hold (a design document, private notes, the numbers of a private issue tracker).
Where a point needs a reference, it names docs/ARCHITECTURE.md, REPRODUCTION.md or BENCHMARKS.md.

Public references stay: "transformers #48690" has no word "issue" before its number, and an issue URL of
another project has none either. Scanned: src/, benchmarks/, scripts/, tests/, docs/ and the top-level
Markdown files; source and documentation only (the bundled corpus text and tokenizer files are data).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS_FILE = Path(__file__).resolve()
SCANNED_FOLDERS = ("src", "benchmarks", "scripts", "tests", "docs")
SCANNED_SUFFIXES = {".py", ".md", ".sh", ".toml", ".cfg"}
SKIPPED_FOLDERS = {".venv", ".git", "__pycache__"}
PATTERNS = tuple(
    re.compile(pattern) for pattern in (r"DESIGN §", r"DESIGN\.md", r"\b[Ii]ssues? #?\d+\b", r"HF_NOTES")
)


def scanned_files() -> Iterator[Path]:
    """Every scanned file, this one excepted, in a fixed order."""
    candidates = sorted(ROOT.glob("*.md"))
    for folder in SCANNED_FOLDERS:
        candidates += sorted(path for path in (ROOT / folder).rglob("*") if path.suffix in SCANNED_SUFFIXES)
    for path in candidates:
        parts = path.relative_to(ROOT).parts
        skipped = any(part in SKIPPED_FOLDERS or part.endswith(".egg-info") for part in parts)
        if path.is_file() and not skipped and path.resolve() != THIS_FILE:
            yield path


def outside_references() -> dict[str, list[str]]:
    """File (relative to the root, POSIX) -> its hits as "file:line: text", for files with any."""
    hits: dict[str, list[str]] = {}
    for path in scanned_files():
        name = path.relative_to(ROOT).as_posix()
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for number, line in enumerate(lines, start=1):
            if any(pattern.search(line) for pattern in PATTERNS):
                hits.setdefault(name, []).append(f"{name}:{number}: {line.strip()}")
    return hits


def test_the_patterns_keep_public_references():
    def flagged(text: str) -> bool:
        return any(pattern.search(text) for pattern in PATTERNS)

    assert not flagged("counts once per micro-batch (transformers #48690)")
    assert not flagged("https://github.com/huggingface/peft/issues/2310")
    assert not flagged("the tissue 12 layers")
    assert all(flagged(text) for text in ("(issue 28)", "Issues 27 and 28", "issue #5", "HF_NOTES §1"))


def test_no_file_points_outside_the_repository():
    hits = outside_references()
    found = [hit for _, lines in sorted(hits.items()) for hit in lines]
    assert not found, "references to texts the repository does not hold:\n" + "\n".join(found)
