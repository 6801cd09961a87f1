"""LSLM update schedules measured apart: joint updates (the default) against the paper's interleaving.

Each arm is `reproduce_lslm.py`'s "lslm" row — the same model and initial weights, the same batches of a
seed, the same scoring of the bundled held-out text — with only the update schedule and the step count
changed:

- `joint`: `update_schedule=0`, N steps; every step updates the generator and the router (N generator
  updates);
- `interleaved`: the paper's k = 1 over the same N steps (N / 2 generator updates);
- `interleaved-matched`: k = 1 over 2N steps, so the generator gets the N updates the joint arm gives it
  (the learning-rate schedule stretched over the 2N steps, the router updated N times as well).

The paired differences (same seed, the first N batches shared) say what interleaving costs at equal steps
and what remains at matched generator updates. Held-out bits per byte with the softmax over the 256 byte
ids, as in `reproduce_lslm.py`. `--json` is written after every run and a run already in it is not run
again, so a killed sweep resumes.

    OMP_NUM_THREADS=1 python benchmarks/lslm_schedule.py --seeds 0,1,2 --steps 400 --json schedule.json
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import eval_bits_per_byte as runner
import lslm_rows
import reproduce_lslm as reproduce
from eval_bits_per_byte import cell, mean_std

from hf_concept.modeling.modeling_lslm import LSLMForCausalLM
from hf_concept.tables import format_table

# arm -> (update_schedule k, steps as a multiple of --steps)
ARMS = {"joint": (0, 1), "interleaved": (1, 1), "interleaved-matched": (1, 2)}
BASELINE = "joint"
# The acceptance band of a matched-update comparison, bits per byte.
MATCHED_BAND = 0.15


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return lslm_rows.parse_arm_args(
        argv, __doc__.splitlines()[0], ARMS, BASELINE, "N: the joint arm's AdamW steps"
    )


def run_arm(args: argparse.Namespace, arm: str, seed: int, fit: dict, texts: dict) -> dict:
    """Train arm `arm` from `seed` (reproduce_lslm's LSLM, initial weights and batches) and score it."""
    generator_steps, multiple = ARMS[arm]
    arm_args = copy.copy(args)
    arm_args.steps = args.steps * multiple
    shared = reproduce.runner_args(arm_args, seed, "lslm")
    shared.lslm_update_schedule = generator_steps
    torch.manual_seed(seed)
    model = LSLMForCausalLM(runner.lslm_config(shared, shared.lslm[0]))
    print(f"[seed {seed}] {arm}: k = {generator_steps}, {arm_args.steps} steps", flush=True)
    started = time.perf_counter()
    _, step = runner.trainer(model, shared, generator_steps, reproduce.token_rows(fit))
    history = [step(index) for index in range(arm_args.steps)]
    record = reproduce.score_model(model, "lslm", seed, shared, texts, history, time.perf_counter() - started)
    updates = arm_args.steps * generator_steps // (generator_steps + 1) if generator_steps else arm_args.steps
    record.update(arm=arm, update_schedule=generator_steps, steps=arm_args.steps, generator_updates=updates)
    return record


def report(runs: list[dict], arms: list[str]) -> dict:
    """Print the score and paired-difference tables; return the differences and the verdict."""
    languages = list(runs[0]["bits_per_byte"])
    rows = [
        [
            arm,
            *(cell([run["bits_per_byte"][lang] for run in runs if run["arm"] == arm]) for lang in languages),
        ]
        for arm in arms
    ]
    print("\nHeld-out bits per byte (mean ± std over seeds)")
    print(format_table(["arm", *languages], rows))
    paired = {arm: lslm_rows.arm_differences(runs, arm, BASELINE) for arm in arms if arm != BASELINE}
    rows = [[f"{arm} − {BASELINE}", *(cell(paired[arm][lang]) for lang in languages)] for arm in paired]
    print("\nPaired differences (same seed; > 0: the arm is worse than joint)")
    print(format_table(["pair", *languages], rows))
    verdict = None
    if paired.get("interleaved-matched"):
        means = {lang: mean_std(values)[0] for lang, values in paired["interleaved-matched"].items()}
        verdict = all(abs(mean) <= MATCHED_BAND for mean in means.values())
        print(f"\n[matched updates] |interleaved-matched − joint| <= {MATCHED_BAND} everywhere: {verdict}")
    return dict(differences=paired, matched_within_band=verdict)


def main(argv: list[str] | None = None) -> dict:
    return lslm_rows.run_study(parse_args(argv), run_arm, report)


if __name__ == "__main__":
    main()
