"""Plain UTF-8 text out of unpacked package trees, one `Document` per novel, book, page or run of poems.

Each format goes through the tool made for it: man pages through groff (with preconv and tbl); HTML
through the standard library's `html.parser`; Jane Austen's novels, which `r-cran-janeaustenr` keeps in
an R lazy-load database, through `Rscript` and R's own `lazyLoad`; the King James Bible, which
`bible-kjv-text` keeps compressed for its program, through the `bible` program that `bible-kjv` ships;
chinese-poetry through `json`. Only Debian's description lists (deb822 paragraphs: `Field: value` with
indented continuation lines) are read here line by line, as apt writes them.

Every extractor yields documents in a fixed order (sorted paths), which the removal of repeated lines
relies on.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from hf_concept.data.corpus_sources import TRANSLATION_PREFIX, Source, require_tool
from hf_concept.progress import progress_bar


@dataclass(frozen=True)
class Document:
    """One whole document; `document` is unique in the corpus and decides the split."""

    text: str
    language: str
    kind: str
    source: str
    document: str


def extract_source(source: Source, root: Path, progress: bool = True) -> Iterator[Document]:
    """The documents of `source`, whose package trees are `root/<package>`."""
    for package in source.packages:
        if not (root / package).is_dir():
            raise FileNotFoundError(
                f"{root / package}: the unpacked tree of {package} (source {source.name}) is missing; "
                f"unpack it there (`dpkg-deb -x {package}_*.deb {root / package}`) or leave {source.name} "
                "out of --sources"
            )
    extractor = EXTRACTORS[source.extractor]
    for document_id, package, text in extractor(source, root, progress):
        if source.script_lines_only:
            text = _script_lines(text, SCRIPTS[source.language])
        if text:
            yield Document(text, source.language, source.kind, package, document_id)


# Characters of each language's own script: CJK ideographs (and kana for Japanese).
SCRIPTS = {
    "zh": re.compile(r"[\u3400-\u9fff\uf900-\ufaff]"),
    "ja": re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uf900-\ufaff]"),
    "en": re.compile(r"[A-Za-z]"),
}


def _script_lines(text: str, script: re.Pattern) -> str:
    return "\n".join(line for line in text.splitlines() if script.search(line))


def _matching_files(source: Source, root: Path) -> list[tuple[str, Path]]:
    """(package, path) of every regular file matching the source's globs, sorted; symlinks are copies."""
    found = []
    for package in source.packages:
        tree = root / package
        for pattern in source.patterns:
            found.extend(
                (package, path)
                for path in tree.glob(pattern)
                if path.is_file() and not path.is_symlink() and not _excluded(path, tree)
            )
    return sorted(set(found))


# Files under these globs hold no running text (chinese-poetry's tone patterns and search ranks, its
# error lists) or are indexes of other pages.
EXCLUDED = ("*/strains/*", "*/rank/*", "*/error/*", "*/genindex*", "*/search.html", "*/py-modindex.html")


def _excluded(path: Path, tree: Path) -> bool:
    relative = "/" + path.relative_to(tree).as_posix()
    return any(fnmatch.fnmatch(relative, pattern) for pattern in EXCLUDED)


def _document_id(package: str, path: Path, root: Path) -> str:
    return f"{package}:{path.relative_to(root / package).as_posix()}"


def _progress(items: list, source: Source, progress: bool) -> Iterator:
    return iter(progress_bar(items, enabled=progress, desc=source.name, unit="doc", leave=False))


def _lines_to_text(lines: list[str]) -> str:
    return "\n".join(line.rstrip() for line in lines).strip("\n")


def extract_man(source: Source, root: Path, progress: bool) -> Iterator[tuple[str, str, str]]:
    """Man pages as groff renders them for a UTF-8 terminal of 80 columns, without overstrikes."""
    import tempfile

    require_tool("groff", f"the man pages of {source.name}")
    pages = [(package, path) for package, path in _matching_files(source, root) if not _is_redirect(path)]
    with tempfile.TemporaryDirectory(prefix="hf-concept-tmac-") as macros:
        (Path(macros) / f"{NO_ADJUST_MACRO}.tmac").write_text(NO_ADJUST_TMAC)
        # Two renders at a time: a thread only waits on its groff process.
        pool = ThreadPoolExecutor(max_workers=2)
        try:
            texts = pool.map(lambda item: render_man(item[1], Path(macros)), pages)
            for (package, path), text in zip(_progress(pages, source, progress), texts, strict=True):
                if text:
                    yield _document_id(package, path, root), package, text
        finally:
            # On an interrupt, drop the pages not yet rendered instead of rendering them all first.
            pool.shutdown(wait=True, cancel_futures=True)


# -k: preconv finds the page's encoding; -t: tbl for tables; -P-cbou: plain characters, no bold or
# underline overstrikes (so no `col -b`); LL: 80 columns; HY=0: no hyphenation, which would split words
# across lines. `man -l` would do the same, but it hung on some pages of manpages-zh here.
GROFF_MAN = ["groff", "-k", "-t", "-man", "-Tutf8", "-P-cbou", "-rLL=80n", "-rHY=0"]
# Loaded after -man: `.TH` turns adjustment off, so words are not padded with spaces to fill a line
# (groff 1.22's man macros have no `-dAD=l`); it reads "getrpcport()    は  host  上で" otherwise.
NO_ADJUST_MACRO = "hf-concept-noadjust"
NO_ADJUST_TMAC = ".am TH\n.na\n..\n"
# A page that takes longer than this is dropped (none does on Debian 12's pages).
MAN_TIMEOUT_S = 60


def render_man(path: Path, macro_dir: Path) -> str:
    """The plain text of one (possibly gzipped) man page; "" when groff fails or hangs.

    `macro_dir` holds NO_ADJUST_MACRO's file.
    """
    import gzip

    roff = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    command = [*GROFF_MAN, "-M", str(macro_dir), f"-m{NO_ADJUST_MACRO}"]
    env = {**os.environ, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "GROFF_NO_SGR": "1"}
    try:
        result = subprocess.run(command, input=roff, env=env, capture_output=True, timeout=MAN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return ""
    return _lines_to_text(result.stdout.decode("utf-8", errors="replace").splitlines())


def _is_redirect(path: Path) -> bool:
    """A page that only sources another (`.so man3/other.3`) renders as a copy of it."""
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        head = handle.read(200).lstrip()
    return head.startswith(b".so ")


class _HtmlText(HTMLParser):
    """Visible text of a page: blocks become lines, `<pre>` keeps its lines, navigation is dropped.

    When the page marks its main content (`role="main"` or `<main>`), only that is kept.
    """

    SKIPPED_TAGS = frozenset({"head", "script", "style", "nav", "noscript", "template", "footer", "button"})
    SKIPPED_CLASSES = frozenset(
        {
            "headerlink",
            "sphinxsidebar",
            "related",
            "navheader",
            "navfooter",
            "wy-nav-side",
            "wy-breadcrumbs",
            "rst-footer-buttons",
            "footer",
            "noicon",
            "noteicon",
        }
    )
    BLOCK_TAGS = frozenset(
        {
            "p",
            "div",
            "br",
            "li",
            "dt",
            "dd",
            "tr",
            "td",
            "th",
            "h1",
            "h2",
            "h3",
            "h4",
            "h5",
            "h6",
            "pre",
            "table",
            "section",
            "article",
            "blockquote",
            "title",
            "ul",
            "ol",
            "dl",
            "hr",
            "caption",
            "main",
        }
    )
    VOID_TAGS = frozenset({"br", "img", "hr", "meta", "link", "input", "area", "base", "col", "embed", "wbr"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.all_parts: list[str] = []
        self.main_parts: list[str] = []
        # (tag, depth) of the element being skipped / of the main element; depth counts same-name nesting.
        self._skip: list = [None, 0]
        self._main: list = [None, 0]
        self._pre = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.VOID_TAGS:
            if tag in self.BLOCK_TAGS:
                self._append("\n")
            return
        attributes = dict(attrs)
        for state in (self._skip, self._main):
            if state[0] == tag:
                state[1] += 1
        classes = set((attributes.get("class") or "").split())
        if self._skip[0] is None and (
            tag in self.SKIPPED_TAGS or classes & self.SKIPPED_CLASSES or "hidden" in attributes
        ):
            self._skip[:] = [tag, 1]
        if self._main[0] is None and (tag == "main" or attributes.get("role") == "main"):
            self._main[:] = [tag, 1]
        self._pre += tag == "pre"
        if tag in self.BLOCK_TAGS:
            self._append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.BLOCK_TAGS:
            self._append("\n")
        self._pre -= tag == "pre" and self._pre > 0
        for state in (self._skip, self._main):
            if state[0] == tag:
                state[1] -= 1
                if state[1] == 0:
                    state[:] = [None, 0]

    def handle_data(self, data: str) -> None:
        self._append(data if self._pre else re.sub(r"\s+", " ", data))

    def _append(self, text: str) -> None:
        if self._skip[0] is not None:
            return
        self.all_parts.append(text)
        if self._main[0] is not None:
            self.main_parts.append(text)

    def text(self) -> str:
        parts = self.main_parts if "".join(self.main_parts).strip() else self.all_parts
        lines = [line.strip() for line in "".join(parts).splitlines()]
        return "\n".join(line for line in lines if line)


def html_to_text(html: str) -> str:
    """The visible text of an HTML page, one block per line."""
    parser = _HtmlText()
    parser.feed(html)
    parser.close()
    return parser.text()


def extract_html(source: Source, root: Path, progress: bool) -> Iterator[tuple[str, str, str]]:
    files = _matching_files(source, root)
    for package, path in _progress(files, source, progress):
        text = html_to_text(path.read_text(encoding="utf-8", errors="replace"))
        if text:
            yield _document_id(package, path, root), package, text


# chinese-poetry's keys whose strings are text (titles, verses, prefaces, notes, biographies); ids,
# author names, dynasties, tags are not running text.
POETRY_TEXT_KEYS = frozenset(
    {
        "title",
        "rhythmic",
        "chapter",
        "section",
        "paragraphs",
        "content",
        "para",
        "comment",
        "notes",
        "desc",
        "description",
        "biography",
        "prologue",
    }
)


def _json_strings(value: object, key: str | None = None) -> Iterator[str]:
    if isinstance(value, str):
        if key in POETRY_TEXT_KEYS:
            yield value
    elif isinstance(value, list):
        for item in value:
            yield from _json_strings(item, key)
    elif isinstance(value, dict):
        for child_key, child in value.items():
            yield from _json_strings(child, child_key)


# chinese-poetry keeps some collections whole in one file (every Yuan qu in `yuanqu.json`, every Song
# poet's biography in `authors.song.json`) and others in batches of 1,000 poems. With the file as the split
# unit a whole genre fell into one split (the validation split's classical text was 43% Yuan qu, a genre
# absent from training), so the splits' genre mixes differed by more than the effects the reproductions
# measure. A document is a run of whole entries (poems, biographies) of at least this many bytes of text:
# no poem is cut, and every large collection spreads over the three splits.
POETRY_DOCUMENT_BYTES = 32_000


def _entry_runs(entries: list, budget: int) -> Iterator[list[str]]:
    """The entries' text lines in order, cut after the entry that brings a run to `budget` bytes."""
    run: list[str] = []
    size = 0
    for entry in entries:
        lines = [line.strip() for line in _json_strings(entry) if line.strip()]
        run += lines
        size += sum(len(line.encode()) + 1 for line in lines)
        if size >= budget:
            yield run
            run, size = [], 0
    if run:
        yield run


def extract_json(source: Source, root: Path, progress: bool) -> Iterator[tuple[str, str, str]]:
    """Per JSON file, in file order, documents `<file id>#<n>` of whole entries (`_entry_runs`), their text
    strings one per line; a file whose top level is not a list is one entry."""
    for package, path in _progress(_matching_files(source, root), source, progress):
        value = json.loads(path.read_text(encoding="utf-8"))
        entries = value if isinstance(value, list) else [value]
        file_id = _document_id(package, path, root)
        for index, lines in enumerate(_entry_runs(entries, POETRY_DOCUMENT_BYTES)):
            yield f"{file_id}#{index}", package, _lines_to_text(lines)


# Writes each character vector of the lazy-load database `args[1]` to `args[2]/<name>.txt`.
_AUSTEN_R = (
    "args <- commandArgs(trailingOnly = TRUE); env <- new.env(); invisible(lazyLoad(args[1], envir = env)); "
    "for (name in sort(ls(env))) { value <- get(name, envir = env); "
    "if (is.character(value)) writeLines(enc2utf8(value), file.path(args[2], paste0(name, '.txt')), "
    "useBytes = TRUE) }"
)
AUSTEN_DATA = "usr/lib/R/site-library/janeaustenr/data/Rdata"


def extract_austen(source: Source, root: Path, progress: bool) -> Iterator[tuple[str, str, str]]:
    """The six novels, read by R from the package's lazy-load database (`Rdata.rdb` / `.rdx`)."""
    import tempfile

    require_tool("Rscript", f"the novels of {source.name}")
    package = source.packages[0]
    database = root / package / AUSTEN_DATA
    if not database.with_suffix(".rdx").is_file():
        raise FileNotFoundError(f"{database}.rdx: the R data of {package} is missing from its tree")
    with tempfile.TemporaryDirectory(prefix="hf-concept-austen-") as scratch:
        _run(["Rscript", "-e", _AUSTEN_R, str(database), scratch], f"reading the R data of {package}")
        for path in _progress(sorted(Path(scratch).glob("*.txt")), source, progress):
            yield f"{package}:{path.stem}", package, _lines_to_text(path.read_text("utf-8").splitlines())


# `bible -f` prints one verse a line, after its reference: "1Sm3:10 And the LORD came...".
_VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")


def extract_bible(source: Source, root: Path, progress: bool) -> Iterator[tuple[str, str, str]]:
    """One document per book, as the package's own `bible` program prints it (references dropped)."""
    text_package, program_package = source.packages
    program = root / program_package / "usr/bin/bible"
    output = _run(
        [str(program), "-f", "-p", str(root / text_package / "usr/lib"), "Gen1:1-Rev22:21"],
        f"printing the text of {text_package} with {program_package}'s `bible`",
    )
    books: dict[str, list[str]] = {}
    for line in output.splitlines():
        verse = _VERSE.match(line)
        if verse:
            books.setdefault(verse.group(1), []).append(verse.group(4))
    for book in _progress(list(books), source, progress):
        yield f"{text_package}:{book}", text_package, _lines_to_text(books[book])


def extract_descriptions(source: Source, root: Path, progress: bool) -> Iterator[tuple[str, str, str]]:
    """One document per package: its translated short and long descriptions (all versions, in order)."""
    folder = source.packages[0]
    listing = f"Translation-{folder.removeprefix(TRANSLATION_PREFIX)}"
    path = root / folder / listing
    descriptions: dict[str, list[str]] = {}
    for paragraph in path.read_text(encoding="utf-8", errors="replace").split("\n\n"):
        package, lines = _description_paragraph(paragraph)
        if package and lines:
            descriptions.setdefault(package, []).extend([*lines, ""])
    for package in _progress(list(descriptions), source, progress):
        yield f"{listing}:{package}", folder, _lines_to_text(descriptions[package])


def _description_paragraph(paragraph: str) -> tuple[str | None, list[str]]:
    """(package, description lines) of one deb822 paragraph; " ." is an empty line of a long description."""
    package, lines, in_description = None, [], False
    for line in paragraph.splitlines():
        if line.startswith((" ", "\t")):
            if in_description:
                lines.append("" if line.strip() == "." else line.strip())
            continue
        field, _, value = line.partition(":")
        # "Description-ja" holds the text; "Description-md5" only identifies the English original.
        in_description = field.startswith("Description-") and field != "Description-md5"
        if field == "Package":
            package = value.strip()
        elif in_description:
            lines.append(value.strip())
    return package, lines


def _run(command: list[str], purpose: str) -> str:
    result = subprocess.run(command, capture_output=True, check=False)
    if result.returncode != 0:
        last = (result.stderr.decode("utf-8", "replace").strip().splitlines() or ["no message"])[-1]
        raise RuntimeError(f"`{' '.join(command[:2])} …` failed ({purpose}): {last}")
    return result.stdout.decode("utf-8", errors="replace")


EXTRACTORS: dict[str, Callable[[Source, Path, bool], Iterator[tuple[str, str, str]]]] = {
    "man": extract_man,
    "html": extract_html,
    "json": extract_json,
    "austen": extract_austen,
    "bible": extract_bible,
    "descriptions": extract_descriptions,
}
