"""`hf-concept expand SRC DST --streams M`: grow a Hidden Decoding checkpoint to M streams.

M must be a multiple of the checkpoint's stream count; the new streams' embedding tables copy the
existing ones cyclically (the paper's eq. 5). A user error (a DST that cannot be written included) prints
one line to stderr and exits with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hf_concept.commands.convert import add_cross_stream_flags


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "expand",
        help="Grow a Hidden Decoding checkpoint's streams by cyclic replication.",
        description="Copy the embedding tables cyclically (E1..En, E1..En, ...) so that a checkpoint with "
        "n streams becomes one with M streams (M a multiple of n); the sliding window is scaled by M/n. "
        "The cross-stream mask and positions are the checkpoint's unless given; under token-block masks "
        "and token positions (the conversion default) the grown model computes what the checkpoint does.",
    )
    parser.add_argument("src", type=Path, help="Hidden Decoding checkpoint folder.")
    parser.add_argument("dst", type=Path, help="Destination folder (must not exist or be empty).")
    parser.add_argument("--streams", type=int, required=True, help="New number of streams M.")
    # Default None: keep the checkpoint's own cross-stream mask and positions.
    add_cross_stream_flags(parser, default_mask=None, default_positions=None)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    parser.add_argument("--max-shard-size", default="2GB", help="Largest shard, e.g. 2GB or 500MB.")
    parser.add_argument("--base-model", default=None, help="Name of the source in the model card.")
    parser.add_argument("--overwrite", action="store_true", help="Replace a non-empty DST.")


def run(args: argparse.Namespace) -> int:
    from hf_concept.conversion.hidden_decoding import expand_hidden_decoding
    from hf_concept.training.errors import failed_write_line

    try:
        destination = expand_hidden_decoding(
            args.src,
            args.dst,
            num_streams=args.streams,
            cross_stream_mask=args.cross_stream_mask,
            cross_stream_positions=args.cross_stream_positions,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
            base_model=args.base_model,
        )
    except ValueError as error:
        print(f"hf-concept expand: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        # A write into DST that failed (read-only, full disk) is worded with what to do; the writer has
        # already removed its staging folder, so nothing is left half-written.
        line = failed_write_line(error, args.dst, "DST") or str(error)
        print(f"hf-concept expand: error: {line}", file=sys.stderr)
        return 2
    print(f"wrote {destination}")
    return 0
