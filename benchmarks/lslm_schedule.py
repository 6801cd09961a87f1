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
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import eval_bits_per_byte as runner
import reproduce_lslm as reproduce
from eval_bits_per_byte import cell, mean_std, seed_differences

from hf_concept.modeling.modeling_lslm import LSLMForCausalLM
from hf_concept.tables import format_table
from hf_concept.training.sweep import atomic_write_json

# arm -> (update_schedule k, steps as a multiple of --steps)
ARMS = {"joint": (0, 1), "interleaved": (1, 1), "interleaved-matched": (1, 2)}
BASELINE = "joint"
# The acceptance band of a matched-update comparison, bits per byte.
MATCHED_BAND = 0.15
QUICK = dict(seeds=(0,), steps=4, width=32, layers=(1, 1, 1), context=64, batch_size=4, eval_bytes=512)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=runner.seed_list, default=(0, 1, 2), help="comma-separated seeds")
    parser.add_argument("--steps", type=int, default=400, help="N: the joint arm's AdamW steps")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--layers", type=runner._layer_split, default=(1, 3, 1), help="token,segment,decoder")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--eval-bytes", type=int, default=None, help="score only this many bytes per text")
    parser.add_argument("--json", default=None, help="results, written after every run; resumes from it")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 4 steps, 1 seed")
    args = parser.parse_args(argv)
    runner.apply_quick(args, QUICK, argv)
    args.arms = args.arms.split(",")
    unknown = [arm for arm in args.arms if arm not in ARMS]
    if unknown or BASELINE not in args.arms:
        parser.error(f"--arms={','.join(args.arms)}: a list of {', '.join(ARMS)} that includes {BASELINE}")
    for field in ("steps", "context", "batch_size", "threads", "width"):
        if getattr(args, field) < 1:
            parser.error(f"--{field.replace('_', '-')}={getattr(args, field)} must be >= 1")
    args.validation, args.corpus = False, None  # what reproduce_lslm's helpers read
    return args


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


def differences(runs: list[dict], arm: str) -> dict[str, list[float]]:
    """Per language, `arm` − joint bits per byte per seed (`runner.seed_differences`)."""
    arm_runs = [run for run in runs if run["arm"] == arm]
    joint_runs = [run for run in runs if run["arm"] == BASELINE]
    return {
        language: seed_differences(
            arm_runs, joint_runs, lambda run, language=language: run["bits_per_byte"][language]
        )
        for language in (arm_runs[0]["bits_per_byte"] if arm_runs else ())
    }


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
    paired = {arm: differences(runs, arm) for arm in arms if arm != BASELINE}
    rows = [[f"{arm} − {BASELINE}", *(cell(paired[arm][lang]) for lang in languages)] for arm in paired]
    print("\nPaired differences (same seed; > 0: the arm is worse than joint)")
    print(format_table(["pair", *languages], rows))
    verdict = None
    if paired.get("interleaved-matched"):
        means = {lang: mean_std(values)[0] for lang, values in paired["interleaved-matched"].items()}
        verdict = all(abs(mean) <= MATCHED_BAND for mean in means.values())
        print(f"\n[matched updates] |interleaved-matched − joint| <= {MATCHED_BAND} everywhere: {verdict}")
    return dict(differences=paired, matched_within_band=verdict)


def write(args: argparse.Namespace, runs: list[dict], **figures) -> None:
    """The record so far, to --json, all or nothing (a killed sweep resumes from it)."""
    if args.json:
        atomic_write_json(Path(args.json), dict(args=vars(args), runs=runs, **figures))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    fit, texts = reproduce.texts_for(args, None)
    runs = json.loads(Path(args.json).read_text())["runs"] if args.json and Path(args.json).exists() else []
    done = {(run["arm"], run["seed"]) for run in runs}
    for seed in args.seeds:
        for arm in args.arms:
            if (arm, seed) not in done:
                runs.append(run_arm(args, arm, seed, fit, texts))
                write(args, runs)
    runs = [run for run in runs if run["seed"] in args.seeds and run["arm"] in args.arms]
    figures = report(runs, args.arms)
    write(args, runs, **figures)
    return dict(runs=runs, **figures)


if __name__ == "__main__":
    main()
