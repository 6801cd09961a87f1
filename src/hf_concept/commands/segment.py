"""`hf-concept segment CHECKPOINT "text" ["text" ...]`: which tokens open a concept, as the model's forward
decides.

ConceptMoE, DLCM and LSLM checkpoints (`segmentation.SEGMENTED_MODEL_TYPES`): each text with each concept
(segment) marked — alternating ANSI background colours when stdout is a terminal, `|` before each opening
otherwise or with `--no-color` — then the tokens-per-concept statistics and histogram. `--html PATH`
writes one self-contained page for all the texts: per text the concepts and the boundary-probability
heatmap (`segmentation.render_page`). `--png PATH` draws one text (needs Pillow or matplotlib; checked
before the model loads). Hidden Decoding has no boundaries: its stream probe table
(`hf_concept.probes.probe_streams`) is printed instead, and `--html` writes a page that says so, with the
texts and their probe tables and no heatmap. The plain family (or any other model_type) has neither,
which is an error (exit 2) before the model loads, as are a missing folder or tokenizer, a text that is
not UTF-8, a `--device` torch cannot use here and a tokenizer that does not belong to the checkpoint
(`commands.checks`; `--skip-tokenizer-check` runs anyway).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from hf_concept.commands.checks import require_utf8
from hf_concept.commands.generate import add_loading_flags, load_checkpoint, read_model_type

HIDDEN_DECODING_MODEL_TYPE = "hidden_decoding"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "segment",
        help="Show where the model opens concepts in a text (HD: the stream probe table).",
        description="Run one forward of CHECKPOINT on TEXT and print the text with concept openings marked "
        "and tokens-per-concept statistics; for Hidden Decoding, the stream probe table.",
    )
    parser.add_argument("checkpoint", type=Path, help="Checkpoint folder (config, weights, tokenizer).")
    parser.add_argument("text", nargs="+", help="Text(s) to segment.")
    parser.add_argument(
        "--html",
        type=Path,
        default=None,
        metavar="PATH",
        help="Also write an HTML page: concepts and boundary-probability heatmap of every text.",
    )
    parser.add_argument(
        "--png", type=Path, default=None, metavar="PATH", help="Also write a PNG view (Pillow or matplotlib)."
    )
    parser.add_argument("--no-color", action="store_true", help="Mark openings with `|` even in a terminal.")
    add_loading_flags(parser)


def run(args: argparse.Namespace) -> int:
    try:
        return _segment(args)
    except (ValueError, OSError, ImportError) as error:
        print(f"hf-concept segment: error: {error}", file=sys.stderr)
        return 2


def _check_outputs(args: argparse.Namespace, model_type: str) -> None:
    """Refuse what cannot be shown or written before the model loads."""
    from hf_concept.segmentation import SEGMENTED_MODEL_TYPES, png_backend

    if model_type not in (*SEGMENTED_MODEL_TYPES, HIDDEN_DECODING_MODEL_TYPE):
        raise ValueError(
            f"{str(args.checkpoint)!r} has model_type={model_type!r}, which has no segmentation: segment "
            f"reads the boundaries of {', '.join(SEGMENTED_MODEL_TYPES)} checkpoints and prints the stream "
            "probe table of hidden_decoding ones"
        )
    if model_type == HIDDEN_DECODING_MODEL_TYPE and args.png is not None:
        raise ValueError(
            f"--png {args.png}: a Hidden Decoding checkpoint has no segmentation to draw; segment prints "
            "its stream probe table (and --html writes a page that says so)"
        )
    if args.png is not None and len(args.text) > 1:
        raise ValueError(
            f"--png {args.png} draws one text and {len(args.text)} were given; --html shows them all"
        )
    for path in (args.html, args.png):
        if path is not None and not path.parent.is_dir():
            raise FileNotFoundError(f"{str(path)!r}: the folder {str(path.parent)!r} does not exist")
    if args.png is not None and png_backend() is None:
        raise ImportError(
            f"--png {args.png}: drawing a PNG needs the optional dependency Pillow (pip install pillow) or "
            "matplotlib, and neither is installed; --html needs nothing"
        )


def _segment(args: argparse.Namespace) -> int:
    from hf_concept.segmentation import segment_text, write_html, write_png

    if not all(args.text):
        raise ValueError("text='': give some text to segment")
    for index, text in enumerate(args.text, start=1):
        require_utf8(text, f"TEXT {index}" if len(args.text) > 1 else "TEXT")
    model_type = read_model_type(args.checkpoint)
    _check_outputs(args, model_type)
    model, tokenizer = load_checkpoint(
        args.checkpoint, args.tokenizer, args.device, args.dtype, not args.skip_tokenizer_check
    )
    if model_type == HIDDEN_DECODING_MODEL_TYPE:
        return _probe_streams(args, model, tokenizer)
    views = [segment_text(model, tokenizer, text) for text in args.text]
    for index, view in enumerate(views):
        if index:
            print()
        print(view.to_text(color=sys.stdout.isatty() and not args.no_color))
        print(view.stats_text())
    if args.html is not None:
        write_html(views, args.html)
        print(f"wrote {args.html}")
    if args.png is not None:
        write_png(views[0], args.png)
        print(f"wrote {args.png}")
    return 0


def _probe_streams(args: argparse.Namespace, model: Any, tokenizer: Any) -> int:
    """Hidden Decoding: each text's stream probe table; with --html, a page that says there are no
    boundaries (no heatmap), with the texts and their tables."""
    from hf_concept.probes import probe_streams
    from hf_concept.segmentation import render_no_boundaries_page, write_page

    tables = [probe_streams(model, text=text, tokenizer=tokenizer).to_table() for text in args.text]
    print("\n\n".join(tables))
    if args.html is not None:
        reason = (
            f"Hidden Decoding has no boundaries: each token is expanded into num_streams="
            f"{model.config.num_streams} streams and no tokens are merged into concepts, so there is no "
            "boundary probability and no heatmap to draw. Under each text: the stream probe table "
            "(hf_concept.probes.probe_streams), each stream's top-1 next-token guess."
        )
        write_page(
            render_no_boundaries_page(HIDDEN_DECODING_MODEL_TYPE, args.text, reason, tables), args.html
        )
        print(f"wrote {args.html}")
    return 0
