"""The LSLM's hierarchy measured apart from its router: who decides the segment ends, and whether the
decoder's `<nxt>` markers are in the objective, against the byte decoder of the same layers.

Each LSLM arm is `reproduce_lslm.py`'s "lslm" row — the same initial weights, the same batches of a seed,
joint updates (`update_schedule=0`), the same scoring of the bundled held-out text — with two fields set:

- `boundary_source`: "every" (every byte its own segment: the hierarchy with nothing to pool), "random"
  (ends at fixed random bytes at the prior mean, 0.7) or "router" (the paper's learned ends);
- `segment_end_loss`: the arm's name ends in "+nxt" when the `<nxt>` cross-entropy is added to the
  objective (the project's former default), not when it is left out (LSLM eq. 4 as written).

The "byte" arm is the byte decoder of `reproduce_lslm.py` (same width, total depth and batches). Each
LSLM is scored three times, the model unchanged, under three evaluation segmentations: its own ("own"),
random ends at the same rate ("random": at the model's own held-out inference rate for a router arm, at
the prior mean otherwise, from another hash seed than training's) and every byte ("every"). A decoder
that uses its segments scores worse when they are replaced.

Held-out bits per byte with the softmax over the 256 byte ids, as in `reproduce_lslm.py`; paired
differences against the byte decoder (same seed and batches) and, for each source, with the `<nxt>` term
against without it. `--json` is written after every run and a run already in it is not run again, so a
killed sweep resumes.

    OMP_NUM_THREADS=1 python benchmarks/lslm_hierarchy.py --seeds 0,1,2 --steps 400 --json hierarchy.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import eval_bits_per_byte as runner
import lslm_rows
import reproduce_lslm as reproduce
from eval_bits_per_byte import cell
from lslm_rows import EVAL_SEGMENTATIONS

from hf_concept.tables import format_table

SOURCES = ("every", "random", "router")
# arm -> (boundary_source, segment_end_loss); None: the byte decoder
TERMS = (("", False), ("+nxt", True))
ARMS = {"byte": None, **{f"{source}{tag}": (source, term) for source in SOURCES for tag, term in TERMS}}
BASELINE = "byte"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return lslm_rows.parse_arm_args(argv, __doc__.splitlines()[0], ARMS, BASELINE, "AdamW steps of every arm")


def build(args: argparse.Namespace, arm: str, seed: int) -> tuple[torch.nn.Module, argparse.Namespace]:
    """Arm `arm`'s model freshly initialised from `seed` (`reproduce_lslm.build_model`: "byte", or the
    LSLM row of its boundary source, joint updates by the config's default), with its `<nxt>` term set,
    and the shared runner's namespace."""
    if ARMS[arm] is None:
        return reproduce.build_model(args, "byte", seed), reproduce.runner_args(args, seed, "byte")
    source, segment_end_loss = ARMS[arm]
    name = "lslm" if source == "router" else source
    model = reproduce.build_model(args, name, seed)
    # Read by the loss only: setting it after construction leaves the initial weights as they are.
    model.config.segment_end_loss = segment_end_loss
    return model, reproduce.runner_args(args, seed, name)


def run_arm(args: argparse.Namespace, arm: str, seed: int, fit: dict, texts: dict) -> dict:
    """Train arm `arm` from `seed` on the seed's batches and score it (an LSLM under each evaluation
    segmentation too)."""
    model, shared = build(args, arm, seed)
    name = "byte" if ARMS[arm] is None else "lslm"
    print(f"[seed {seed}] {arm}: {args.steps} steps", flush=True)
    started = time.perf_counter()
    schedule = None if name == "byte" else model.config.update_schedule
    _, step = runner.trainer(model, shared, schedule, reproduce.token_rows(fit))
    history = [step(index) for index in range(args.steps)]
    # An LSLM's record holds its scores under the swapped evaluation segmentations (`score_model`).
    record = reproduce.score_model(model, name, seed, shared, texts, history, time.perf_counter() - started)
    record.update(arm=arm)
    return record


def own_against(runs: list[dict], arm: str, source: str) -> dict[str, list[float]]:
    """Per language and seed, `arm`'s bits per byte under its own segmentation − under `source`'s."""
    return lslm_rows.own_minus([run for run in runs if run["arm"] == arm], source)


def score_table(runs: list[dict], arms: list[str], languages: list[str]) -> None:
    """Held-out bits per byte per arm, and each LSLM arm under the swapped evaluation segmentations."""
    rows = []
    for arm in arms:
        arm_runs = [run for run in runs if run["arm"] == arm]
        sources = EVAL_SEGMENTATIONS if ARMS[arm] is not None else ("own",)
        for source in sources:
            values = [
                run["eval_segmentations"]["scores"][source] if source != "own" else run["bits_per_byte"]
                for run in arm_runs
            ]
            label = arm if source == "own" else f"{arm}, scored under {source} ends"
            rows.append([label, *(cell([value[lang] for value in values]) for lang in languages)])
    print("\nHeld-out bits per byte (mean ± std over seeds)")
    print(format_table(["arm", *languages], rows))


def verdicts(runs: list[dict], paired: dict) -> dict:
    """The bands (`lslm_rows.band_verdicts`): "every" and "router" (both without the `<nxt>` term)
    against the byte decoder, and the router's own ends against random ends at its rate on every seed."""
    own = own_against(runs, "router", "random") if "router" in paired else None
    found = lslm_rows.band_verdicts(paired.get("every"), paired.get("router"), own)
    for name, verdict in found.items():
        print(f"[{name}] {verdict}")
    return found


def report(runs: list[dict], arms: list[str]) -> dict:
    """Print the tables; return the paired differences, the own-against-swapped differences, verdicts."""
    languages = list(runs[0]["bits_per_byte"])
    score_table(runs, arms, languages)
    paired = {arm: lslm_rows.arm_differences(runs, arm, BASELINE) for arm in arms if arm != BASELINE}
    rows = [[f"{arm} − {BASELINE}", *(cell(paired[arm][lang]) for lang in languages)] for arm in paired]
    terms = {
        arm: lslm_rows.arm_differences(runs, f"{arm}+nxt", arm)
        for arm in SOURCES
        if arm in arms and f"{arm}+nxt" in arms
    }
    rows += [[f"{arm}+nxt − {arm}", *(cell(terms[arm][lang]) for lang in languages)] for arm in terms]
    swapped = {
        f"{arm}: own − {source}": own_against(runs, arm, source)
        for arm in arms
        if ARMS[arm] is not None
        for source in EVAL_SEGMENTATIONS[1:]
    }
    rows += [[pair, *(cell(values[lang]) for lang in languages)] for pair, values in swapped.items()]
    print("\nPaired differences (same seed and batches; < 0: the first is better)")
    print(format_table(["pair", *languages], rows))
    return dict(differences=paired, segment_end_term=terms, eval_segmentations=swapped,
                verdicts=verdicts(runs, paired))  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    return lslm_rows.run_study(parse_args(argv), run_arm, report)


if __name__ == "__main__":
    main()
