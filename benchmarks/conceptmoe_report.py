"""The ConceptMoE reproduction's report stage (`benchmarks/reproduce_conceptmoe.py` trains the arms and
calls this): the compute table, the from-scratch and CT tables with paired differences, the paper's
directions with their three-way verdicts, and the training-curve figure.

The experiment's named settings live here too (the target ratio, the CT ratios, the from-scratch
configurations): the report reads them, and the training script imports them from this module so that the
report never imports the training stage."""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from hf_concept.tables import format_table

sys.path.insert(0, str(Path(__file__).resolve().parent))

import eval_bits_per_byte as runner
import reproduce_dlcm
from eval_bits_per_byte import signed_cell as signed
from eval_bits_per_byte import table_differences as paired
from eval_bits_per_byte import table_values as values

TARGET_RATIO = 2.0
CT_RATIOS = (1.5, 2.0)
# None: the plain MoE decoder; otherwise the ConceptMoEConfig fields that differ from the defaults.
SCRATCH = {
    "no-chunk": None,
    "dynamic": {},
    "fixed": dict(chunking="fixed"),
    "linear-router": dict(router="linear"),
    "no-joint": dict(joint_decoding_layers=0),
    "lambda-0.01": dict(aux_loss_weight=0.01),
    "lambda-0.1": dict(aux_loss_weight=0.1),
}
# The models the CT group reports.
CT_MODELS = ("source continued", *(f"converted R={ratio:g}" for ratio in CT_RATIOS))
NOT_RUN = "not run"
# Paper figures, for the report (ConceptMoE-A0.5B-12B, 243B tokens, R = 2): final training-loss gaps.
PAPER = {
    "dynamic - no-chunk (Fig. 8a)": -0.004,
    "fixed - no-chunk (Fig. 8a)": 0.01,
    "linear - cosine router (Fig. 9a)": -0.003,
    "no joint - joint decoding (Fig. 9a)": -0.002,
}


def final(history: list[dict], key: str) -> float:
    """The mean of `key` over the last 5% of the steps."""
    return reproduce_dlcm.at_fraction(history, key, 1.0)


def scratch_figures(runs: list[dict]) -> dict[str, dict[int, dict]]:
    """config → seed → its figures: held-out loss and ratios, final training LM loss and ratio."""
    table: dict[str, dict[int, dict]] = {}
    for entry in runs:
        if entry["part"] != "scratch":
            continue
        figures = dict(entry["heldout"], train_loss=final(entry["history"], "lm_loss"))
        if "inference_ratio" in entry["history"][-1]:
            figures["train_ratio"] = final(entry["history"], "inference_ratio")
        table.setdefault(entry["config"], {})[entry["seed"]] = figures
    return table


def ct_figures(runs: list[dict]) -> dict[str, dict[int, dict]]:
    """CT model name → seed → held-out loss after conversion and after continuing, and its ratios."""
    table: dict[str, dict[int, dict]] = {}
    for entry in runs:
        if entry["part"] != "ct":
            continue
        for model in entry["models"]:
            figures = dict(model["heldout"], converted_loss=model["converted"]["loss"])
            table.setdefault(model["name"], {})[entry["seed"]] = figures
    return table


def delta(table: dict[str, dict[int, dict]], name: str, baseline: str, key: str) -> str:
    """The paired difference's cell, "not run" without the baseline."""
    return signed(paired(table, name, baseline, key)) if baseline in table else NOT_RUN


def print_compute_table(rows: list[dict]) -> None:
    print("\n[compute] per token against the plain MoE source (hf_concept.compute, context = --context)")
    keys = ("parameters", "active_parameters", "matmul_flops", "flops")
    cells = [[row["config"], row["concept_top_k"], *(f"{row[key]:.3f}" for key in keys)] for row in rows]
    headers = ("configuration", "concept top-k", "params", "active", "matmul FLOPs", "all FLOPs")
    print(format_table(headers, cells, align="<>", widths=(16, 14, 10, 10, 14, 11), sep=""))


def print_scratch_table(table: dict[str, dict[int, dict]]) -> None:
    print(f"\n[§4.5] from scratch, target R = {TARGET_RATIO:g}; Δ = paired difference against no-chunk")
    cells = []
    for name in SCRATCH:
        if name not in table:
            cells.append([name, NOT_RUN])
            continue
        ratios = [
            runner.cell(values(table, name, key), 2) if key in table[name][min(table[name])] else "—"
            for key in ("inference_ratio", "sampled_ratio", "train_ratio")
        ]
        losses = [(runner.cell(values(table, name, key), 4), delta(table, name, "no-chunk", key))
                  for key in ("loss", "train_loss")]  # fmt: skip
        cells.append([name, *losses[0], *losses[1], *ratios])
    headers = ("configuration", "held-out loss", "Δ held-out", "train loss", "Δ train", "inference R",
               "sampled R", "train R (end)")  # fmt: skip
    print(format_table(headers, cells, align="<>", widths=(15, 18, 20, 18, 20, 14, 14, 16), sep=""))


def print_ct_table(table: dict[str, dict[int, dict]]) -> None:
    print("\n[§4.3] CT conversion; Δ = paired difference against the source continued for the same steps")
    cells = []
    for name in CT_MODELS:
        if name not in table:
            cells.append([name, NOT_RUN])
            continue
        ratio = runner.cell(values(table, name, "inference_ratio"), 2) if name != "source continued" else "—"
        cells.append([name, runner.cell(values(table, name, "converted_loss"), 4),
                      runner.cell(values(table, name, "loss"), 4),
                      signed(paired(table, name, "source continued", "loss")), ratio])  # fmt: skip
    headers = ("model", "right after conversion", "after continuing", "Δ", "inference R")
    print(format_table(headers, cells, align="<>", widths=(18, 24, 20, 20, 14), sep=""))


def directions(scratch: dict, ct: dict) -> dict[str, bool | str | None]:
    """The paper's directions: a comparison is `runner.paired_verdict` on its per-seed paired differences
    (a chain, `runner.chain_verdict` of its links), a threshold check yes / no on the seed means; None
    where an arm one needs was not run."""
    ran = {**scratch, **ct}

    def mean(name: str, key: str) -> float:
        return statistics.fmean(values(ran, name, key))

    def rising(key: str, *names: str) -> tuple[tuple[str, ...], Callable[[], str]]:
        # `key` rises along `names`, link by link, in paired differences.
        return names, lambda: runner.chain_verdict(
            [runner.paired_verdict(paired(ran, low, high, key)) for low, high in itertools.pairwise(names)]
        )

    lambdas = ("lambda-0.01", "dynamic", "lambda-0.1")
    checks = {
        "dynamic < no-chunk (held-out loss)": rising("loss", "dynamic", "no-chunk"),
        "no-chunk < fixed (held-out loss)": rising("loss", "no-chunk", "fixed"),
        "linear router < cosine in training loss (Fig. 9a)": rising("train_loss", "linear-router", "dynamic"),
        "no joint decoding < joint in training loss (Fig. 9a)": rising("train_loss", "no-joint", "dynamic"),
        "training loss rises with λ (0.01 < 0.03 < 0.1)": rising("train_loss", *lambdas),
        "every λ realises R within ±10% (held-out inference ratio)": (
            lambdas,
            lambda: all(abs(mean(name, "inference_ratio") / TARGET_RATIO - 1) <= 0.1 for name in lambdas),
        ),
    }
    for ratio in CT_RATIOS:
        name = f"converted R={ratio:g}"
        checks[f"CT R={ratio:g} lossless (held-out within 1% of the source continued)"] = (
            (name, "source continued"),
            lambda name=name: mean(name, "loss") <= 1.01 * mean("source continued", "loss"),
        )
        checks[f"CT R={ratio:g} below the source continued (held-out loss, paired)"] = rising(
            "loss", name, "source continued"
        )
    return {
        label: test() if all(name in ran for name in needs) else None
        for label, (needs, test) in checks.items()
    }


def mean_curve(runs: list[dict], config: str, key: str) -> list[float]:
    """`key` over training, smoothed and averaged over the seeds (reproduce_dlcm.mean_smoothed)."""
    chosen = [run for run in runs if run["part"] == "scratch" and run["config"] == config]
    return reproduce_dlcm.mean_smoothed(chosen, key)


def draw(runs: list[dict], path: str) -> bool:
    """(a) training LM loss minus no-chunk's (Fig. 8a/9a style), (b) the inference ratio over training."""
    plt = runner.pyplot_or_none(path)
    if plt is None:
        return False
    figure, (loss_axis, ratio_axis) = plt.subplots(1, 2, figsize=(12, 4))
    ran = {run["config"] for run in runs if run["part"] == "scratch"}
    baseline = mean_curve(runs, "no-chunk", "lm_loss") if "no-chunk" in ran else None
    for index, (name, changes) in enumerate(SCRATCH.items()):
        if changes is None or name not in ran:
            continue
        # One colour per configuration in both panels (the ratio panel has no fixed-chunking line).
        color = f"C{index}"
        curve = mean_curve(runs, name, "lm_loss")
        # The first 10% of the steps differ by whole nats: the plot starts after them.
        start = len(curve) // 10
        steps = range(start + 1, len(curve) + 1)
        if baseline is not None:
            gaps = [a - b for a, b in zip(curve[start:], baseline[start:], strict=True)]
            loss_axis.plot(steps, gaps, label=name, color=color)
        if name != "fixed":
            ratios = mean_curve(runs, name, "inference_ratio")
            ratio_axis.plot(range(1, len(curve) + 1), ratios, label=name, color=color)
    loss_axis.axhline(0, color="grey", linewidth=1)
    suffix = "" if baseline is not None else f": no-chunk {NOT_RUN}"
    loss_axis.set_title(f"training LM loss − no-chunk (nats, mean of seeds){suffix}")
    ratio_axis.axhline(TARGET_RATIO, color="grey", linestyle="--", linewidth=1)
    ratio_axis.set_yscale("log", base=2)
    ratio_axis.set_title("inference ratio on the training batches (tokens per concept)")
    for axis in (loss_axis, ratio_axis):
        axis.set_xlabel("optimizer step")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def print_report(args: argparse.Namespace, compute: list[dict], runs: list[dict], wall: float) -> dict:
    """Print the compute table, both tables and the directions; returns the directions."""
    scratch, ct = scratch_figures(runs), ct_figures(runs)
    print_compute_table(compute)
    print_scratch_table(scratch)
    print_ct_table(ct)
    verdict = directions(scratch, ct)
    print("\n[directions] " + "; ".join(f"{key}: {runner.answer(value)}" for key, value in verdict.items()))
    print(f"paper (final training-loss gaps, nats): {PAPER}")
    runner.print_wall_time(args, wall)
    return verdict
