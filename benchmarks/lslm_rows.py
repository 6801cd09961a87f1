"""What the LSLM reproductions share beyond the runner: scoring a byte model with the softmax over the 256
byte ids, scoring an LSLM under evaluation segmentations other than its own, and the byte-count
references (a unigram and a bigram model of the bytes the models read).

- `renormalized_bits`: bits per byte per text (`normalization="bytes"`), a valid code for every model.
- `eval_segmentation` / `swapped_scores`: the same trained LSLM, its ends replaced at evaluation by random
  ends at a given rate (a hash seed other than training's) or by every byte; a decoder that uses its
  segments scores worse under ends it was not trained with.
- `count_references`: add-one unigram and interpolated bigram byte models counted over the training
  batches, scored on the same texts: what a model that learns nothing about context gets.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import fmean as mean

import eval_bits_per_byte as runner
import torch

from hf_concept.evaluation import bits_per_byte
from hf_concept.modeling.modeling_lslm import LSLMForCausalLM
from hf_concept.modeling.tokenization_lslm import BYTE_OFFSET, ByteTokenizer
from hf_concept.training.sweep import atomic_write_json

EVAL_SEGMENTATIONS = ("own", "random", "every")
# The bands the hierarchy is held to, bits per byte above the byte decoder (mean paired difference):
# every byte its own segment, and the router's ends (zh and ja).
EVERY_BAND = 0.10
ROUTER_BAND = 0.30
# The margin by which a model's own ends must beat random ends at its rate, on every seed.
OWN_MARGIN = 0.05
# The smoke settings of `--quick` (tiny model, 4 steps, one seed, 512 scored bytes per language).
QUICK = dict(seeds=(0,), steps=4, width=32, layers=(1, 1, 1), context=64, batch_size=4, eval_bytes=512)
# The bigram's pseudo-count toward the unigram (Dirichlet smoothing); fixed, not tuned on any split.
BIGRAM_PRIOR = 1.0


def parse_arm_args(
    argv: list[str] | None, description: str, arms: dict, baseline: str, steps_help: str
) -> argparse.Namespace:
    """The flags of a study of LSLM arms on the bundled text (`lslm_schedule.py`, `lslm_hierarchy.py`):
    `--arms` a comma-separated subset of `arms` that includes `baseline`, the model and protocol flags of
    `reproduce_lslm.py`, `--json` to resume from, `--quick`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seeds", type=runner.seed_list, default=(0, 1, 2), help="comma-separated seeds")
    parser.add_argument("--steps", type=int, default=400, help=steps_help)
    parser.add_argument("--arms", default=",".join(arms), help=f"comma-separated, of {', '.join(arms)}")
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
    unknown = [arm for arm in args.arms if arm not in arms]
    if unknown or baseline not in args.arms:
        parser.error(f"--arms={','.join(args.arms)}: a list of {', '.join(arms)} that includes {baseline}")
    for field in ("steps", "context", "batch_size", "threads", "width"):
        if getattr(args, field) < 1:
            parser.error(f"--{field.replace('_', '-')}={getattr(args, field)} must be >= 1")
    args.validation, args.corpus = False, None  # what reproduce_lslm's helpers read
    return args


def run_study(
    args: argparse.Namespace, run_arm: Callable[..., dict], report: Callable[[list, list], dict]
) -> dict:
    """Every (seed, arm) of `args` not yet in `--json`, run by `run_arm(args, arm, seed, fit, texts)` and
    written after each run (all or nothing: a killed study resumes from it), then `report(runs, arms)`'s
    figures written beside the runs."""
    # The reproduction's data helpers (this module is imported by reproduce_lslm: imported late).
    import reproduce_lslm as reproduce

    torch.set_num_threads(args.threads)
    fit, texts = reproduce.texts_for(args, None)
    path = Path(args.json) if args.json else None
    runs = json.loads(path.read_text())["runs"] if path and path.exists() else []
    done = {(run["arm"], run["seed"]) for run in runs}

    def write(**figures) -> None:
        if path:
            atomic_write_json(path, dict(args=vars(args), runs=runs, **figures))

    for seed in args.seeds:
        for arm in args.arms:
            if (arm, seed) not in done:
                runs.append(run_arm(args, arm, seed, fit, texts))
                write()
    runs = [run for run in runs if run["seed"] in args.seeds and run["arm"] in args.arms]
    figures = report(runs, args.arms)
    write(**figures)
    return dict(runs=runs, **figures)


def arm_differences(runs: list[dict], arm: str, baseline: str) -> dict[str, list[float]]:
    """Per language, `arm` − `baseline` bits per byte per seed (`runner.seed_differences`)."""
    arm_runs = [run for run in runs if run["arm"] == arm]
    base_runs = [run for run in runs if run["arm"] == baseline]
    return {
        language: runner.seed_differences(
            arm_runs, base_runs, lambda run, language=language: run["bits_per_byte"][language]
        )
        for language in (arm_runs[0]["bits_per_byte"] if arm_runs else ())
    }


def renormalized_bits(model: torch.nn.Module, texts: dict[str, str], shared: argparse.Namespace) -> dict:
    """Bits per byte per text with the softmax over the 256 byte ids (`normalization="bytes"`)."""
    tokenizer = ByteTokenizer()
    return {
        name: bits_per_byte(
            model,
            tokenizer,
            text,
            context=shared.context,
            batch_size=shared.batch_size,
            normalization="bytes",
        ).bits_per_byte
        for name, text in texts.items()
    }


@contextmanager
def eval_segmentation(model: LSLMForCausalLM, source: str, rate: float | None = None) -> Iterator:
    """`model` segmenting by `source` for as long as the block runs ("own": unchanged; "random": random
    ends at `rate` from a hash seed other than training's; "every"), its config restored afterwards."""
    config = model.config
    fields = ("boundary_source", "boundary_seed", "prior_alpha", "prior_beta")
    saved = {field: getattr(config, field) for field in fields}
    if source != "own":
        config.boundary_source = source
    if source == "random":
        # Only the random source and the prior term read the prior; eval mode scores no prior.
        config.boundary_seed = saved["boundary_seed"] + 1
        config.prior_alpha, config.prior_beta = rate, 1.0 - rate
    try:
        yield model
    finally:
        for field, value in saved.items():
            setattr(config, field, value)


def swapped_scores(model: LSLMForCausalLM, record: dict, shared: argparse.Namespace, texts: dict) -> dict:
    """Bits per byte per text under each of `EVAL_SEGMENTATIONS` (the random ends at the model's own
    held-out inference rate for a router-decided model, at the prior mean otherwise), with the rates."""
    alpha, beta = model.config.beta_prior()
    own_rate = record["heldout"]["pooled_rate"]
    rate = own_rate if model.config.boundary_source == "router" else alpha / (alpha + beta)
    scores = {"own": record["bits_per_byte"]}
    for source in EVAL_SEGMENTATIONS[1:]:
        with eval_segmentation(model.eval(), source, rate):
            scores[source] = renormalized_bits(model, texts, shared)
    return dict(scores=scores, random_rate=rate, own_rate=own_rate)


def own_minus(runs: list[dict], source: str) -> dict[str, list[float]]:
    """Per text and run (one model's seeds), its bits per byte under its own ends − under `source`'s
    (`swapped_scores`; < 0: its own ends are better)."""
    scores = [run["eval_segmentations"]["scores"] for run in runs]
    texts = scores[0]["own"] if scores else ()
    return {name: [score["own"][name] - score[source][name] for score in scores] for name in texts}


def band_verdicts(
    every: dict[str, list[float]] | None,
    router: dict[str, list[float]] | None,
    router_own_minus_random: dict[str, list[float]] | None,
) -> dict[str, bool]:
    """The bands the hierarchy is held to, from per-text (language or "language/kind" cell) lists of
    per-seed paired differences: every byte a segment − byte decoder within `EVERY_BAND` on every text
    (mean), the router's LSLM − byte decoder within `ROUTER_BAND` on every zh / ja text, and its own ends
    − random ends at its rate at most −`OWN_MARGIN` on every seed and text. A band whose figures are
    missing (None) is left out."""
    found = {}
    if every is not None:
        found["every_within_band"] = all(mean(values) <= EVERY_BAND for values in every.values())
    if router is not None:
        found["router_within_band_zh_ja"] = all(
            mean(values) <= ROUTER_BAND
            for name, values in router.items()
            if name.split("/")[0] in ("zh", "ja")
        )
    if router_own_minus_random is not None:
        found["router_own_beats_random"] = all(
            value <= -OWN_MARGIN for values in router_own_minus_random.values() for value in values
        )
    return found


def byte_counts(draw: Callable[[int], torch.Tensor], steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(256,) unigram and (256, 256) bigram counts of the bytes of batches `draw(0..steps-1)` (ids below
    `BYTE_OFFSET`, the specials, are not bytes and break a bigram)."""
    unigram = torch.zeros(256, dtype=torch.float64)
    bigram = torch.zeros(256 * 256, dtype=torch.float64)
    for index in range(steps):
        ids = draw(index).long() - BYTE_OFFSET  # (B, L)
        is_byte = ids >= 0
        unigram += torch.bincount(ids[is_byte], minlength=256).double()
        pairs = is_byte[:, :-1] & is_byte[:, 1:]
        codes = (ids[:, :-1] * 256 + ids[:, 1:])[pairs]
        bigram += torch.bincount(codes, minlength=256 * 256).double()
    return unigram, bigram.view(256, 256)


def count_bits(unigram: torch.Tensor, bigram: torch.Tensor, text: str) -> tuple[float, float]:
    """(unigram, bigram) bits per byte of `text`: add-one unigram; bigram p(b | a) = (c(a, b) +
    `BIGRAM_PRIOR` · p_uni(b)) / (c(a) + `BIGRAM_PRIOR`), its first byte scored by the unigram."""
    data = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    p_unigram = (unigram + 1) / (unigram.sum() + 256)
    unigram_nats = -torch.log(p_unigram[data]).sum()
    previous, current = data[:-1], data[1:]
    p_bigram = (bigram[previous, current] + BIGRAM_PRIOR * p_unigram[current]) / (
        bigram[previous].sum(dim=1) + BIGRAM_PRIOR
    )
    bigram_nats = -torch.log(p_unigram[data[:1]]).sum() - torch.log(p_bigram).sum()
    scale = 1.0 / (len(data) * math.log(2.0))
    return float(unigram_nats) * scale, float(bigram_nats) * scale


def count_references(draw: Callable[[int], torch.Tensor], steps: int, texts: dict[str, str]) -> dict:
    """{"unigram": {text: bits per byte}, "bigram": {...}} counted over `steps` batches of `draw`."""
    unigram, bigram = byte_counts(draw, steps)
    scores = {name: count_bits(unigram, bigram, text) for name, text in texts.items()}
    return {
        "unigram": {name: pair[0] for name, pair in scores.items()},
        "bigram": {name: pair[1] for name, pair in scores.items()},
    }
