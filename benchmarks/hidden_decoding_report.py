"""The Hidden Decoding reproduction's report stage (`benchmarks/reproduce_hidden_decoding.py` trains the
arms and calls this): the per-table held-out losses with paired differences against the source continued,
the paper's directions with their three-way verdicts, and the training-loss figure."""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

from hf_concept.tables import format_table

sys.path.insert(0, str(Path(__file__).resolve().parent))

import eval_bits_per_byte as runner
import reproduce_dlcm
from eval_bits_per_byte import signed_cell as signed
from eval_bits_per_byte import table_differences as paired
from eval_bits_per_byte import table_values as values

BASELINE = "source continued"
NOT_RUN = "not run"

# Table title -> (row label, arm) pairs; an arm may appear in several tables.
TABLES = {
    "[Table 5] supervision design (§5.1)": (
        ("baseline (n=1)", BASELINE),
        ("all-token loss (n=2)", "all-token loss (n=2)"),
        ("sum (n=2)", "sum (n=2)"),
        ("HD (n=2)", "HD (n=2)"),
        ("HD (n=3)", "HD (n=3)"),
    ),
    "[§4.3] expansion factor, direct and progressive": (
        ("n=1 (the source)", BASELINE),
        ("n=2", "HD (n=2)"),
        ("n=4 direct", "HD (n=4)"),
        ("n=4 progressive 1→2→4", "progressive 1→2→4"),
    ),
    "[§4.4] full cross-stream layers at n=4 (the rest intra)": (
        ("baseline (n=1)", BASELINE),
        ("1 full", "HD (n=4), 1 full layer"),
        ("some (default, 1 in 4)", "HD (n=4)"),
        ("all full", "HD (n=4), all full"),
    ),
    "[RoPE] intra-layer RoPE positions at n=4 (not in the paper)": (
        ("source", BASELINE),
        ("token positions (p)", "HD (n=4)"),
        ("expanded positions (p·n+k)", "HD (n=4), expanded positions"),
    ),
    "[Table 5 at n=4] supervision design at n=4 (not in the paper)": (
        ("baseline (n=1)", BASELINE),
        ("all-token loss (n=4)", "all-token loss (n=4)"),
        ("sum (n=4)", "sum (n=4)"),
        ("HD (n=4)", "HD (n=4)"),
    ),
}
# Paper figures, for the report. Table 5 (6B MoE): LM loss. Table 4 (21B MoE): mean benchmark gain over
# the baseline. Table 13 (80B MoE, progressive): Pile-test bits per byte. Not from the paper: held-out loss
# of a toy source converted to n = 4 before training, with expanded and with token intra positions.
PAPER = {
    "Table 5 loss": {"baseline": 1.908, "all-token (n=2)": 1.880, "sum (n=2)": 1.877, "HD (n=2)": 1.874,
                     "HD (n=3)": 1.857},
    "Table 4 mean gain": {"1 full": 1.55, "4 of 27 full": 2.16, "all 27 full": 2.62},
    "Table 13 Pile BPB": {"n=1": 0.386, "n=2": 0.387, "n=4": 0.382, "n=8": 0.378},
    "toy source converted to n=4, loss": {"source": 5.484, "expanded": 5.62, "token": 5.483},
}  # fmt: skip


def figures(runs: list[dict]) -> dict[str, dict[int, dict]]:
    """Arm -> seed -> held-out loss after conversion ("converted") and after continuing ("loss")."""
    table: dict[str, dict[int, dict]] = {}
    for run in runs:
        if run["part"] == "variant":
            table.setdefault(run["name"], {})[run["seed"]] = dict(
                converted=run["converted"], loss=run["heldout"]
            )
    return table


def print_table(title: str, rows: tuple, table: dict) -> None:
    print(f"\n{title}; Δ = paired difference against the source continued (same seed, same batches)")
    cells = []
    for label, name in rows:
        if name not in table:
            cells.append([label, NOT_RUN])
            continue
        converted, continued = (runner.cell(values(table, name, key), 4) for key in ("converted", "loss"))
        cells.append([label, converted, continued, signed(paired(table, name, BASELINE))])
    headers = ("arm", "right after conversion", "after continuing", "Δ")
    print(format_table(headers, cells, align="<>", widths=(28, 24, 20, 20), sep=""))


def print_progressive(runs: list[dict]) -> None:
    """The progressive arm's held-out loss around its expansion (eq. 5 should start near the n = 2 model)."""
    arms = [run for run in runs if run["part"] == "variant" and "before_expansion" in run]
    if arms:
        before = [run["before_expansion"] for run in arms]
        after = [run["after_expansion"] for run in arms]
        print(f"progressive 1→2→4 at its expansion: n=2 after half the steps {runner.cell(before, 4)}, "
              f"right after growing to n=4 {runner.cell(after, 4)}")  # fmt: skip


def below(table: dict, pairs: list[tuple[str, str]], key: str = "loss") -> dict | None:
    """`holds`: in every (lower, higher) pair the seed mean of the paired difference of `key` is below 0.
    `within_spread`: some pair's mean difference is no larger than its seeds' sample std, "no difference
    at this scale". `verdict`: `runner.chain_verdict` of the pairs'
    `runner.paired_verdict`s (unresolved within 2 std). None when a pair's arm was not run."""
    if any(name not in table for pair in pairs for name in pair):
        return None
    holds, within, verdicts = True, False, []
    for lower, higher in pairs:
        differences = paired(table, lower, higher, key)
        mean, std = runner.mean_std(differences)
        holds = holds and mean < 0
        within = within or abs(mean) <= std
        verdicts.append(runner.paired_verdict(differences))
    return dict(holds=holds, within_spread=within, verdict=runner.chain_verdict(verdicts))


def directions(table: dict) -> dict[str, dict | None]:
    """The paper's directions on the held-out loss after continuing (the RoPE one also after conversion);
    None where an arm one needs was not run."""
    hd2, hd4, expanded_positions = "HD (n=2)", "HD (n=4)", "HD (n=4), expanded positions"
    one_full, all_full = "HD (n=4), 1 full layer", "HD (n=4), all full"
    table_5 = ["HD (n=3)", hd2, "sum (n=2)", "all-token loss (n=2)", BASELINE]
    at_4 = [hd4, "sum (n=4)", "all-token loss (n=4)", BASELINE]
    verdict = {
        "Table 5: HD(3) < HD(2) < sum < all-token < baseline": below(
            table, list(itertools.pairwise(table_5))
        ),
        "Table 5: every n=2 arm < baseline": below(table, [(name, BASELINE) for name in table_5[1:4]]),
        "§4.3: loss falls with n (n=4 < n=2 < n=1)": below(table, [(hd4, hd2), (hd2, BASELINE)]),
        "§2.3: progressive 1→2→4 < direct n=4": below(table, [("progressive 1→2→4", hd4)]),
        "§4.4: 1 full layer < baseline": below(table, [(one_full, BASELINE)]),
        "§4.4: all full < some < 1 full": below(table, [(all_full, hd4), (hd4, one_full)]),
        "RoPE: token < expanded positions, right after conversion": below(
            table, [(hd4, expanded_positions)], "converted"
        ),
        "RoPE: token < expanded positions, after continuing": below(table, [(hd4, expanded_positions)]),
        "§4.4: some keeps most (> half) of all-full's gain over the baseline": None,
        "Table 5 at n=4: HD(4) < sum < all-token < baseline": below(table, list(itertools.pairwise(at_4))),
        "Table 5 at n=4: every n=4 arm < baseline": below(table, [(name, BASELINE) for name in at_4[:3]]),
    }
    if hd4 in table and all_full in table:
        some_gain = -statistics.fmean(paired(table, hd4, BASELINE))
        all_gain = -statistics.fmean(paired(table, all_full, BASELINE))
        # A ratio of two gains: no paired spread to compare it with.
        holds = all_gain > 0 and some_gain > all_gain / 2
        verdict["§4.4: some keeps most (> half) of all-full's gain over the baseline"] = dict(
            holds=holds, within_spread=False, verdict="yes" if holds else "no"
        )
    return verdict


def mean_curve(runs: list[dict], name: str) -> list[float]:
    """The prediction's training loss over continued training, smoothed and averaged over the seeds."""
    chosen = [run for run in runs if run["part"] == "variant" and run["name"] == name]
    return reproduce_dlcm.mean_smoothed(chosen, "lm_loss")


def draw(runs: list[dict], path: str) -> bool:
    """One panel per table with an arm run besides the source continued: each arm's training LM loss minus
    the source continued's, over the steps."""
    ran = {run["name"] for run in runs if run["part"] == "variant"}
    panels = {title: rows for title, rows in TABLES.items() if any(name in ran for _, name in rows[1:])}
    plt = runner.pyplot_or_none(path) if panels else None
    if plt is None:
        return False
    height = (len(panels) + 1) // 2
    figure, axes = plt.subplots(height, 2, figsize=(12, 4 * height), squeeze=False)
    for axis in axes.flat[len(panels) :]:
        axis.set_visible(False)
    baseline = mean_curve(runs, BASELINE)
    # The first 10% of the steps (warm-up after conversion) differ by whole nats: the plot starts after.
    start = len(baseline) // 10
    for axis, (title, rows) in zip(axes.flat, panels.items(), strict=False):
        for label, name in (row for row in rows if row[1] in ran):
            curve = mean_curve(runs, name)
            steps = range(start + 1, len(curve) + 1)
            axis.plot(
                steps, [a - b for a, b in zip(curve[start:], baseline[start:], strict=True)], label=label
            )
        axis.axhline(0, color="grey", linewidth=1)
        axis.set_title(title, fontsize=9)
        axis.set_xlabel("continued-training step")
        axis.set_ylabel("training LM loss − source continued (nats)")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def print_report(args: argparse.Namespace, runs: list[dict], wall: float) -> dict:
    """Print the source line, every table, the progressive arm's expansion and the directions; returns
    the directions."""
    table = figures(runs)
    pretrained = [run["pretrained"] for run in runs if run["part"] == "pretrain"]
    print(f"\nsource: Llama, width {args.width}, {args.layers} layers, {args.pretrain_steps} steps; held-out "
          f"loss {runner.cell(pretrained, 4)}; every arm continued {args.continue_steps} steps")  # fmt: skip
    for title, rows in TABLES.items():
        print_table(title, rows, table)
    print_progressive(runs)
    verdict = directions(table)
    answers = {key: runner.answer(value and value["verdict"]) for key, value in verdict.items()}
    print("\n[directions] " + "; ".join(f"{key}: {answer}" for key, answer in answers.items()))
    print(f"paper: {PAPER}")
    runner.print_wall_time(args, wall)
    return verdict
