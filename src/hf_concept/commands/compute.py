"""`hf-concept compute CONFIG [--context L]`: per-token parameters and FLOPs of a ConceptMoE config against
its source (`hf_concept.compute` states the counting conventions), so that a variant can be matched in
compute as the paper does (§3.5, §4.5). CONFIG is a config.json file or a checkpoint folder. A user error
prints one line to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hf_concept.tables import format_table


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compute",
        help="Per-token parameters and FLOPs of a ConceptMoE config against its source.",
        description="Counts a ConceptMoE config's parameters, active parameters and FLOPs per token (matmul "
        "and attention at context L) and the same for the plain source it converts from, with ratios.",
    )
    parser.add_argument(
        "config", type=Path, help="config.json file or checkpoint folder (model_type conceptmoe)."
    )
    parser.add_argument("--context", type=int, default=4096, help="Context length L of the decoding step.")


def _load(path: Path):
    from hf_concept.modeling.configuration_conceptmoe import ConceptMoEConfig
    from hf_concept.planning import read_config_json

    values = read_config_json(path)
    if values.get("model_type") != "conceptmoe":
        raise ValueError(
            f"{str(path)!r} has model_type={values.get('model_type')!r}; compute needs 'conceptmoe'"
        )
    return ConceptMoEConfig.from_dict(values)


def render(report, source, context: int) -> str:
    rows = [
        ("parameters (M)", report.parameters / 1e6, source.parameters / 1e6),
        ("active parameters per token (M)", report.active_parameters / 1e6, source.active_parameters / 1e6),
        ("matmul GFLOP per token", report.matmul_flops / 1e9, source.matmul_flops / 1e9),
        (
            f"attention GFLOP per token at L={context}",
            report.attention_flops / 1e9,
            source.attention_flops / 1e9,
        ),
        ("total GFLOP per token", report.flops / 1e9, source.flops / 1e9),
    ]
    cells = [
        (name, f"{ours:.6g}", f"{theirs:.6g}", f"{ours / theirs:.3f}" if theirs else "-")
        for name, ours, theirs in rows
    ]
    headers = ("per token", "conceptmoe", "source", "ratio")
    return format_table(headers, cells, align="<>", widths=(None, 12, 12, 7))


def run(args: argparse.Namespace) -> int:
    from hf_concept.compute import conceptmoe_compute

    try:
        report, source = conceptmoe_compute(_load(args.config), args.context)
    except (ValueError, OSError) as error:
        print(f"hf-concept compute: error: {error}", file=sys.stderr)
        return 2
    print(render(report, source, args.context))
    return 0
