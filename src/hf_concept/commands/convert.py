"""`hf-concept convert <target> SRC DST`: turn a local source checkpoint into one of our families.

Targets are sub-subcommands ("conceptmoe", "hidden-decoding"); each maps its flags onto the keyword
arguments of a converter in `hf_concept.conversion`. A user error (bad option, unsupported source,
existing destination, a destination that is or holds the source, corrupt shard, a DST that cannot be
written) prints one line to stderr and exits with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path


def _loop(text: str) -> list[int]:
    parts = text.split(":")
    if len(parts) != 3 or not all(part.strip().lstrip("-").isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"--loop={text!r} must be START:END:TIMES, three integers")
    return [int(part) for part in parts]


def _ratio(text: str) -> float:
    """--ratio R, tokens per concept: a finite number >= 1 (1 only with --chunking fixed). Its upper
    bound, the source's max_position_embeddings, is checked with the config."""
    try:
        ratio = float(text)
    except ValueError:
        ratio = math.nan
    if not (math.isfinite(ratio) and ratio >= 1):
        raise argparse.ArgumentTypeError(
            f"--ratio={text!r} must be a finite number >= 1 (tokens per concept)"
        )
    return ratio


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("convert", help="Convert a local checkpoint into an hf_concept family.")
    targets = parser.add_subparsers(dest="target", metavar="TARGET", required=True)
    _add_conceptmoe(targets)
    _add_hidden_decoding(targets)


def _add_output_flags(parser: argparse.ArgumentParser) -> None:
    """Flags every target shares: output dtype and shards, card name, overwrite, pickle opt-in."""
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    parser.add_argument("--max-shard-size", default="2GB", help="Largest shard, e.g. 2GB or 500MB.")
    parser.add_argument("--base-model", default=None, help="Name of the source in the model card.")
    parser.add_argument("--overwrite", action="store_true", help="Replace a non-empty DST.")
    parser.add_argument(
        "--allow-pickle", action="store_true", help="Read .bin (pickle) weights; only for trusted sources."
    )
    parser.add_argument(
        "--gguf-file", default=None, metavar="NAME", help="The .gguf file to read in a SRC folder of several."
    )


def _add_conceptmoe(targets: argparse._SubParsersAction) -> None:
    parser = targets.add_parser(
        "conceptmoe",
        help="Llama/Mistral/Qwen2/Qwen3/Mixtral/Qwen-MoE checkpoint -> ConceptMoE checkpoint.",
        description="Split the source's layers into encoder / concept / decoder stages, add the chunk "
        "module and zero-initialised joint-decoding projectors, and write a remote-code checkpoint.",
    )
    parser.add_argument("src", type=Path, help="Source checkpoint folder (safetensors), or a .gguf file.")
    parser.add_argument("dst", type=Path, help="Destination folder (must not exist or be empty).")
    parser.add_argument(
        "--encoder-layers", type=int, default=2, help="Token-level layers before (default 2)."
    )
    parser.add_argument("--decoder-layers", type=int, default=2, help="Token-level layers after (default 2).")
    parser.add_argument("--ratio", type=_ratio, default=2.0, help="Target tokens per concept R (default 2).")
    parser.add_argument("--chunking", choices=("dynamic", "fixed"), default="dynamic")
    parser.add_argument(
        "--joint-decoding-layers", type=int, default=None, help="Last J decoder layers read concepts."
    )
    parser.add_argument(
        "--loop",
        type=_loop,
        default=None,
        metavar="START:END:TIMES",
        help="Run concept layers [START, END) TIMES extra times (no new parameters).",
    )
    parser.add_argument(
        "--experts-per-token",
        type=int,
        default=None,
        help="Top-k of the concept layers of a MoE source (§3.5: compute saved by chunking goes there); "
        "encoder and decoder keep the source's.",
    )
    parser.add_argument("--router", choices=("cosine", "linear"), default="cosine")
    parser.add_argument("--router-init", choices=("random", "identity"), default="random")
    parser.add_argument("--pooling", choices=("first", "sum", "mean"), default="first")
    parser.add_argument(
        "--rank-window",
        type=int,
        default=None,
        metavar="W",
        help="Dynamic chunking decides on each router probability's rank among the last W tokens of its "
        "document, so every language gets about one concept per R tokens (default: the converter's, 64; "
        "0: one threshold on the probabilities for every text).",
    )
    parser.add_argument(
        "--fixed-bonus",
        type=float,
        default=0.0,
        metavar="B",
        help="Add B to the router's probability where fixed chunks open (every R-th token) before the "
        "ranks: a learned router held near fixed chunks (boundary_fixed_bonus; integer --ratio; default 0).",
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the chunk module's random init.")
    _add_output_flags(parser)
    parser.set_defaults(convert=_convert_conceptmoe)


def _add_hidden_decoding(targets: argparse._SubParsersAction) -> None:
    parser = targets.add_parser(
        "hidden-decoding",
        help="Llama/Mistral/Qwen2/Qwen3/Mixtral/Qwen-MoE checkpoint -> Hidden Decoding checkpoint.",
        description="Replicate the embedding table into one table per stream, choose each layer's stream "
        "attention (intra / local / full) and write a remote-code checkpoint.",
    )
    parser.add_argument("src", type=Path, help="Source checkpoint folder (safetensors), or a .gguf file.")
    parser.add_argument("dst", type=Path, help="Destination folder (must not exist or be empty).")
    parser.add_argument("--streams", type=int, required=True, help="Number of hidden streams n.")
    parser.add_argument(
        "--layout",
        default=None,
        metavar="PATTERN",
        help="Stream attention per layer: kinds or letters i/l/f, comma-separated, each optionally *TIMES "
        "(e.g. 'intra,intra,intra,full', 'iiif*2'); must give one entry per layer. Default: the source's "
        "sliding-window layers are local, every K-th other layer full, the rest intra; a source whose "
        "layers all slide gets every K-th layer local and the rest intra (windowed like the source).",
    )
    parser.add_argument(
        "--cross-every",
        type=int,
        default=4,
        metavar="K",
        help="Default layout: every K-th layer is cross-stream (full; local when all source layers slide).",
    )
    windows = parser.add_mutually_exclusive_group()
    windows.add_argument(
        "--local-window",
        type=int,
        default=None,
        metavar="TOKENS",
        help="Tokens a local layer sees (default: the source's sliding window).",
    )
    windows.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        metavar="POSITIONS",
        help="The local window in expanded positions (n per token) instead of tokens.",
    )
    parser.add_argument(
        "--intra-stream-positions",
        choices=("token", "expanded"),
        default="token",
        help="RoPE positions in intra layers: 'token' (default: as the source was trained) or the paper's "
        "'expanded' (p*n + k), which a pretrained source has not seen and which raises its loss",
    )
    add_cross_stream_flags(parser, default_mask="token_block", default_positions="token")
    parser.add_argument("--stream-kv", choices=("per_stream", "shared"), default="per_stream")
    _add_output_flags(parser)
    parser.set_defaults(convert=_convert_hidden_decoding)


def add_cross_stream_flags(parser: argparse.ArgumentParser, default_mask, default_positions) -> None:
    """--cross-stream-mask and --cross-stream-positions (shared by `convert hidden-decoding` and `expand`)."""
    parser.add_argument(
        "--cross-stream-mask",
        choices=("token_block", "causal"),
        default=default_mask,
        help="Which keys local/full layers see: 'token_block' (every stream of a token sees all streams of "
        "that token and the earlier ones; with token positions the converted model computes the source's "
        "logits at any n) or the paper's 'causal' over the expanded sequence (changes what the source "
        "computes when n > 1)",
    )
    parser.add_argument(
        "--cross-stream-positions",
        choices=("token", "expanded"),
        default=default_positions,
        help="RoPE positions in local/full layers: 'token' (p, as the source was trained) or the paper's "
        "'expanded' (p*n + k). The paper's form is --cross-stream-mask causal --cross-stream-positions "
        "expanded --intra-stream-positions expanded",
    )


def run(args: argparse.Namespace) -> int:
    from hf_concept.conversion.gguf_source import source_folder
    from hf_concept.training.errors import failed_write_line

    try:
        # A GGUF source is de-quantised into a temporary safetensors folder for the converter to read.
        with source_folder(args.src, args.gguf_file, destination=args.dst) as source:
            if source.gguf is not None:
                args.src, args.base_model = source.folder, args.base_model or str(source.gguf)
            destination = args.convert(args)
    except ValueError as error:
        print(f"hf-concept convert {args.target}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        # A write into DST that failed (read-only, full disk) is worded with what to do; the writer has
        # already removed its staging folder, so nothing is left half-written.
        line = failed_write_line(error, args.dst, "DST") or str(error)
        print(f"hf-concept convert {args.target}: error: {line}", file=sys.stderr)
        return 2
    print(f"wrote {destination}")
    return 0


def _convert_conceptmoe(args: argparse.Namespace) -> Path:
    from hf_concept.conversion.conceptmoe import convert_to_conceptmoe

    return convert_to_conceptmoe(
        args.src,
        args.dst,
        encoder_layers=args.encoder_layers,
        decoder_layers=args.decoder_layers,
        compression_ratio=args.ratio,
        chunking=args.chunking,
        joint_decoding_layers=args.joint_decoding_layers,
        concept_loop=args.loop,
        experts_per_token=args.experts_per_token,
        router=args.router,
        router_init=args.router_init,
        pooling=args.pooling,
        **({} if args.rank_window is None else {"rank_window": args.rank_window}),
        fixed_bonus=args.fixed_bonus,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        allow_pickle=args.allow_pickle,
        seed=args.seed,
        base_model=args.base_model,
    )


def _convert_hidden_decoding(args: argparse.Namespace) -> Path:
    from hf_concept.conversion.hidden_decoding import convert_to_hidden_decoding

    return convert_to_hidden_decoding(
        args.src,
        args.dst,
        num_streams=args.streams,
        stream_attention_layout=args.layout,
        cross_every=args.cross_every,
        sliding_window=args.sliding_window,
        local_window=args.local_window,
        intra_stream_positions=args.intra_stream_positions,
        cross_stream_mask=args.cross_stream_mask,
        cross_stream_positions=args.cross_stream_positions,
        stream_kv=args.stream_kv,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        allow_pickle=args.allow_pickle,
        base_model=args.base_model,
    )
