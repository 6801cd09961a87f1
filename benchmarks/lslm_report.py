"""The tables and verdicts of `reproduce_lslm.py`: scores per model and cell, paired differences, each
LSLM under the evaluation segmentations, boundary rates and agreement with gold starts, wall time, and
the directions (the paper's, and the bands the hierarchy is held to)."""

from __future__ import annotations

import argparse

import eval_bits_per_byte as runner
from eval_bits_per_byte import cell, mean_std
from lslm_rows import EVAL_SEGMENTATIONS, band_verdicts, own_minus

from hf_concept.tables import format_table

# Models whose boundaries a router decides (boundary tables), every LSLM row (evaluation segmentations),
# and the count references (no training, no timing).
ROUTED = ("lslm", "dtp", "segmental")
LSLM_ROWS = ("lslm", "dtp", "every", "random", "segmental")
REFERENCES = ("unigram", "bigram")
PAIRS = (
    ("lslm", "byte"),
    ("lslm", "gpt2"),
    ("dtp", "byte"),
    ("lslm", "dtp"),
    ("byte", "gpt2"),
    ("every", "byte"),
    ("random", "byte"),
    ("lslm", "random"),
    ("segmental", "byte"),
    ("segmental", "lslm"),
    ("lslm", "unigram"),
    ("byte", "bigram"),
)
RATE_TOLERANCE = 0.2


def by_model(runs: list[dict]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = {}
    for run in runs:
        grouped.setdefault(run["model"], []).append(run)
    return grouped


def print_score_tables(runs: list[dict], split: str) -> None:
    grouped, cells = by_model(runs), list(runs[0]["bits_per_byte"])
    fields = (
        ("bits_per_byte", "bits per byte (softmax over the 256 byte ids)"),
        ("bits_per_byte_all_ids", "bits per byte (softmax over all 261 ids, the earlier reports' figure)"),
        ("bits_per_char", "bits per character (byte-id softmax)"),
    )
    for field, title in fields:
        print(f"\n[{split} {title}] mean ± std over seeds")
        rows = [
            [name, *(cell([r[field][lang] for r in group]) for lang in cells)]
            for name, group in grouped.items()
        ]
        print(format_table(["model", *cells], rows, align="<>", widths=(9, *[18] * len(cells)), sep=""))
    print("\n[paired differences, bits per byte] per seed (same batches), mean ± std; < 0: first is better")
    rows = []
    for first, second in PAIRS:
        if first not in grouped or second not in grouped:
            continue
        pairs = list(zip(grouped[first], grouped[second], strict=True))
        texts = [
            cell([a["bits_per_byte"][lang] - b["bits_per_byte"][lang] for a, b in pairs]) for lang in cells
        ]
        rows.append([f"{first}-{second}", *texts])
    print(format_table(["pair", *cells], rows, align="<>", widths=(14, *[18] * len(cells)), sep=""))


def rate_rows(group: list[dict]) -> dict[str, list[float]]:
    return dict(
        sampled=[run["train_rates"]["boundary_rate"] for run in group],
        mean_q=[run["train_rates"]["expected_boundary_rate"] for run in group],
        heldout=[run["heldout"]["pooled_rate"] for run in group],
        ratio=[run["heldout"]["pooled_rate"] / run["train_rates"]["boundary_rate"] for run in group],
    )


def print_boundary_tables(runs: list[dict], split: str) -> None:
    grouped = {name: group for name, group in by_model(runs).items() if name in ROUTED}
    cells = list(runs[0]["bits_per_byte"])
    print(f"\n[boundary rate: training (last 10% of steps) vs {split} inference, all languages pooled]")
    titles = ("model", "train sampled", "train mean q", f"{split} rate", "ratio", "within ±20%")
    table = []
    for name, group in grouped.items():
        rows = rate_rows(group)
        within = all(abs(ratio - 1) <= RATE_TOLERANCE for ratio in rows["ratio"])
        figures = [cell(rows[key]) for key in ("sampled", "mean_q", "heldout", "ratio")]
        table.append([name, *figures, f"{'yes' if within else 'NO'} (every seed)"])
    widths = (9, 16, 16, 16, 16, None)
    print(format_table(titles, table, align="<>>>><", widths=widths, sep=("", "", "", "", "  ")))
    print(f"\n[{split} segmentation] opens vs word starts (en), UTF-8 character starts (zh, ja)")
    print("(gold rate: the share of gold bytes, i.e. the precision of segments opened at random)")
    header = ("model", "lang", "rate", "bytes/seg", "precision", "recall", "gold rate", "<nxt> bits/B")
    keys = ("rate", "bytes_per_segment", "precision", "recall", "gold_rate", "boundary_bits")
    table = []
    for name, group in grouped.items():
        for language in cells:
            figures = [run["heldout"]["languages"][language] for run in group]
            table.append([name, language, *(cell([c[key] for c in figures]) for key in keys)])
    print(format_table(header, table, align="<>", widths=(6, 13, *[16] * len(keys)), sep=""))
    print(
        f"\n[{split} examples, seed {runs[0]['seed']}] '|': a segment opens at the character; '·': inside it"
    )
    for name, group in grouped.items():
        for language in cells:
            print(f"{name:<5} {language}: {group[0]['heldout']['languages'][language]['example']}")


def print_timings(runs: list[dict], wall: float, args: argparse.Namespace) -> None:
    print(f"\n[wall time] {args.threads} torch threads, seeds {','.join(map(str, args.seeds))}")
    rows = []
    for name, group in by_model(runs).items():
        if name in REFERENCES:
            continue
        train_s, eval_s = [r["train_seconds"] for r in group], [r["eval_seconds"] for r in group]
        rows.append([name, cell(train_s, 1), cell(eval_s, 1), f"{sum(train_s) + sum(eval_s):.1f}"])
    headers = ("model", "train s/seed", "eval s/seed", "all seeds s")
    print(format_table(headers, rows, align="<>", widths=(6, 16, 16, 14), sep=""))
    print(f"total wall time: {wall:.1f} s ({wall / 60:.1f} min)")


def directions(runs: list[dict]) -> dict[str, bool | str]:
    """The paper's directions (held-out or validation, as run): "LSLM below a model" per cell is
    `runner.paired_verdict` on the per-seed paired differences (same seed, same batches); English's
    "about equal to the byte baseline" and the segment checks are yes / no. A direction whose rows were
    not run (`--models`) is left out."""
    grouped = by_model(runs)

    def stats(name: str, language: str) -> tuple[float, float]:
        return mean_std([run["bits_per_byte"][language] for run in grouped[name]])

    def below(name: str, language: str) -> str:
        differences = runner.seed_differences(
            grouped["lslm"], grouped[name], lambda run: run["bits_per_byte"][language]
        )
        return runner.paired_verdict(differences)

    cells = list(runs[0]["bits_per_byte"])
    verdict: dict[str, bool | str] = {}
    if "lslm" not in grouped:
        return verdict
    verdict.update({
        f"lslm<{baseline} {lang}": below(baseline, lang)
        for baseline in ("gpt2", "byte")
        for lang in cells
        if lang.split("/")[0] in ("zh", "ja") and baseline in grouped
    })  # fmt: skip
    for lang in (name for name in cells if name.split("/")[0] == "en" and "byte" in grouped):
        verdict[f"lslm<=byte+1std {lang}"] = stats("lslm", lang)[0] <= sum(stats("byte", lang))
    if "dtp" in grouped:
        verdict.update({f"lslm<dtp {lang}": below("dtp", lang) for lang in cells})
    verdict.update(hierarchy_directions(grouped, cells))
    for name in (name for name in ROUTED if name in grouped):
        verdict[f"{name} precision>chance all"] = all(
            c["precision"] > c["gold_rate"]
            for run in grouped[name]
            for c in run["heldout"]["languages"].values()
        )
        verdict[f"{name} rate within ±20%"] = all(
            abs(r - 1) <= RATE_TOLERANCE for r in rate_rows(grouped[name])["ratio"]
        )
    return verdict


def print_segmentation_tables(runs: list[dict], split: str) -> None:
    """Each LSLM row scored under its own ends, random ends at the same rate and every byte's, and the
    paired differences own − swapped (< 0: its own ends are better)."""
    grouped = {name: group for name, group in by_model(runs).items() if name in LSLM_ROWS}
    cells = list(runs[0]["bits_per_byte"])
    print(f"\n[{split} bits per byte under other evaluation segmentations] the same trained model")
    rows, pairs = [], []
    for name, group in grouped.items():
        for source in EVAL_SEGMENTATIONS:
            scores = [run["eval_segmentations"]["scores"][source] for run in group]
            rows.append([name, source, *(cell([score[lang] for score in scores]) for lang in cells)])
        for source in EVAL_SEGMENTATIONS[1:]:
            values = own_minus(group, source)
            pairs.append([name, f"own−{source}", *(cell(values[lang]) for lang in cells)])
    widths = (10, 8, *[18] * len(cells))
    print(format_table(["model", "ends", *cells], rows, align="<<>", widths=widths, sep=""))
    print(format_table(["model", "pair", *cells], pairs, align="<<>", widths=widths, sep=""))
    rates = [
        f"{name} {cell([run['eval_segmentations']['random_rate'] for run in group])}"
        for name, group in grouped.items()
    ]
    print("random ends' rate: " + "; ".join(rates))


def hierarchy_directions(grouped: dict[str, list[dict]], cells: list[str]) -> dict[str, bool]:
    """The bands (`lslm_rows.band_verdicts`) on the reproduction's rows: "every" and "lslm" (the router's
    ends) against the byte decoder, and the LSLM's own ends against random ends at its rate."""

    def minus_byte(name: str) -> dict[str, list[float]] | None:
        if name not in grouped or "byte" not in grouped:
            return None
        return {
            lang: runner.seed_differences(
                grouped[name], grouped["byte"], lambda run, lang=lang: run["bits_per_byte"][lang]
            )
            for lang in cells
        }

    return band_verdicts(minus_byte("every"), minus_byte("lslm"), own_minus(grouped["lslm"], "random"))
