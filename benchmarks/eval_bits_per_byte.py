"""Held-out bits per byte of byte-level causal LMs on the bundled English, Chinese and Japanese text.

Rows of the table:
- "gpt2-byte": a GPT-2 (`hf_concept.evaluation.byte_gpt2_baseline`) on the 261-id byte vocabulary, trained
  here from a fixed seed for `--steps` AdamW steps on the `train` split of every bundled language
  (`hf_concept.data`): each batch row is a random `--context`-token crop of one language's
  `<BoS> bytes`, the language drawn in proportion to its size; lr warms up linearly over the first 10% of
  the steps, then decays by a cosine to 10%. Its shape comes from `--params` (matched with
  `match_gpt2_to` at depth `--layers` if given) or `--layers`/`--width`. With `--lslm` and no `--params`
  it is matched to the LSLM's parameter count, at depth `--layers` or else the LSLM's total layer count
  (the paper's Appendix B gives its GPT-2 the LSLM's 18 layers).
- "lslm-POOLING", one per `--lslm POOLING` (`mean`, `hops:3`, ...): an `LSLMForCausalLM` with
  `--lslm-layers` token/segment/decoder layers (default 2,4,2: the stage split of the paper's Appendix B
  base model, 2 + 8 + 2, scaled down) at widths `--lslm-width` (segment encoder) and
  `--lslm-token-width`/`--lslm-decoder-width` (narrower, as the paper's small encoder/decoder), heads of
  width 32, MLPs 4x wide; the other fields are `LSLMConfig`'s defaults unless given: Beta prior mean
  `--lslm-prior`, β = `--lslm-kl-weight`, the prior term `--lslm-prior-loss` (`LSLMConfig.prior_loss`;
  `binomial` is DTP's count prior), the update schedule `--lslm-update-schedule` (0, the default: joint
  updates; k: k steps update the generative model, then one the router, as LSLM §2.6,
  `hf_concept.training.lslm.drop_other_group_gradients`, the rule `InterleavedUpdates` applies under
  `Trainer`). It is trained on the very batches of the baseline (same sampler and seed), with the same
  steps, lr schedule, batch and context, on its ELBO (`model(input_ids=batch, labels=batch).loss`).
  Its "train loss" is that ELBO, not nats per byte. `--lslm-joint` trains every parameter at every step
  whatever the config's schedule, as DTP is trained.
- "lslm-POOLING@rate": the same trained LSLM with `boundary_threshold` moved from 0.5 to the (1 - r)
  quantile of the router's q over 16 fresh training crops, r being their mean q. Training samples a
  boundary with probability q_t (σ(p̂ + g′ − g″) >= 1/2, LSLM eq. 2), i.e. at rate r, while inference
  thresholds q_t; until the router is confident (q near 0 or 1) the two disagree, and a router whose q
  stays below 1/2 closes no segment at all at inference. This row evaluates the model with segments as
  frequent as in its training; the threshold is chosen on train text only.
- one row per `--model PATH`: any checkpoint that `AutoModelForCausalLM.from_pretrained(PATH,
  trust_remote_code=True)` loads and that predicts the next byte id from the byte ids before it (a GPT-2
  saved with `--save`, for instance). An LSLM checkpoint also gets the ELBO view below.

Each cell is `bits_per_byte` over the `heldout` split with `--context`-token windows and stride
context/2 (counting rules: `hf_concept.evaluation`'s docstring; a uniform model scores log2(261) = 8.03).
For an LSLM that is the byte path: its per-token logits predict the next input byte; on plain text the
router closes segments from the prefix alone, so this is a code length for the bytes, and the mass the
decoder puts on `<nxt>` (or any special id) where no boundary follows is lost. No marker is counted.

A second table gives each LSLM's ELBO view (`hf_concept.evaluation.lslm_code_length`, same windows):
"bytes" = the decoder's cross-entropy of the byte targets (equal to the byte path by construction: the
same slots predict the same bytes), "boundary" = the cross-entropy of the `<nxt>` targets, charged to
the byte that closes a segment, per byte of text, "total" = their sum (what the decoder's loss counts,
without the KL term), "B/seg" = scored bytes per segment (the realised compression) and "mean q" = the
router's mean boundary probability over the scored bytes (the rate at which training would sample).

`--quick` is a smoke run: tiny models, a few steps, the first 512 bytes of each held-out text.

    python benchmarks/eval_bits_per_byte.py [--steps 300] [--params N [--layers L] | --layers 4 --width 128]
        [--context 256] [--batch-size 16] [--lr 2e-3] [--seed 0] [--model PATH ...] [--no-baseline]
        [--lslm POOLING ...] [--lslm-layers 2,4,2] [--lslm-width 128] [--lslm-token-width 64]
        [--lslm-decoder-width 64] [--lslm-prior P] [--lslm-kl-weight B] [--lslm-update-schedule K]
        [--lslm-prior-loss beta_binomial|beta_kl|kl|binomial] [--lslm-joint]
        [--save DIR] [--json PATH] [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from hf_concept.data import LANGUAGES, load_text
from hf_concept.evaluation import (
    bits_per_byte,
    byte_gpt2_baseline,
    lslm_boundary_probabilities,
    lslm_code_length,
    lslm_config_for,
)
from hf_concept.modeling.configuration_lslm import PRIOR_LOSSES, LSLMConfig
from hf_concept.modeling.modeling_lslm import LSLMForCausalLM
from hf_concept.modeling.tokenization_lslm import BYTE_OFFSET, SEQUENCE_START_ID, VOCAB_SIZE, ByteTokenizer
from hf_concept.tables import format_table
from hf_concept.training.lslm import drop_other_group_gradients

QUICK = dict(
    steps=4, layers=1, width=32, context=64, batch_size=4, eval_bytes=512, lslm_layers=(1, 1, 1),
    lslm_width=32, lslm_token_width=16, lslm_decoder_width=16,
)  # fmt: skip
HEAD_WIDTH = 32
WARMUP_FRACTION = 0.1
FINAL_LR_FRACTION = 0.1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="AdamW steps for the GPT-2 baseline")
    parser.add_argument("--params", type=int, default=None, help="match the baseline to this parameter count")
    parser.add_argument("--layers", type=int, default=None, help="depth (default 4; free with --params)")
    parser.add_argument("--width", type=int, default=128, help="baseline width (ignored with --params)")
    parser.add_argument("--context", type=int, default=256, help="tokens per training crop and eval window")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", action="append", default=[], help="checkpoint to evaluate (repeatable)")
    parser.add_argument("--no-baseline", action="store_true", help="skip training the GPT-2 baseline")
    parser.add_argument("--save", default=None, help="save the trained baseline to this folder")
    parser.add_argument(
        "--lslm", action="append", default=[], metavar="POOLING", help="train an LSLM with this pooling"
    )
    parser.add_argument("--lslm-layers", type=_layer_split, default=(2, 4, 2), help="token,segment,decoder")
    parser.add_argument("--lslm-width", type=int, default=128, help="LSLM segment-encoder width")
    parser.add_argument("--lslm-token-width", type=int, default=64, help="LSLM token-encoder width")
    parser.add_argument("--lslm-decoder-width", type=int, default=64, help="LSLM decoder width")
    # The LSLM's fields default to LSLMConfig's (None: not passed), so that `--lslm mean` trains the
    # model a user gets.
    parser.add_argument("--lslm-prior", type=float, default=None, help="Beta prior mean (default: config's)")
    parser.add_argument("--lslm-kl-weight", type=float, default=None, help="β (default: the config's)")
    parser.add_argument(
        "--lslm-update-schedule", type=int, default=None, help="k generator steps per router step (0: joint)"
    )
    parser.add_argument("--lslm-prior-loss", choices=PRIOR_LOSSES, default=None, help="(default: config's)")
    parser.add_argument("--lslm-joint", action="store_true", help="update every parameter at every step")
    parser.add_argument("--eval-bytes", type=int, default=None, help="score only this many held-out bytes")
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, few steps, short eval")
    args = parser.parse_args(argv)
    if args.quick:
        for field, value in QUICK.items():
            setattr(args, field, value)
    for field in ("steps", "context", "batch_size", "threads"):
        if getattr(args, field) < 1:
            parser.error(f"--{field.replace('_', '-')}={getattr(args, field)} must be >= 1")
    if args.no_baseline and not (args.model or args.lslm):
        parser.error("--no-baseline leaves nothing to evaluate: add --model PATH or --lslm POOLING")
    for pooling in args.lslm:
        try:
            lslm_config(args, pooling)
        except ValueError as error:
            parser.error(f"--lslm {pooling} (or an --lslm-* flag): {error}")
    return args


def _layer_split(text: str) -> tuple[int, int, int]:
    parts = text.split(",")
    if len(parts) != 3 or not all(part.strip().isdigit() and int(part) >= 1 for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r} must be three positive ints: token,segment,decoder")
    return tuple(int(part) for part in parts)


def lslm_config(args: argparse.Namespace, pooling: str) -> LSLMConfig:
    """The LSLM of `--lslm POOLING` and the `--lslm-*` flags (heads of width 32, MLPs 4x wide)."""
    return lslm_config_for(
        tuple(args.lslm_layers),
        (args.lslm_token_width, args.lslm_width, args.lslm_decoder_width),
        HEAD_WIDTH,
        max_position_embeddings=args.context,
        pooling=pooling,
        **lslm_fields(args),
    )


def lslm_fields(args: argparse.Namespace) -> dict:
    """The `--lslm-*` fields given on the command line (the others keep `LSLMConfig`'s defaults)."""
    given = {
        "prior_mean": args.lslm_prior,
        "kl_weight": args.lslm_kl_weight,
        "update_schedule": args.lslm_update_schedule,
        "prior_loss": args.lslm_prior_loss,
    }
    return {field: value for field, value in given.items() if value is not None}


def train_token_rows() -> list[torch.Tensor]:
    """`<BoS> bytes` of each language's train split, as id tensors."""
    return [
        torch.tensor([SEQUENCE_START_ID, *(BYTE_OFFSET + b for b in load_text(language).encode("utf-8"))])
        for language in LANGUAGES
    ]


def sample_batch(rows: list[torch.Tensor], batch_size: int, context: int, rng: random.Random) -> torch.Tensor:
    """`batch_size` random crops of `context` tokens; a language is drawn in proportion to its length."""
    weights = [len(row) for row in rows]
    crops = []
    for row in rng.choices(rows, weights=weights, k=batch_size):
        start = rng.randrange(len(row) - context + 1)
        crops.append(row[start : start + context])
    return torch.stack(crops)  # (B, context)


def seed_list(text: str) -> tuple[int, ...]:
    """Distinct comma-separated seeds (an argparse type: a bad value exits 2 with a one-line message)."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated ints") from None
    if not values or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r} must name distinct seeds")
    return values


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


RESOLVED_STDS = 2.0


def seed_differences(lower: list[dict], higher: list[dict], pick: Callable[[dict], float]) -> list[float]:
    """Per run of `lower`: pick(run) − pick(the run of `higher` with the same "seed"), the paired
    differences `paired_verdict` reads."""
    by_seed = {run["seed"]: run for run in higher}
    return [pick(run) - pick(by_seed[run["seed"]]) for run in lower]


def paired_verdict(differences: list[float]) -> str:
    """The verdict on a claim "a < b" from its per-seed paired differences a − b (same seed, same
    batches): "unresolved" when |mean| < `RESOLVED_STDS` sample std, or with fewer than two seeds (no
    spread to compare with); else "reproduced" (mean < 0) or "opposite" (mean > 0)."""
    if len(differences) < 2:
        return "unresolved"
    mean, std = mean_std(differences)
    if abs(mean) < RESOLVED_STDS * std or mean == 0:
        return "unresolved"
    return "reproduced" if mean < 0 else "opposite"


def chain_verdict(verdicts: list[str]) -> str:
    """The verdict on a chain of claims (a < b < c ...) from its links' `paired_verdict`s: "reproduced"
    when every link is, "opposite" when some link is, else "unresolved"."""
    if all(verdict == "reproduced" for verdict in verdicts):
        return "reproduced"
    return "opposite" if "opposite" in verdicts else "unresolved"


def answer(value: bool | str | None) -> str:
    """A direction's printed answer: a verdict as it is, a threshold check as yes / no, "not run"."""
    if value is None:
        return "not run"
    return value if isinstance(value, str) else "yes" if value else "no"


def cell(values: list[float], digits: int = 3) -> str:
    """ "mean ± std" of the seeds' values."""
    mean, std = mean_std(values)
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def table_values(table: dict[str, dict[int, dict]], name: str, key: str) -> list[float]:
    """`key` of configuration `name` per seed, in seed order, from a table name → seed → figures."""
    return [figures[key] for _, figures in sorted(table[name].items())]


def table_differences(
    table: dict[str, dict[int, dict]], name: str, baseline: str, key: str = "loss"
) -> list[float]:
    """Per seed of `name`: its `key` minus `baseline`'s at the same seed (same batches), from a table
    name → seed → figures."""
    return [table[name][seed][key] - table[baseline][seed][key] for seed in sorted(table[name])]


def signed_cell(differences: list[float], digits: int = 4) -> str:
    """ "+mean ± std" of paired differences."""
    mean, std = mean_std(differences)
    return f"{mean:+.{digits}f} ± {std:.{digits}f}"


def print_wall_time(args: argparse.Namespace, wall: float) -> None:
    """The reproduction's closing line: wall time, the processes and threads it ran with, torch's version."""
    workers = f"{args.workers} workers x " if hasattr(args, "workers") else ""
    print(f"total wall time: {wall:.1f} s ({wall / 60:.1f} min), {workers}{args.threads} torch threads, "
          f"torch {torch.__version__}")  # fmt: skip


def write_result(args: argparse.Namespace, **figures) -> dict:
    """A reproduction's result record — the command line, its arguments, the Python and torch versions
    and `figures` — written as JSON to `args.json` when given; returned either way."""
    result = dict(
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        args=vars(args),
        python=platform.python_version(),
        torch=torch.__version__,
        **figures,
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2, ensure_ascii=False)
    return result


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """The flags every multi-seed reproduction shares: jobs in worker processes, outputs, smoke run."""
    parser.add_argument("--workers", type=int, default=2, help="processes running jobs side by side")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--json", default=None, help="write every per-seed figure and curve here")
    parser.add_argument("--png", default=None, help="draw the curves here (needs matplotlib)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, a few steps, 1 seed")


def given_flags(argv: list[str] | None) -> set[str]:
    """The destinations of the options on the command line (`--batch-size 4` -> "batch_size")."""
    tokens = sys.argv[1:] if argv is None else argv
    return {token[2:].split("=", 1)[0].replace("-", "_") for token in tokens if token.startswith("--")}


def apply_quick(args: argparse.Namespace, quick: dict, argv: list[str] | None) -> None:
    """Under --quick, `quick`'s settings, except those the command line gives itself: `--quick --seeds 0,1`
    runs the smoke settings with seeds 0 and 1."""
    if not args.quick:
        return
    given = given_flags(argv)
    for field, value in quick.items():
        if field not in given:
            setattr(args, field, value)


def finish_run_flags(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    quick: dict,
    counts: tuple[str, ...],
    argv: list[str] | None = None,
) -> argparse.Namespace:
    """`args` with the `quick` settings under --quick (`apply_quick`); exits 2 naming the flag if a count
    in `counts` (or --workers, --threads) is below 1 or --accumulation does not divide --batch-size."""
    apply_quick(args, quick, argv)
    for field in (*counts, "workers", "threads"):
        if getattr(args, field) < 1:
            parser.error(f"--{field.replace('_', '-')}={getattr(args, field)} must be >= 1")
    if args.batch_size % args.accumulation:
        parser.error(f"--accumulation={args.accumulation} must divide --batch-size={args.batch_size}")
    return args


def accumulated_steps(
    model: nn.Module, batches: Iterable[torch.Tensor], steps: int, accumulation: int, lr: float
) -> Iterator[list[tuple[torch.Tensor, Any]]]:
    """The reproductions' optimizer loop: AdamW (weight decay 0.01) at peak `lr` with `learning_rate_factor`
    over `steps`, one step per (B, L) batch of `batches`, each in `accumulation` micro-batches whose
    losses are normalised as `Trainer` does (`num_items_in_batch`), gradients clipped at 1.0. Yields, after
    each optimizer step, its (micro-batch, model output) pairs. Draws nothing from torch's generator."""
    optimizer, schedule = optimizer_and_schedule(model, lr, steps)
    model.train()
    for batch in batches:
        yield optimizer_step(model, optimizer, schedule, batch, accumulation)


def optimizer_and_schedule(model: nn.Module, lr: float, steps: int, weight_decay: float = 0.01) -> tuple:
    """AdamW at peak `lr` and its `learning_rate_factor` schedule over `steps` (held by the caller, so that
    a sweep can checkpoint them)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: learning_rate_factor(step, steps))
    return optimizer, schedule


def optimizer_step(
    model: nn.Module, optimizer, schedule, batch: torch.Tensor, accumulation: int
) -> list[tuple[torch.Tensor, Any]]:
    """One optimizer step on a (B, L) batch in `accumulation` micro-batches, losses normalised as `Trainer`
    does (`num_items_in_batch`), gradients clipped at 1.0. Returns the (micro-batch, output) pairs."""
    items = torch.tensor(batch.shape[0] * (batch.shape[1] - 1))
    optimizer.zero_grad(set_to_none=True)
    outputs = []
    for micro in batch.chunk(accumulation):
        output = model(input_ids=micro, labels=micro, num_items_in_batch=items)
        output.loss.backward()
        outputs.append((micro, output))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    return outputs


def save_whole(model: torch.nn.Module, path: Path, *companions: Any) -> None:
    """`model.save_pretrained(path)` (and each companion's, a tokenizer for instance) through a staging
    folder renamed into place: a kill leaves no half-saved source where a later run would load it."""
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    for saved in (model, *companions):
        saved.save_pretrained(staging)
    # A copy saved before a kill that came before its run's result line: this one is the same.
    shutil.rmtree(path, ignore_errors=True)
    os.replace(staging, path)


def pyplot_or_none(path: str):
    """matplotlib's pyplot on the Agg backend, or None, with a message naming the `plots` extra and the
    picture `path` that will not be drawn, when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed (pip install 'hf_concept[plots]'): no {path}", flush=True)
        return None
    return plt


def learning_rate_factor(step: int, steps: int) -> float:
    warmup = max(1, int(steps * WARMUP_FRACTION))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))


def build_baseline(args: argparse.Namespace, lslm_parameters: int | None, lslm_layers: int) -> nn.Module:
    """The GPT-2 byte baseline: matched to `--params`, else to the LSLM's count (depth `--layers` or the
    LSLM's total layers), else `--layers` x `--width`."""
    torch.manual_seed(args.seed)
    target = args.params if args.params is not None else lslm_parameters
    if target is not None:
        depth = args.layers if args.layers is not None or args.params is not None else lslm_layers
        return byte_gpt2_baseline(target, n_layer=depth, n_positions=args.context)
    return byte_gpt2_baseline(n_layer=args.layers or 4, n_embd=args.width, n_positions=args.context)


def train(
    model: nn.Module,
    args: argparse.Namespace,
    generator_steps: int | None = None,
    rows: list[torch.Tensor] | None = None,
    history: list[dict] | None = None,
) -> float:
    """`args.steps` AdamW steps of `model`'s own loss on the shared batches; returns the mean loss over the
    last 10% of the steps. With `generator_steps` k, optimizer steps are interleaved (LSLM §2.6): after
    clipping, the gradients of the group that the step does not update are dropped. Batches are crops of
    `rows` (default `train_token_rows()`); `history`, when given, receives one dict per step: the loss
    and the output's scalar metrics (an LSLM's boundary rates, for instance)."""
    _, step = trainer(model, args, generator_steps, rows if rows is not None else train_token_rows())
    records = [step(index) for index in range(args.steps)]
    if history is not None:
        history.extend(records)
    tail = [record["loss"] for record in records[-max(1, len(records) // 10) :]]
    return sum(tail) / len(tail)


def trainer(
    model: nn.Module,
    args: argparse.Namespace,
    generator_steps: int | None,
    rows: list[torch.Tensor],
    draw: Callable[[int], torch.Tensor] | None = None,
) -> tuple[dict, Callable[[int], dict]]:
    """`train`'s state (model, AdamW, schedule, the seed's batch generator), held apart so that a sweep can
    checkpoint it, and its step i, which returns the step's record: the loss and the output's scalar
    metrics (`step_metrics`). `draw(i)`, when given, is step i's (B, L) batch instead of random crops of
    `rows` (a corpus read without replacement: a pure function of i, nothing to checkpoint)."""
    optimizer, schedule = optimizer_and_schedule(model, args.lr, args.steps, args.weight_decay)
    rng = random.Random(args.seed)
    # The LSLM samples its training boundaries with torch's generator: seeded, so a run is repeatable.
    torch.manual_seed(args.seed)
    model.train()

    def step(index: int) -> dict:
        batch = (
            sample_batch(rows, args.batch_size, args.context, rng) if draw is None else draw(index)
        )  # (B, L)
        output = model(input_ids=batch, labels=batch)
        update(model, optimizer, schedule, output.loss, index, generator_steps)
        record = dict(step_metrics(output), loss=output.loss.item())
        if (index + 1) % max(1, args.steps // 10) == 0 or index + 1 == args.steps:
            rate = getattr(output, "boundary_rate", None)
            sampled = "" if rate is None else f"  sampled boundary rate {rate.item():.3f}"
            print(f"  step {index + 1}/{args.steps}  loss {record['loss']:.3f}{sampled}", flush=True)
        return record

    state = dict(model=model, optimizer=optimizer, schedule=schedule)
    if draw is None:
        state["batches"] = rng
    return state, step


def update(
    model: nn.Module, optimizer, schedule, loss: torch.Tensor, index: int, generator_steps: int | None
) -> None:
    """Optimizer step `index` from `loss`: backward, gradients clipped at 1.0, then with `generator_steps`
    k (interleaved updates, LSLM §2.6) the gradients of the group this step does not update dropped, the
    AdamW step and the schedule's."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if generator_steps is not None:
        drop_other_group_gradients(model, index, generator_steps)
    optimizer.step()
    schedule.step()


def step_metrics(output) -> dict[str, float]:
    """The scalar tensors of a model output other than the loss (LSLM: `lm_loss`, `kl_loss`, the boundary
    rates, `bits_per_byte`, `compression_ratio`), as floats."""
    return {
        name: value.item()
        for name, value in output.items()
        if name != "loss" and isinstance(value, torch.Tensor) and value.numel() == 1
    }


def heldout_texts(eval_bytes: int | None) -> dict[str, str]:
    texts = {}
    for language in LANGUAGES:
        data = load_text(language, "heldout").encode("utf-8")
        # A cut inside a character would leave invalid UTF-8; drop the partial character instead.
        texts[language] = data[:eval_bytes].decode("utf-8", errors="ignore") if eval_bytes else data.decode()
    return texts


def evaluate(model: nn.Module, texts: dict[str, str], args: argparse.Namespace) -> dict[str, float]:
    tokenizer = ByteTokenizer()
    return {
        language: bits_per_byte(
            model, tokenizer, text, context=args.context, batch_size=args.batch_size
        ).bits_per_byte
        for language, text in texts.items()
    }


def evaluate_elbo_view(model: nn.Module, texts: dict[str, str], args: argparse.Namespace) -> dict[str, dict]:
    """Per language: bits per byte of the byte targets, of the boundaries, their sum, bytes per segment."""
    tokenizer, view = ByteTokenizer(), {}
    for language, text in texts.items():
        code = lslm_code_length(model, tokenizer, text, context=args.context, batch_size=args.batch_size)
        view[language] = dict(
            byte_bits=code.byte_bits_per_byte,
            boundary_bits=code.boundary_bits_per_byte,
            total_bits=code.bits_per_byte,
            bytes_per_segment=code.bytes_per_segment,
            mean_q=code.mean_boundary_probability,
        )
    return view


def load_checkpoint(path: str) -> nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
    vocab = getattr(model.config, "vocab_size", None)
    if vocab != VOCAB_SIZE:
        raise ValueError(f"--model {path}: vocab_size={vocab}, but the byte vocabulary has {VOCAB_SIZE} ids")
    return model


def print_table(results: list[dict], texts: dict[str, str]) -> None:
    sizes = "  ".join(f"{language}={len(text.encode('utf-8'))}" for language, text in texts.items())
    print(f"\nheld-out bits per byte (bytes scored: {sizes}; uniform = {math.log2(VOCAB_SIZE):.2f})")
    rows = []
    for row in results:
        train_s = f"{row['train_seconds']:.1f}" if row["train_seconds"] is not None else "-"
        train_loss = f"{row['train_loss']:.3f}" if row["train_loss"] is not None else "-"
        figures = [f"{row['bits_per_byte'][language]:.3f}" for language in LANGUAGES]
        rows.append([row["model"], row["parameters"], train_s, train_loss, *figures])
    headers = ["model", "params", "train s", "train loss", *LANGUAGES]
    widths = (24, 10, 8, 10, *[7] * len(LANGUAGES))
    print(format_table(headers, rows, align="<>", widths=widths, sep=" ", rule="line"))


def print_elbo_table(results: list[dict]) -> None:
    rows = [row for row in results if row.get("elbo_view")]
    if not rows:
        return
    print(
        "\nLSLM ELBO view (bits per byte: byte targets + <nxt> targets = total; bytes per segment; "
        "mean router q)"
    )
    cells = [
        (row["model"], language, f"{cell['byte_bits']:.3f}", f"{cell['boundary_bits']:.3f}",
         f"{cell['total_bits']:.3f}", f"{cell['bytes_per_segment']:.2f}", f"{cell['mean_q']:.3f}")
        for row in rows
        for language, cell in row["elbo_view"].items()
    ]  # fmt: skip
    headers = ("model", "lang", "bytes", "boundary", "total", "B/seg", "mean q")
    print(format_table(headers, cells, align="<>", widths=(24, 4, 7, 8, 7, 8, 6), sep=" ", rule="line"))


def trained_row(
    name: str,
    model: nn.Module,
    args: argparse.Namespace,
    texts: dict[str, str],
    generator_steps: int | None = None,
) -> dict:
    print(f"training {name} ({model.num_parameters()} parameters) for {args.steps} steps", flush=True)
    start = time.perf_counter()
    train_loss = train(model, args, generator_steps)
    seconds = time.perf_counter() - start
    return dict(model=name, parameters=model.num_parameters(), train_seconds=seconds, train_loss=train_loss,
                bits_per_byte=evaluate(model, texts, args))  # fmt: skip


def matched_threshold(model: nn.Module, args: argparse.Namespace) -> tuple[float, float]:
    """(r, t): r = the router's mean q over 16 fresh training crops (the boundary rate training samples)
    and t its (1 - r) quantile, the threshold at which inference closes segments at that rate."""
    batch = sample_batch(train_token_rows(), 16, args.context, random.Random(args.seed + 1))
    was_training = model.training
    model.eval()
    try:
        probs = lslm_boundary_probabilities(model, batch)[batch >= BYTE_OFFSET].double()
    finally:
        model.train(was_training)
    rate = probs.mean().item()
    return rate, torch.quantile(probs, 1 - rate).item()


def lslm_rows(name: str, model: nn.Module, args: argparse.Namespace, texts: dict[str, str]) -> list[dict]:
    """The trained LSLM evaluated as configured (threshold 0.5), then as "NAME@rate": with its
    `boundary_threshold` set so that inference closes segments at the rate training samples them."""
    generator_steps = None if getattr(args, "lslm_joint", False) else model.config.update_schedule
    row = trained_row(name, model, args, texts, generator_steps)
    rows = [{**row, "elbo_view": evaluate_elbo_view(model, texts, args)}]
    rate, threshold = matched_threshold(model, args)
    print(f"{name}@rate: mean q on train crops {rate:.3f}; boundary_threshold {threshold:.4f} closes as many")
    configured = model.config.boundary_threshold
    model.config.boundary_threshold = threshold
    try:
        rows.append(
            dict(row, model=f"{name}@rate", threshold=threshold, bits_per_byte=evaluate(model, texts, args),
                 elbo_view=evaluate_elbo_view(model, texts, args))
        )  # fmt: skip
    finally:
        model.config.boundary_threshold = configured
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    texts = heldout_texts(args.eval_bytes)
    results, lslms = [], []
    for pooling in args.lslm:
        torch.manual_seed(args.seed)
        lslms.append((pooling, LSLMForCausalLM(lslm_config(args, pooling))))
    if not args.no_baseline:
        lslm_parameters = lslms[0][1].num_parameters() if lslms else None
        model = build_baseline(args, lslm_parameters, sum(args.lslm_layers))
        print(
            f"GPT-2 baseline: n_layer={model.config.n_layer} n_embd={model.config.n_embd} (seed {args.seed})"
        )
        results.append(trained_row("gpt2-byte", model, args, texts))
        if args.save:
            model.save_pretrained(args.save)
            ByteTokenizer().save_pretrained(args.save)
    for pooling, model in lslms:
        results += lslm_rows(f"lslm-{pooling}", model, args, texts)
    for path in args.model:
        model = load_checkpoint(path)
        name = os.path.basename(os.path.normpath(path))
        row = dict(model=name, parameters=model.num_parameters(), train_seconds=None, train_loss=None,
                   bits_per_byte=evaluate(model, texts, args))  # fmt: skip
        if getattr(model.config, "model_type", None) == "lslm":
            row["elbo_view"] = evaluate_elbo_view(model, texts, args)
        results.append(row)
    print_table(results, texts)
    print_elbo_table(results)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"args": vars(args), "results": results}, handle, indent=2)
    return results


if __name__ == "__main__":
    main()
