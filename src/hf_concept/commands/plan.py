"""`hf-concept plan BASELINE [--ratio R] [--concept-share P] [--law FIT.json --train-tokens D]`: size a
DLCM against a dense baseline.

Prints parameters, training FLOPs per token, inference FLOPs per token (attention map included and
excluded) and KV-cache bytes per token for the baseline, an optional given DLCM (`--dlcm`) and the best
DLCM shapes whose inference FLOPs per token match the baseline's (`hf_concept.planning` states the
counting conventions). BASELINE is a preset name, a config.json file or a checkpoint folder.

Which shapes are best: without a fitted law, R and P are the given ones, else the paper's choice
(R = 4, P = 0.6, §6.3; the paper publishes no eq. 22 constants), and the shapes closest in FLOPs win.
With `--law` (a file of `hf-concept fit-scaling --save` or `--json`), the candidates at every R of the
paper's grid (2, 4, 8; or the given R) and P in the paper's range 0.3–0.7 (or the given P) are ranked by
the law's predicted loss L(N, D, R, P) at D = `--train-tokens`, N the total parameters and P the concept
share, as the fitter's columns mean them. A user error prints one line to stderr and exits with status
2; a search that finds nothing exits with status 1.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from hf_concept import planning
from hf_concept.tables import format_table

MATCH_KINDS = ("with-attention", "without-attention")
# §6.3: the paper's configuration, used where neither a value nor a fitted law is given.
PAPER_RATIO, PAPER_SHARE = 4.0, "0.6"
# §6.2.1: the grid the paper fitted eq. 22 on, searched when a law is given without R or P.
LAW_RATIOS, LAW_SHARE = (2.0, 4.0, 8.0), "0.3:0.7"
EVERY_MATCH = 10**9


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    presets = ", ".join(planning.PRESETS)
    parser = subparsers.add_parser(
        "plan",
        help="FLOPs / parameters / KV-cache planner: DLCM shapes that match a baseline's inference FLOPs.",
        description="Compare a dense baseline with DLCM configurations at compression ratio R and concept "
        "share P (the concept layers' share of all parameters, the paper's eq. 22), and search widths and "
        f"layer splits that match the baseline's inference FLOPs per token. Baseline presets: {presets}.",
    )
    parser.add_argument("baseline", help="Preset name, config.json file or checkpoint folder.")
    parser.add_argument(
        "--ratio",
        type=float,
        default=None,
        help="Compression ratio R (tokens per concept); default: the paper's 4, or 2, 4 and 8 with --law.",
    )
    parser.add_argument(
        "--concept-share",
        default=None,
        help="Target P as a fraction (0.6) or a range (0.55:0.65); default: the paper's 0.6, or 0.3:0.7 "
        "with --law.",
    )
    parser.add_argument(
        "--law",
        default=None,
        help="A fitted eq. 22 law (fit-scaling --save or --json output): rank shapes by predicted loss.",
    )
    parser.add_argument(
        "--train-tokens", type=float, default=None, help="Training tokens D for --law's prediction."
    )
    parser.add_argument("--share-tolerance", type=float, default=0.05, help="P range half-width for a value.")
    parser.add_argument("--context", type=int, default=4096, help="Context length L for attention costs.")
    parser.add_argument("--dtype-bytes", type=int, default=2, help="Bytes per KV-cache entry (2 = bf16).")
    parser.add_argument("--top", type=int, default=5, help="How many DLCM configurations to print.")
    parser.add_argument(
        "--flops-tolerance", type=float, default=0.05, help="Allowed relative inference-FLOPs difference."
    )
    parser.add_argument(
        "--match", choices=MATCH_KINDS, default="with-attention", help="Which inference FLOPs to match."
    )
    parser.add_argument(
        "--cross-attention",
        choices=planning.CROSS_ATTENTION_FORMS,
        default="replicated",
        help="How training FLOPs count the cross-attention map (the kernel's replicated form by default).",
    )
    parser.add_argument(
        "--token-widths", default=None, help="Comma-separated d_token grid (default: search)."
    )
    parser.add_argument("--concept-widths", default=None, help="Comma-separated d_concept grid.")
    parser.add_argument(
        "--dlcm", default=None, help="A DLCM preset, config.json or folder to report as well."
    )


def _share_target(text: str) -> float | tuple[float, float]:
    try:
        parts = [float(part) for part in text.split(":")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2):
        raise ValueError(f"--concept-share={text!r} must be a fraction like 0.6 or a range like 0.55:0.65")
    return parts[0] if len(parts) == 1 else (parts[0], parts[1])


def _widths(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        widths = [int(part) for part in text.split(",")]
    except ValueError:
        widths = []
    if not widths or min(widths) <= 0:
        raise ValueError(f"{flag}={text!r} must be comma-separated positive integers")
    return widths


def _load(source: str, want_dlcm: bool) -> Any:
    spec = planning.load_spec(source)
    if want_dlcm and not isinstance(spec, planning.DLCMSpec):
        raise ValueError(f"--dlcm={source!r} is not a DLCM config (model_type 'dlcm' or a DLCM preset)")
    if not want_dlcm and isinstance(spec, planning.DLCMSpec):
        raise ValueError(
            f"BASELINE={source!r} is a DLCM config; pass it with --dlcm and give a dense baseline"
        )
    return spec


def _load_law(args: argparse.Namespace) -> Any:
    """The fitted main law of `--law` (None without it); `--train-tokens` goes with it."""
    if args.law is None:
        if args.train_tokens is not None:
            raise ValueError("--train-tokens is only used with --law (a fitted scaling law)")
        return None
    if args.train_tokens is None or not (math.isfinite(args.train_tokens) and args.train_tokens > 0):
        raise ValueError(
            f"--law needs --train-tokens D > 0 (the tokens to predict the loss at), got {args.train_tokens}"
        )
    from hf_concept.scaling import load_fit

    return load_fit(args.law, law="main")


def predicted_loss(law: Any, spec: Any, train_tokens: float) -> float | None:
    """Eq. 22's loss for a DLCM spec (N total parameters, P its concept share); None for the baseline."""
    if not isinstance(spec, planning.DLCMSpec):
        return None
    return law.predict(
        N=planning.parameter_count(spec),
        D=train_tokens,
        R=spec.compression_ratio,
        P=planning.concept_share(spec),
    )


def _candidates(args: argparse.Namespace, baseline: Any, law: Any) -> list[Any]:
    """The DLCM shapes to print, best first: by FLOPs match, or by the law's predicted loss."""
    ratios = [args.ratio] if args.ratio is not None else list(LAW_RATIOS if law else [PAPER_RATIO])
    share = args.concept_share or (LAW_SHARE if law else PAPER_SHARE)
    found = []
    for ratio in ratios:
        found += planning.search_dlcm(
            baseline,
            ratio,
            _share_target(share),
            share_tolerance=args.share_tolerance,
            context_length=args.context,
            flops_tolerance=args.flops_tolerance,
            include_attention=args.match == "with-attention",
            token_widths=_widths(args.token_widths, "--token-widths"),
            concept_widths=_widths(args.concept_widths, "--concept-widths"),
            # With a law, every FLOPs match is a candidate: the law, not the FLOPs error, ranks them.
            top_k=args.top if law is None else EVERY_MATCH,
        )
    if law is not None:
        found.sort(key=lambda candidate: predicted_loss(law, candidate.spec, args.train_tokens))
    args.searched = (ratios, share)
    return found[: args.top]


def _plan(args: argparse.Namespace) -> tuple[planning.BaselineSpec, list[tuple[str, Any, Any]]]:
    """The baseline and the (label, spec, report) rows to print, or ValueError on bad input."""
    baseline = _load(args.baseline, want_dlcm=False)
    given = [] if args.dlcm is None else [("given", _load(args.dlcm, want_dlcm=True))]
    args.fitted_law = law = _load_law(args)
    candidates = _candidates(args, baseline, law)
    specs = [("baseline", baseline), *given]
    specs += [(f"#{index}", candidate.spec) for index, candidate in enumerate(candidates, start=1)]
    rows = []
    for label, spec in specs:
        report = planning.cost_report(spec, args.context, args.dtype_bytes, args.cross_attention)
        rows.append((label, spec, report))
    return baseline, rows


def _shape_row(label: str, spec: Any) -> list[str]:
    if isinstance(spec, planning.BaselineSpec):
        heads = f"{spec.num_attention_heads}/{spec.num_key_value_heads}x{spec.head_dim}"
        return [label, "-", str(spec.hidden_size), "-", str(spec.num_hidden_layers), heads, "-", "-",
                str(spec.intermediate_size), "-"]  # fmt: skip
    layers = f"{spec.encoder_layers}/{spec.concept_layers}/{spec.decoder_layers}"
    return [
        label,
        f"{spec.compression_ratio:g}",
        str(spec.hidden_size),
        str(spec.concept_hidden_size),
        layers,
        f"{spec.num_attention_heads}/{spec.num_key_value_heads}x{spec.head_dim}",
        f"{spec.concept_num_attention_heads}/{spec.concept_num_key_value_heads}x{spec.concept_head_dim}",
        f"{spec.cross_num_attention_heads}/{spec.cross_num_key_value_heads}x{spec.cross_head_dim}",
        str(spec.intermediate_size),
        str(spec.concept_intermediate_size),
    ]


def _cost_row(label: str, report: planning.CostReport, base: planning.CostReport) -> list[str]:
    def with_ratio(value: float, reference: float, scale: float, unit: str, digits: int = 3) -> str:
        text = f"{value / scale:.{digits}f}{unit}"
        return text if label == "baseline" else f"{text} ({value / reference:.2f}x)"

    share = "-" if report.concept_share is None else f"{report.concept_share:.3f}"
    return [
        label,
        with_ratio(report.parameters, base.parameters, 1e9, "B"),
        share,
        with_ratio(report.training_flops_per_token, base.training_flops_per_token, 1e9, ""),
        with_ratio(report.inference_flops_per_token, base.inference_flops_per_token, 1e9, ""),
        with_ratio(
            report.inference_flops_per_token_without_attention,
            base.inference_flops_per_token_without_attention,
            1e9,
            "",
        ),
        with_ratio(report.kv_cache_bytes_per_token, base.kv_cache_bytes_per_token, 1024, "", digits=1),
    ]


def render(args: argparse.Namespace, rows: list[tuple[str, Any, Any]]) -> str:
    base = rows[0][2]
    shape_header = ["model", "R", "d_token", "d_concept", "layers e/c/d", "heads tok", "heads con",
                    "heads cross", "MLP tok", "MLP con"]  # fmt: skip
    cost_header = [
        "model",
        "params",
        "P",
        "train GFLOP/tok",
        "infer GFLOP/tok",
        "infer no-attn",
        "KV KiB/tok",
    ]
    cost_rows = [_cost_row(label, report, base) for label, _, report in rows]
    law = args.fitted_law
    if law is not None:
        cost_header.append("pred. loss")
        for row, (_, spec, _) in zip(cost_rows, rows, strict=True):
            loss = predicted_loss(law, spec, args.train_tokens)
            row.append("-" if loss is None else f"{loss:.4f}")
    ratios, share = args.searched
    found = len(rows) - 1 - (args.dlcm is not None)
    notes = (
        f"Baseline {args.baseline}; R = {', '.join(f'{ratio:g}' for ratio in ratios)}; target P {share} "
        f"(concept layers / all parameters, eq. 22); inference FLOPs {args.match} matched within "
        f"{args.flops_tolerance:.0%}; {found} best DLCM shown.\n{_ranking_note(args)}\n"
        f"Inference: one decoding step at context {args.context} (cross-attention over "
        f"{args.context}/R concept keys); training: 3 x forward over causal {args.context}-token "
        f"sequences, cross-attention {args.cross_attention}; KV cache {args.dtype_bytes} bytes per entry; "
        "ratios vs the baseline."
    )
    shapes = format_table(shape_header, [_shape_row(label, spec) for label, spec, _ in rows])
    costs = format_table(cost_header, cost_rows)
    return f"{notes}\n\nShapes (heads: query/KV x head dim)\n{shapes}\n\nCosts per token\n{costs}"


def _ranking_note(args: argparse.Namespace) -> str:
    law = args.fitted_law
    if law is None:
        paper = (("R", args.ratio, f"{PAPER_RATIO:g}"), ("P", args.concept_share, PAPER_SHARE))
        defaults = [f"{name} = {value}" for name, given, value in paper if given is None]
        used = f" The paper's choice (§6.3): {' and '.join(defaults)}." if defaults else ""
        return f"No fitted law (--law): ranked by FLOPs match, then P.{used}"
    return (
        f"Ranked by the fitted law {args.law} (eq. 22, R^2 {law.r2:.3f} over {law.rows} rows): "
        f"predicted loss at D = {args.train_tokens:.3g} tokens, N the total parameters."
    )


def run(args: argparse.Namespace) -> int:
    try:
        _, rows = _plan(args)
    except ValueError as error:
        print(f"hf-concept plan: error: {error}", file=sys.stderr)
        return 2
    print(render(args, rows))
    if len(rows) == 1 + (args.dlcm is not None):
        hint = "widen --flops-tolerance or --share-tolerance, or the width grids"
        print(f"hf-concept plan: no DLCM matched; {hint}", file=sys.stderr)
        return 1
    return 0
