"""`hf-concept build-corpus` on a miniature package tree, through the same code path as the real build.

The tree mimics what `dpkg-deb -x` / the npm tarball / apt's Translation-ja leave: Austen's novels in an R
lazy-load database (written by R itself), a `bible` program that prints verses as the real one does, Sphinx
HTML pages, chinese-poetry JSON, roff man pages (plain, gzipped and a `.so` redirect) and a description
list. Needs groff and Rscript (scripts/setup.sh installs them).
"""

from __future__ import annotations

import gzip
import json
import stat
import subprocess
from pathlib import Path

import pytest
from datasets import load_from_disk

from hf_concept import cli
from hf_concept.data import corpus_builder, corpus_extract, corpus_sources
from hf_concept.data.corpus_builder import SPLITS, build_corpus, normalise_line, split_of

SOURCES = [
    "austen",
    "bible",
    "python-doc",
    "chinese-poetry",
    "manpages-ja",
    "descriptions-ja",
    "libreoffice-help-ja",
]
BOILERPLATE = "Copyright 2001 the Fake Software Foundation."
SHARED_VERSE = "And it was so."
HTML_DIR = "usr/share/doc/python3.11/html/library"


def _pages_in_every_split() -> list[str]:
    """Page names whose document ids fall in each split at least twice (the split hash is fixed)."""
    chosen: dict[str, list[str]] = {name: [] for name, _ in SPLITS}
    for index in range(10_000):
        name = f"module{index}.html"
        split = split_of(f"python3.11-doc:{HTML_DIR}/{name}")
        if len(chosen[split]) < 2:
            chosen[split].append(name)
        if all(len(names) == 2 for names in chosen.values()):
            return sorted(name for names in chosen.values() for name in names)
    raise AssertionError("the split hash never reached every split")


def _write_austen(root: Path) -> None:
    data = root / "r-cran-janeaustenr/usr/lib/R/site-library/janeaustenr/data"
    data.mkdir(parents=True)
    script = (
        "e <- new.env(); "
        "assign('emma', c('EMMA', '', 'Emma Woodhouse, handsome, clever, and rich.', '', 'CHAPTER I'), e); "
        "assign('persuasion', c('Persuasion', '', 'Sir Walter Elliot, of Kellynch Hall.', 'CHAPTER I'), e); "
        f"tools:::makeLazyLoadDB(e, '{data / 'Rdata'}')"
    )
    subprocess.run(["Rscript", "-e", script], check=True, capture_output=True)


def _write_bible(root: Path) -> None:
    (root / "bible-kjv-text/usr/lib").mkdir(parents=True)
    program = root / "bible-kjv/usr/bin/bible"
    program.parent.mkdir(parents=True)
    verses = [
        "Ge1:1 In the beginning God created the heaven and the earth.",
        f"Ge1:7 {SHARED_VERSE}",
        "Exo1:1 Now these are the names of the children of Israel.",
        f"Exo1:2 {SHARED_VERSE}",
        "Rev22:21 The grace of our Lord Jesus Christ be with you all. Amen.",
    ]
    program.write_text("#!/bin/sh\ncat <<'EOF'\n" + "\n".join(verses) + "\nEOF\n")
    program.chmod(program.stat().st_mode | stat.S_IXUSR)


def _write_html(root: Path, pages: list[str]) -> None:
    folder = root / "python3.11-doc" / HTML_DIR
    folder.mkdir(parents=True)
    for name in pages:
        (folder / name).write_text(
            "<html><head><title>t</title><script>var x = 1;</script></head><body>"
            '<div class="sphinxsidebar"><p>Navigation sidebar</p></div>'
            f'<div class="body" role="main"><h1>{name} &mdash; a module<a class="headerlink">¶</a></h1>'
            f"<p>The {name} module does   one thing\nwell.</p><pre>x = {len(name)}\n  y</pre>"
            f"<p>{BOILERPLATE}</p><p>{SHARED_VERSE}</p></div></body></html>",
            encoding="utf-8",
        )
    (folder / "genindex.html").write_text("<p>Index page, not text</p>")


def _write_poetry(root: Path) -> None:
    dist = root / "chinese-poetry/package/dist"
    (dist / "shijing").mkdir(parents=True)
    (dist / "strains/json").mkdir(parents=True)
    poems = [{"title": "关雎", "author": "佚名", "content": ["关关雎鸠，在河之洲。", "窈窕淑女，君子好逑。"]}]
    (dist / "shijing/shijing.json").write_text(json.dumps(poems, ensure_ascii=False), encoding="utf-8")
    (dist / "strains/json/poet.json").write_text(
        json.dumps([{"strains": ["仄仄平平仄"]}], ensure_ascii=False)
    )


def _write_man(root: Path) -> None:
    folder = root / "manpages-ja/usr/share/man/ja/man1"
    folder.mkdir(parents=True)
    page = (
        ".TH {name} 1\n.SH 名前\n{name} \\- {what}\n.SH 説明\n\\fB{name}\\fP は{what}。"
        " 長い行は groff が折り返すが 語の間を 空白で 埋めない ので 行は 左寄せの まま 読める。\n"
    )
    (folder / "ls.1").write_text(
        page.format(name="ls", what="ディレクトリの内容を表示する"), encoding="utf-8"
    )
    (folder / "cp.1.gz").write_bytes(
        gzip.compress(page.format(name="cp", what="ファイルをコピーする").encode())
    )
    (folder / "dir.1").write_text(".so man1/ls.1\n")
    dev = root / "manpages-ja-dev/usr/share/man/ja/man3"
    dev.mkdir(parents=True)
    (dev / "printf.3").write_text(page.format(name="printf", what="書式付きで出力する"), encoding="utf-8")


def _write_help(root: Path) -> None:
    folder = root / "libreoffice-help-ja/usr/share/libreoffice/help/ja/text/scalc"
    folder.mkdir(parents=True)
    (folder / "01.html").write_text(
        "<html><body><h1>データベース関数</h1><p>Untranslated English paragraph.</p>"
        '<p>関数は三つの引数を取ります。</p><span hidden="true">MAC only</span></body></html>',
        encoding="utf-8",
    )


def _write_descriptions(root: Path) -> None:
    folder = root / corpus_sources.TRANSLATION_JA
    folder.mkdir(parents=True)
    (folder / "Translation-ja").write_text(
        "Package: 0ad\nDescription-md5: d9\nDescription-ja: 古代戦争のゲーム\n 自由なゲームです。\n .\n"
        " 二段落目です。\n\nPackage: 2048-qt\nDescription-md5: 0f\nDescription-ja: パズルゲーム\n"
        " 自由なゲームです。\n .\n And it was so.\n",
        encoding="utf-8",
    )


@pytest.fixture(scope="module")
def package_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("packages")
    _write_austen(root)
    _write_bible(root)
    _write_html(root, _pages_in_every_split())
    _write_poetry(root)
    _write_man(root)
    _write_descriptions(root)
    _write_help(root)
    return root


@pytest.fixture(scope="module")
def built(package_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("built") / "corpus"
    build_corpus(output, source_names=SOURCES, package_root=package_root, progress=False)
    return output


def corpus_text(corpus, document: str) -> str:
    return next(row["text"] for split in corpus.values() for row in split if row["document"] == document)


def _lines(dataset) -> set[str]:
    return {normalise_line(line) for text in dataset["text"] for line in text.splitlines()} - {""}


def test_columns_values_and_provenance(built: Path) -> None:
    corpus = load_from_disk(str(built))
    assert sorted(corpus) == sorted(name for name, _ in SPLITS)
    rows = [row for split in corpus.values() for row in split]
    assert list(corpus["train"].column_names) == ["text", "language", "kind", "source", "document"]
    by_source = {(row["source"], row["language"], row["kind"]) for row in rows}
    assert by_source == {
        ("r-cran-janeaustenr", "en", "prose"),
        ("bible-kjv-text", "en", "prose"),
        ("python3.11-doc", "en", "technical"),
        ("chinese-poetry", "zh", "classical"),
        ("manpages-ja", "ja", "technical"),
        ("manpages-ja-dev", "ja", "technical"),
        (corpus_sources.TRANSLATION_JA, "ja", "prose"),
        ("libreoffice-help-ja", "ja", "technical"),
    }
    documents = {row["document"]: row["text"] for row in rows}
    # 6 + 1 HTML pages, 2 novels, 3 books, 1 run of poems (no strains), 3 man pages (no redirect), 2 packages
    assert len(documents) == 18
    assert "Navigation sidebar" not in "".join(documents.values()) and "var x" not in "".join(
        documents.values()
    )
    assert documents["bible-kjv-text:Exo"] == "Now these are the names of the children of Israel."
    assert (
        documents["chinese-poetry:package/dist/shijing/shijing.json#0"]
        == "关雎\n关关雎鸠，在河之洲。\n窈窕淑女，君子好逑。"
    )
    man = documents["manpages-ja:usr/share/man/ja/man1/cp.1.gz"]
    assert "cp - ファイルをコピーする" in man and "\\fB" not in man and ".TH" not in man
    # Left-adjusted: no run of spaces between words (only the indentation).
    assert all("  " not in line.strip() for line in man.splitlines()[1:-1]), man
    # The help's untranslated English line is dropped, as is the hidden element.
    help_page = "libreoffice-help-ja:usr/share/libreoffice/help/ja/text/scalc/01.html"
    assert documents[help_page] == "データベース関数\n関数は三つの引数を取ります。"
    assert documents["Translation-ja:0ad"] == "古代戦争のゲーム\n自由なゲームです。\n\n二段落目です。"
    provenance = json.loads((built / "provenance.json").read_text())
    total = sum(len(row["text"].encode()) for row in rows)
    assert (
        sum(v for split in provenance["bytes"].values() for lang in split.values() for v in lang.values())
        == total
    )
    assert {source["name"]: source["licence"] for source in provenance["sources"]}["chinese-poetry"] == "MIT"


def test_repeated_lines_removed_and_no_leak_between_splits(built: Path) -> None:
    corpus = load_from_disk(str(built))
    texts = [text for split in corpus.values() for text in split["text"]]
    all_lines = [normalise_line(line) for text in texts for line in text.splitlines() if line.strip()]
    assert len(all_lines) == len(set(all_lines))
    # SHARED_VERSE is in the Bible, every HTML page and a description: kept once, in the Bible (first).
    assert all_lines.count(BOILERPLATE) == 1 and all_lines.count(SHARED_VERSE) == 1
    assert SHARED_VERSE in corpus_text(corpus, "bible-kjv-text:Ge")
    assert all_lines.count("CHAPTER I") == 1 and all_lines.count("自由なゲームです。") == 1
    for other in ("validation", "held_out"):
        assert len(corpus[other]) > 0
        assert not set(corpus[other]["document"]) & set(corpus["train"]["document"])
        assert not _lines(corpus[other]) & _lines(corpus["train"])
        assert all(split_of(document) == other for document in corpus[other]["document"])


def test_a_poem_collection_is_cut_into_runs_of_whole_poems_spread_over_the_splits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collection kept whole in one file (as chinese-poetry keeps its Yuan qu) becomes documents of
    whole entries of at least the budget each, in order, and they land in more than one split: a file as
    the split unit put a whole genre in one split. A file whose top level is a dict is one entry."""
    dist = tmp_path / "chinese-poetry/package/dist"
    (dist / "yuanqu").mkdir(parents=True)
    pieces = [
        {"title": f"曲{index}", "author": "无名", "paragraphs": [f"第{index}首，一句。", f"又{index}句。"]}
        for index in range(400)
    ]
    (dist / "yuanqu/yuanqu.json").write_text(json.dumps(pieces, ensure_ascii=False), encoding="utf-8")
    book = {"title": "蒙学", "content": [{"chapter": "一", "paragraphs": ["人之初，性本善。"]}]}
    (dist / "yuanqu/book.json").write_text(json.dumps(book, ensure_ascii=False), encoding="utf-8")
    monkeypatch.setattr(corpus_extract, "POETRY_DOCUMENT_BYTES", 300)
    source = next(source for source in corpus_sources.SOURCES if source.name == "chinese-poetry")
    documents = list(corpus_extract.extract_source(source, tmp_path, progress=False))
    assert documents[0].document == "chinese-poetry:package/dist/yuanqu/book.json#0"
    assert documents[0].text == "蒙学\n一\n人之初，性本善。"
    runs = documents[1:]
    assert [run.document for run in runs] == [
        f"chinese-poetry:package/dist/yuanqu/yuanqu.json#{index}" for index in range(len(runs))
    ]
    entries = ["\n".join([piece["title"], *piece["paragraphs"]]) for piece in pieces]
    assert "\n".join(run.text for run in runs) == "\n".join(entries)
    for run in runs:
        # Every run starts at a title and ends at an entry's last line; all but the last reach the budget.
        lines = run.text.split("\n")
        assert lines[0].startswith("曲") and lines[-1].startswith("又")
    assert all(len(run.text.encode()) + 1 >= 300 for run in runs[:-1])
    assert 10 < len(runs) < 400
    assert len({split_of(run.document) for run in runs}) > 1


def test_two_builds_are_identical(built: Path, package_root: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    build_corpus(again, source_names=SOURCES, package_root=package_root, progress=False)
    first, second = load_from_disk(str(built)), load_from_disk(str(again))
    for name, _ in SPLITS:
        assert first[name].to_dict() == second[name].to_dict()
    assert (built / "provenance.json").read_text() == (again / "provenance.json").read_text()


def test_interrupted_build_leaves_no_output(package_root: Path, tmp_path: Path, monkeypatch) -> None:
    real_save = corpus_builder._save

    def save_then_die(rows, staging: Path) -> None:
        real_save(rows, staging)
        raise KeyboardInterrupt

    monkeypatch.setattr(corpus_builder, "_save", save_then_die)
    output = tmp_path / "corpus"
    with pytest.raises(KeyboardInterrupt):
        build_corpus(output, source_names=["bible"], package_root=package_root, progress=False)
    assert not output.exists()
    assert list(tmp_path.iterdir()) == []


def test_refuses_non_empty_output_dir(package_root: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "mine.txt").write_text("keep me")
    argv = [
        "build-corpus",
        str(tmp_path / "corpus"),
        "--package-root",
        str(package_root),
        "--sources",
        "bible",
    ]
    assert cli.main(argv) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli.main([*argv, "--overwrite", "--no-progress"]) == 0
    assert not (tmp_path / "corpus" / "mine.txt").exists()
    corpus = load_from_disk(str(tmp_path / "corpus"))
    assert sum(len(split) for split in corpus.values()) == 3


@pytest.mark.parametrize(
    ("missing", "sources", "fetching", "command"),
    [
        ("groff", ["manpages-ja"], False, "apt-get install -y groff-base"),
        ("Rscript", ["austen"], False, "apt-get install -y --no-install-recommends r-base-core"),
        ("npm", ["chinese-poetry"], True, "apt-get install -y npm"),
    ],
)
def test_missing_client_is_one_line(
    package_root, tmp_path, monkeypatch, capsys, missing, sources, fetching, command
):
    real_which = corpus_sources.shutil.which
    monkeypatch.setattr(
        corpus_sources.shutil, "which", lambda tool: None if tool == missing else real_which(tool)
    )
    argv = [
        "build-corpus",
        str(tmp_path / "corpus"),
        "--sources",
        *sources,
        "--cache-dir",
        str(tmp_path / "c"),
    ]
    if not fetching:
        argv += ["--package-root", str(package_root)]
    assert cli.main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and f"`{missing}` not found" in error and command in error
    assert not (tmp_path / "corpus").exists() and not (tmp_path / "c").exists()


def _deb_of(tree: Path, package: str, folder: Path) -> None:
    """Pack the fixture's tree of `package` as `<package>_1.0_all.deb` in `folder` (a fetched package)."""
    staging = folder / f".{package}"
    subprocess.run(["cp", "-a", str(tree / package), str(staging)], check=True)
    (staging / "DEBIAN").mkdir()
    control = f"Package: {package}\nVersion: 1.0\nArchitecture: all\nMaintainer: t <t@t>\nDescription: t\n"
    (staging / "DEBIAN" / "control").write_text(control)
    deb = folder / f"{package}_1.0_all.deb"
    subprocess.run(
        ["dpkg-deb", "--build", "--root-owner-group", str(staging), str(deb)], check=True, capture_output=True
    )


def test_a_subset_of_debian_sources_builds_from_fetched_packages(package_root: Path, tmp_path: Path) -> None:
    """The README's `--sources bible austen`: Debian packages only, unpacked from the package cache (the
    fetch path, no --package-root), whatever the order the sources sort in."""
    cache = tmp_path / "cache"
    (cache / "debian").mkdir(parents=True)
    for package in ("bible-kjv-text", "bible-kjv", "r-cran-janeaustenr"):
        _deb_of(package_root, package, cache / "debian")
    argv = ["build-corpus", str(tmp_path / "corpus"), "--sources", "bible", "austen"]
    assert cli.main([*argv, "--cache-dir", str(cache), "--no-progress"]) == 0
    corpus = load_from_disk(str(tmp_path / "corpus"))
    documents = {row["document"] for split in corpus.values() for row in split}
    packages = {name.split(":")[0] for name in documents}
    assert packages == {"r-cran-janeaustenr", "bible-kjv-text"}, documents
    provenance = json.loads((tmp_path / "corpus" / "provenance.json").read_text())
    assert "1.0" in json.dumps(provenance)
