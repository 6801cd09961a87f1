"""What `hf-concept build-corpus` fetches: one `Source` per corpus source (`SOURCES`), in a fixed order.

The order matters: repeated lines are removed keeping the first occurrence in this order, so it is part of
the corpus's definition. A source names its packages (Debian binary packages, one npm spec, or the apt
translation list), the language and kind of its text, its licence, and how its text is extracted.

A package tree is a folder laid out as `dpkg-deb -x` (or the npm tarball, or the translation list) leaves
it: `<package root>/<package>/usr/share/...`. The builder fetches and unpacks into such a root, or takes
one given with `--package-root` (the test builds a miniature one).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

LANGUAGES = ("en", "zh", "ja")
KINDS = ("prose", "technical", "classical")

DEBIAN = "debian"
NPM = "npm"
# Debian's translated package descriptions: a list that `apt-get update` fetches, not a package.
APT_TRANSLATION = "apt-translation"

# The npm spec is pinned: the corpus must not change under a rebuild.
CHINESE_POETRY = "chinese-poetry@2.0.1"
# Package-root folder of apt's description list in language LANG: `<root>/<prefix>LANG/Translation-LANG`.
TRANSLATION_PREFIX = "debian-descriptions-"
TRANSLATION_JA = TRANSLATION_PREFIX + "ja"
TRANSLATION_ZH = TRANSLATION_PREFIX + "zh_CN"


@dataclass(frozen=True)
class Source:
    """One corpus source: `name` is what `--sources` takes; `packages` are folder names in the root."""

    name: str
    registry: str
    packages: tuple[str, ...]
    language: str
    kind: str
    licence: str
    # Key of `corpus_extract.EXTRACTORS`.
    extractor: str
    # Globs relative to the first package's tree (man, html and json extractors).
    patterns: tuple[str, ...] = ()
    # Keep only lines with a character of the language's own script: LibreOffice's help ships the English
    # text of every paragraph not yet translated, which would carry the wrong language label.
    script_lines_only: bool = False


SOURCES: tuple[Source, ...] = (
    Source(
        "austen",
        DEBIAN,
        ("r-cran-janeaustenr",),
        "en",
        "prose",
        "public domain (texts), MIT (package)",
        "austen",
    ),
    Source(
        "bible",
        DEBIAN,
        ("bible-kjv-text", "bible-kjv"),
        "en",
        "prose",
        "public domain (text), GPL-2+ (package)",
        "bible",
    ),
    Source(
        "python-doc",
        DEBIAN,
        ("python3.11-doc",),
        "en",
        "technical",
        "PSF-2.0",
        "html",
        ("usr/share/doc/python3.11/html/**/*.html",),
    ),
    Source(
        "chinese-poetry",
        NPM,
        ("chinese-poetry",),
        "zh",
        "classical",
        "MIT",
        "json",
        ("package/dist/**/*.json",),
    ),
    Source(
        "manpages-zh",
        DEBIAN,
        ("manpages-zh",),
        "zh",
        "technical",
        "GFDL-1.2+ / GPL-2+",
        "man",
        ("usr/share/man/zh_CN/man*/*",),
    ),
    Source(
        "linux-doc-zh",
        DEBIAN,
        ("linux-doc-6.1",),
        "zh",
        "technical",
        "GPL-2",
        "html",
        ("usr/share/doc/linux-doc-6.1/html/translations/zh_CN/**/*.html",),
    ),
    Source(
        "debian-reference-zh",
        DEBIAN,
        ("debian-reference-zh-cn",),
        "zh",
        "technical",
        "GPL-2+",
        "html",
        ("usr/share/debian-reference/*.html",),
    ),
    # An addition to the planned sources: the zh-CN half of a package the Japanese sources fetch anyway, so
    # that modern Chinese gets nearer the 8 MB that classical Chinese passes many times over.
    Source(
        "debian-handbook-zh",
        DEBIAN,
        ("debian-handbook",),
        "zh",
        "technical",
        "GPL-2+ or CC-BY-SA-3.0",
        "html",
        ("usr/share/doc/debian-handbook/html/zh-CN/*.html",),
    ),
    # Also beyond the table, for modern Chinese: the counterparts of the Japanese manuals.
    Source(
        "libreoffice-help-zh",
        DEBIAN,
        ("libreoffice-help-zh-cn",),
        "zh",
        "technical",
        "MPL-2.0",
        "html",
        ("usr/share/libreoffice/help/zh-CN/text/**/*.html",),
        script_lines_only=True,
    ),
    Source(
        "debian-faq-zh",
        DEBIAN,
        ("debian-faq-zh-cn",),
        "zh",
        "technical",
        "Debian FAQ licence (verbatim and modified copies permitted)",
        "html",
        ("usr/share/doc/debian/FAQ/zh-cn/*.html",),
    ),
    Source(
        "maint-guide-zh",
        DEBIAN,
        ("maint-guide-zh-cn",),
        "zh",
        "technical",
        "GPL-2+",
        "html",
        ("usr/share/doc/maint-guide-zh-cn/html/*.html",),
    ),
    # Another addition: the Chinese counterpart of Debian's Japanese descriptions.
    Source(
        "descriptions-zh",
        APT_TRANSLATION,
        (TRANSLATION_ZH,),
        "zh",
        "prose",
        "per package (DDTP translations)",
        "descriptions",
    ),
    Source(
        "manpages-ja",
        DEBIAN,
        ("manpages-ja", "manpages-ja-dev"),
        "ja",
        "technical",
        "free, per page (DFSG)",
        "man",
        ("usr/share/man/ja/man*/*",),
    ),
    Source(
        "descriptions-ja",
        APT_TRANSLATION,
        (TRANSLATION_JA,),
        "ja",
        "prose",
        "per package (DDTP translations)",
        "descriptions",
    ),
    Source(
        "libreoffice-help-ja",
        DEBIAN,
        ("libreoffice-help-ja",),
        "ja",
        "technical",
        "MPL-2.0",
        "html",
        ("usr/share/libreoffice/help/ja/text/**/*.html",),
        script_lines_only=True,
    ),
    Source(
        "debian-reference-ja",
        DEBIAN,
        ("debian-reference-ja",),
        "ja",
        "technical",
        "GPL-2+",
        "html",
        ("usr/share/debian-reference/*.html",),
    ),
    Source(
        "debian-handbook-ja",
        DEBIAN,
        ("debian-handbook",),
        "ja",
        "technical",
        "GPL-2+ or CC-BY-SA-3.0",
        "html",
        ("usr/share/doc/debian-handbook/html/ja-JP/*.html",),
    ),
)

# Tool -> the command that installs it (Debian), for the one-line error of a missing client.
INSTALL_COMMANDS = {
    "apt-get": "apt-get is Debian's package client: build on Debian or pass --package-root",
    "dpkg-deb": "apt-get install -y dpkg",
    "npm": "apt-get install -y npm",
    "groff": "apt-get install -y groff-base",
    "Rscript": "apt-get install -y --no-install-recommends r-base-core",
}

# Tools each extractor runs (fetching tools are checked by `corpus_fetch`).
EXTRACTOR_TOOLS = {"man": ("groff",), "austen": ("Rscript",)}


class MissingToolError(RuntimeError):
    """A system command the build needs is not installed; the message names the command to run."""


def require_tool(tool: str, needed_for: str) -> str:
    """The path of `tool`, or a `MissingToolError` whose one line says how to install it."""
    path = shutil.which(tool)
    if path is None:
        raise MissingToolError(
            f"`{tool}` not found (needed for {needed_for}): run `{INSTALL_COMMANDS.get(tool, tool)}`"
        )
    return path


def select_sources(names: list[str] | None) -> tuple[Source, ...]:
    """The sources named (in the table's order, whatever the order given), or all of them."""
    if not names:
        return SOURCES
    known = {source.name for source in SOURCES}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(
            f"--sources: unknown source(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return tuple(source for source in SOURCES if source.name in names)
