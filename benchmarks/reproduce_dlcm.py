"""DLCM §8 at toy scale: does the learned boundary predictor creep away from its target ratio while the
rule-based one holds it (§8.1, Figure 8), and does the Global Parser realise the target better than
per-sequence regularisation, with content-adaptive concept lengths (§8.2–8.3, Tables 4–5)?

Three configurations, each trained from the same seed on the very same batches (per seed), R = 4:
- "learned-global": the learned cosine router (sampled in training, thresholded at 0.5 in inference),
  the H-Net smoothing (`smoothing="ema"`, through which the LM loss reaches the router: the gradient
  §8.1's eq. 24 is about) and the Global Parser (`ratio_scope="global"`: F and G over every token of the
  optimizer step, accumulated over its micro-batches with a `RatioAccumulator`);
- "rule-global": the rule router (§8.1: boundary where ½(1 − cos(h_{t−1}, h_t)) > 0.5; no parameters, its
  probabilities kept out of the LM loss), otherwise the same; the ratio loss still shapes the encoder's
  states h, as the paper's rule predictor is regularised too;
- "learned-normal": as learned-global with the ratio loss per sequence (`ratio_scope="sequence"`, the
  "Normal" row of Table 4).
Everything else is `DLCMConfig`'s defaults (λ = `aux_loss_weight` = 0.03, Bernoulli noise, τ = 6) and one
architecture (`--width`, concept stage twice as wide, `--layers` encoder/concept/decoder layers, heads of
width 16, MLPs 3× wide), the bundled BPE tokenizer (`hf_concept.data.bpe`, 3072 ids). Optimiser: AdamW,
peak lr `--lr`, 10% warm-up then cosine to 10%, clip 1.0; each step is `--batch-size` crops of
`--context` tokens of one train document (drawn in proportion to its length) in `--accumulation`
micro-batches, the loss normalised as `Trainer` does (`num_items_in_batch`). No value was tuned: the
paper's R and the config defaults; lr and size are the demo's scale.

Figures:
- over training (Figure 8): each step's realised ratio on its own batch, sampled (the boundaries the step
  used) and inference (thresholded, `inference_compression_ratio`), as real tokens per concept; the table
  gives it at 10%, 25%, 50%, 75% and 100% of training (mean over a window of 5% of the steps);
- held-out (Table 4; the corpus's `validation` split, `hf_concept.data.corpus`, never used for a choice):
  LM loss in nats per token and the inference ratio, in non-overlapping windows of `--context` tokens
  per document (each window starts a concept at its first token), and the ratio training's sampler
  would give (`sampled_compression_ratio`); average concept length (tokens per concept, inference) per
  content type: prose (English prose and docs), code (Python, JavaScript, C/Go/Rust, shell/SQL), zh, ja.
Mean ± sample std over the seeds; per-seed values and the curves in `--json`; `--png` draws the curves
(needs matplotlib, the `plots` extra). `--quick` is a smoke run (tiny model, 6 steps, one seed).
Each run prints and records `gap` = held-out loss − training LM loss (mean over the last 5% of steps).

`--corpus DIR` trains and scores on a corpus saved by `hf-concept build-corpus` instead (`corpus_data`):
a BPE of the same kind trained on a sample of its train split, each training window read at most once
(one epoch at most; too many steps are refused with the figures), held-out figures on its `held_out`
split (`--heldout-tokens` in the training mix of cells), the content types being its language/kind cells.

`--sweep-dir DIR` runs the same runs as a resumable sweep (`hf_concept.training.sweep`): a manifest of
the runs (configuration, seed), a checkpoint of each run every `--checkpoint-minutes`, one line per
finished run in `DIR/results.jsonl`; started again after a kill, it skips the finished runs and resumes
the others to the figures an uninterrupted run gives. `--status` prints each run as done / running /
left with time estimates, and trains nothing.

    python benchmarks/reproduce_dlcm.py [--seeds 0,1,2] [--steps 400] [--width 64] [--layers 2,3,2]
        [--context 256] [--batch-size 16] [--accumulation 2] [--lr 3e-3] [--threads 2]
        [--json PATH] [--png PATH] [--quick] [--corpus DIR [--heldout-tokens N]]
        [--sweep-dir DIR [--checkpoint-minutes 5] [--status]]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corpus_data
import eval_bits_per_byte as runner

from hf_concept.data.bpe import bundled_tokenizer
from hf_concept.data.corpus import corpus_documents
from hf_concept.modeling.configuration_dlcm import DLCMConfig
from hf_concept.modeling.modeling_dlcm import DLCMForCausalLM
from hf_concept.modeling.routing import RatioAccumulator
from hf_concept.tables import format_table
from hf_concept.training import sweep
from hf_concept.utils import eval_mode

TARGET_RATIO = 4.0
# Ratios and lengths are printed with two decimals.
cell = functools.partial(runner.cell, digits=2)
CONFIGS = {
    "learned-global": dict(router="cosine", ratio_scope="global"),
    "rule-global": dict(router="rule", ratio_scope="global"),
    "learned-normal": dict(router="cosine", ratio_scope="sequence"),
}
CONTENT_TYPES = ("prose", "code", "zh", "ja")
CHECKPOINTS = (0.1, 0.25, 0.5, 0.75, 1.0)
HEAD_WIDTH = 16
QUICK = dict(seeds=(0,), steps=6, width=32, layers=(1, 1, 1), context=64, batch_size=4, accumulation=2)
# Paper figures, for the report: Figure 8 (L = 8192, R = 4: learned ends at ~1.9x, rule holds ~4x) and
# Table 4's bottom row (realised ratio, target 4: Global Parser ~3.9, Normal lower).
PAPER = dict(learned_final=1.9, rule_final=4.0, global_realised=3.9)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=runner.seed_list, default=(0, 1, 2), help="comma-separated seeds")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps, every configuration")
    parser.add_argument("--width", type=int, default=64, help="token width (the concept stage is 2x)")
    parser.add_argument(
        "--layers", type=runner._layer_split, default=(2, 3, 2), help="encoder,concept,decoder"
    )
    parser.add_argument("--context", type=int, default=256, help="tokens per crop and held-out window")
    parser.add_argument("--batch-size", type=int, default=16, help="crops per optimizer step")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--json", default=None, help="write every per-seed figure and curve here")
    parser.add_argument("--png", default=None, help="draw the compression curves here (needs matplotlib)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 6 steps, 1 seed")
    sweep.add_sweep_flags(parser)
    corpus_data.add_corpus_flags(parser)
    args = parser.parse_args(argv)
    runner.apply_quick(args, QUICK, argv)
    for field in ("steps", "context", "batch_size", "accumulation", "threads", "width", "heldout_tokens"):
        if getattr(args, field) < 1:
            parser.error(f"--{field.replace('_', '-')}={getattr(args, field)} must be >= 1")
    if args.batch_size % args.accumulation:
        parser.error(f"--accumulation={args.accumulation} must divide --batch-size={args.batch_size}")
    if args.width % HEAD_WIDTH:
        parser.error(f"--width={args.width} must be a multiple of the head width {HEAD_WIDTH}")
    sweep.check_sweep_flags(parser, args)
    return args


def content_type(name: str) -> str:
    """The content type of a corpus document, by its file name (`corpus_documents` names)."""
    if name in ("zh.txt", "ja.txt"):
        return name.removesuffix(".txt")
    if name == "en.txt" or name.endswith("_en.txt"):
        return "prose"
    return "code"


def tokenized_documents(tokenizer, split: str) -> list[tuple[str, torch.Tensor]]:
    """(content type, (N,) ids) of every document of the corpus's `split`."""
    return [
        (content_type(name), torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"]))
        for name, text in corpus_documents(split)
    ]


def build_model(
    args: argparse.Namespace, name: str, seed: int, vocab_size: int, pad_id: int
) -> DLCMForCausalLM:
    width, concept_width = args.width, 2 * args.width
    config = DLCMConfig(
        vocab_size=vocab_size,
        hidden_size=width,
        intermediate_size=3 * width,
        num_attention_heads=width // HEAD_WIDTH,
        concept_hidden_size=concept_width,
        concept_num_attention_heads=concept_width // HEAD_WIDTH,
        encoder_layers=args.layers[0],
        concept_layers=args.layers[1],
        decoder_layers=args.layers[2],
        compression_ratio=TARGET_RATIO,
        max_position_embeddings=max(args.context, 64),
        pad_token_id=pad_id,
        **CONFIGS[name],
    )
    torch.manual_seed(seed)
    return DLCMForCausalLM(config)


def trainer(
    model: DLCMForCausalLM, args: argparse.Namespace, seed: int, data: dict
) -> tuple[dict, Callable[[int], dict]]:
    """The state a run keeps across a kill (model, AdamW and schedule over `args.steps`, the seed's batch
    generator for bundled text) and its step i, which returns the step's record: the loss, the LM loss
    and both ratios. Batches: `corpus_data.batch_source`."""
    batches, draw = corpus_data.batch_source(data, args, seed)
    torch.manual_seed(seed)
    accumulator = RatioAccumulator(args.accumulation)
    model.ratio_accumulator = accumulator if model.config.ratio_scope == "global" else None
    optimizer, schedule = runner.optimizer_and_schedule(model, args.lr, args.steps)
    model.train()

    def step(index: int) -> dict:
        batch = draw(index)  # (B, L)
        accumulator.reset(batch.numel())
        outputs = runner.optimizer_step(model, optimizer, schedule, batch, args.accumulation)
        record = step_record(outputs)
        if (index + 1) % max(1, args.steps // 10) == 0 or index + 1 == args.steps:
            print(
                f"  step {index + 1}/{args.steps}  loss {record['loss']:.3f}  ratio sampled "
                f"{record['sampled_ratio']:.2f} inference {record['inference_ratio']:.2f}",
                flush=True,
            )
        return record

    return dict(model=model, optimizer=optimizer, schedule=schedule, **batches), step


def step_record(outputs: list) -> dict:
    """A step's loss and LM loss (summed over its micro-batches' shares) and its realised ratios."""
    tokens = sum(micro.numel() for micro, _ in outputs)
    sampled = sum(micro.numel() / output.compression_ratio.item() for micro, output in outputs)
    inference = sum(micro.numel() / output.inference_compression_ratio.item() for micro, output in outputs)
    return dict(
        loss=sum(output.loss.item() for _, output in outputs),
        lm_loss=sum(output.lm_loss.item() for _, output in outputs),
        sampled_ratio=tokens / sampled,
        inference_ratio=tokens / inference,
    )


def train(model: DLCMForCausalLM, args: argparse.Namespace, seed: int, data: dict) -> list[dict]:
    """`args.steps` optimizer steps on the seed's batches; one record per step (`step_record`)."""
    _, step = trainer(model, args, seed, data)
    return [step(index) for index in range(args.steps)]


def heldout_windows(
    documents: list[tuple[str, torch.Tensor]], context: int
) -> list[tuple[str, torch.Tensor]]:
    """Non-overlapping windows of `context` tokens of every document (the last one shorter)."""
    return [
        (kind, ids[start : start + context])
        for kind, ids in documents
        for start in range(0, len(ids), context)
    ]


@torch.no_grad()
def evaluate(model: DLCMForCausalLM, documents: list[tuple[str, torch.Tensor]], context: int) -> dict:
    """Held-out LM loss (nats per token), inference and expected-sampled ratios, concept length per type."""
    totals = {
        kind: dict(nats=0.0, predicted=0, tokens=0, concepts=0, expected=0.0) for kind in types(documents)
    }
    with eval_mode(model):
        for kind, window in heldout_windows(documents, context):
            input_ids = window[None]  # (1, L)
            outputs = model.model(input_ids=input_ids, use_cache=False)
            logits = model.scale_logits(model.lm_head(outputs.last_hidden_state))
            nats = torch.nn.functional.cross_entropy(logits[0, :-1].float(), window[1:], reduction="sum")
            cell = totals[kind]
            cell["nats"] += nats.item()
            cell["predicted"] += len(window) - 1
            cell["tokens"] += len(window)
            cell["concepts"] += int(outputs.boundaries.sum())
            cell["expected"] += float(model.expected_boundaries(outputs).sum())
    every = {
        key: sum(cell[key] for cell in totals.values())
        for key in ("nats", "predicted", "tokens", "concepts", "expected")
    }
    return dict(
        loss=every["nats"] / every["predicted"],
        inference_ratio=every["tokens"] / every["concepts"],
        sampled_ratio=every["tokens"] / every["expected"],
        concept_length={kind: cell["tokens"] / max(cell["concepts"], 1) for kind, cell in totals.items()},
        loss_by_type={kind: cell["nats"] / max(cell["predicted"], 1) for kind, cell in totals.items()},
    )


def types(documents: list[tuple[str, torch.Tensor]]) -> list[str]:
    """The content types of `documents`: `CONTENT_TYPES` for the bundled corpus, "language/kind" cells
    for a `--corpus` (in their order)."""
    present = dict.fromkeys(kind for kind, _ in documents)
    return [kind for kind in CONTENT_TYPES if kind in present] + [
        k for k in present if k not in CONTENT_TYPES
    ]


def at_fraction(history: list[dict], key: str, fraction: float) -> float:
    """The mean of `key` over a window of 5% of the steps ending at `fraction` of training."""
    end = max(1, round(len(history) * fraction))
    width = max(1, len(history) // 20)
    return statistics.fmean(entry[key] for entry in history[max(0, end - width) : end])


def run(args: argparse.Namespace, name: str, seed: int, data: dict) -> dict:
    """Train configuration `name` from `seed` and score it; under `--sweep-dir` as a resumable run."""

    def build():
        model = build_model(args, name, seed, data["vocab_size"], data["pad_id"])
        print(f"[seed {seed}] {name}: {model.num_parameters()} parameters, {args.steps} steps", flush=True)
        start = time.perf_counter()
        stateful, step = trainer(model, args, seed, data)

        def finish(history: list[dict]) -> dict:
            train_seconds = time.perf_counter() - start
            heldout = evaluate(model, data["heldout"], args.context)
            curve = {key: at_fraction_table(history, key) for key in ("sampled_ratio", "inference_ratio")}
            train_loss = at_fraction(history, "lm_loss", 1.0)
            return dict(config=name, seed=seed, parameters=model.num_parameters(), heldout=heldout,
                        curve=curve, history=history, train_loss=train_loss, gap=heldout["loss"] - train_loss,
                        train_seconds=train_seconds,
                        eval_seconds=time.perf_counter() - start - train_seconds)  # fmt: skip

        return stateful, step, finish

    folder = Path(args.sweep_dir) if args.sweep_dir else None
    record = sweep.run_or_resume(
        folder, run_spec(args, name, seed), build, args.steps, args.checkpoint_minutes
    )
    print(
        f"[seed {seed}] {name}: held-out loss {record['heldout']['loss']:.3f}, training loss "
        f"{record['train_loss']:.3f} (last 5%), gap {record['gap']:+.3f}, inference ratio "
        f"{record['heldout']['inference_ratio']:.2f}; train {record['train_seconds']:.0f}s, eval "
        f"{record['eval_seconds']:.0f}s",
        flush=True,
    )
    return record


def run_spec(args: argparse.Namespace, name: str, seed: int) -> sweep.RunSpec:
    """The sweep's run of configuration `name` and `seed`, with the flags that change its result (torch
    threads too: they can move the last bits)."""
    shared = ("steps", "width", "layers", "context", "batch_size", "accumulation", "lr", "threads")
    settings = dict({field: getattr(args, field) for field in shared}, changes=CONFIGS[name])
    settings.update(corpus_data.corpus_settings(args))
    return sweep.RunSpec("dlcm", name, seed, settings)


def sweep_specs(args: argparse.Namespace) -> list[sweep.RunSpec]:
    """The sweep's manifest runs, in `main`'s order."""
    return [run_spec(args, name, seed) for seed in args.seeds for name in CONFIGS]


def at_fraction_table(history: list[dict], key: str) -> dict[str, float]:
    return {f"{fraction:g}": at_fraction(history, key, fraction) for fraction in CHECKPOINTS}


def by_config(runs: list[dict]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = {}
    for entry in runs:
        grouped.setdefault(entry["config"], []).append(entry)
    return grouped


def print_curve_table(runs: list[dict]) -> None:
    print(f"\n[Figure 8] realised tokens per concept on the training batches, target R = {TARGET_RATIO:g}")
    fractions = [f"{fraction:.0%}" for fraction in CHECKPOINTS]
    widths = (32, *[16] * len(CHECKPOINTS))
    for key in ("inference_ratio", "sampled_ratio"):
        rows = [
            [f"  {name}", *(cell([r["curve"][key][f"{f:g}"] for r in group]) for f in CHECKPOINTS)]
            for name, group in by_config(runs).items()
        ]
        print(format_table([key.replace("_", " "), *fractions], rows, align="<>", widths=widths, sep=""))


def content_spread(run: dict) -> float:
    """A run's longest / shortest held-out concept length (inference) over the content types (§8.3)."""
    lengths = run["heldout"]["concept_length"].values()
    return max(lengths) / min(lengths)


def print_heldout_table(runs: list[dict], split: str = "bundled corpus's validation split") -> None:
    print(f"\n[Table 4] held-out ({split}), target R = {TARGET_RATIO:g}")
    rows = []
    for name, group in by_config(runs).items():
        figures = [[r["heldout"][key] for r in group] for key in ("loss", "inference_ratio", "sampled_ratio")]
        rows.append([name, runner.cell(figures[0], 3), cell(figures[1]), cell(figures[2])])
    headers = ("configuration", "loss (nats/token)", "inference ratio", "sampled ratio")
    print(format_table(headers, rows, align="<>", widths=(18, 20, 18, 16), sep=""))
    kinds = list(runs[0]["heldout"]["concept_length"])
    print("\n[§8.3] average concept length (tokens per concept, inference) per content type")
    rows = []
    for name, group in by_config(runs).items():
        lengths = {kind: [r["heldout"]["concept_length"][kind] for r in group] for kind in kinds}
        spread = [content_spread(r) for r in group]
        rows.append([name, *(cell(lengths[kind]) for kind in kinds), cell(spread)])
    headers = ("configuration", *kinds, "max/min")
    print(format_table(headers, rows, align="<>", widths=(18, *[14] * (len(kinds) + 1)), sep=""))


def directions(runs: list[dict]) -> dict[str, bool | str]:
    """The paper's directions: the target checks yes / no on the seed means, the comparisons of two
    configurations `runner.paired_verdict` on their per-seed paired differences (same seed, same
    batches)."""
    grouped = by_config(runs)

    def mean(name: str, pick) -> float:
        return statistics.fmean(pick(r) for r in grouped[name])

    def final(name: str) -> float:
        return mean(name, lambda r: r["curve"]["inference_ratio"]["1"])

    def early(name: str) -> float:
        return mean(name, lambda r: r["curve"]["inference_ratio"]["0.1"])

    def paired(lower: str, higher: str, pick) -> str:
        return runner.paired_verdict(runner.seed_differences(grouped[lower], grouped[higher], pick))

    def miss(run: dict) -> float:
        return abs(run["heldout"]["inference_ratio"] - TARGET_RATIO)

    return {
        "learned creeps below target (end < 90% of R and < its 10% value)": final("learned-global")
        < 0.9 * TARGET_RATIO
        and final("learned-global") < early("learned-global"),
        "rule holds the target (end within ±10% of R)": abs(final("rule-global") / TARGET_RATIO - 1) <= 0.1,
        "global nearer the target than normal (held-out inference ratio)": paired(
            "learned-global", "learned-normal", miss
        ),
        "global held-out loss < normal": paired(
            "learned-global", "learned-normal", lambda r: r["heldout"]["loss"]
        ),
        # §8.3: the concept length follows the content more under the Global Parser (a larger spread).
        "normal's content spread < global's (longest / shortest concept length)": paired(
            "learned-normal", "learned-global", content_spread
        ),
    }


def draw(runs: list[dict], path: str) -> bool:
    """Curves of the realised ratio over training per configuration (mean over seeds, min–max band)."""
    plt = runner.pyplot_or_none(path)
    if plt is None:
        return False
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for axis, key in zip(axes, ("inference_ratio", "sampled_ratio"), strict=True):
        for name, group in by_config(runs).items():
            curves = torch.tensor([smooth([entry[key] for entry in r["history"]]) for r in group])
            steps = range(1, curves.shape[1] + 1)
            axis.plot(steps, curves.mean(0), label=name)
            axis.fill_between(steps, curves.min(0).values, curves.max(0).values, alpha=0.2)
        axis.axhline(
            TARGET_RATIO, color="grey", linestyle="--", linewidth=1, label=f"target R = {TARGET_RATIO:g}"
        )
        # Log scale: the first hundred steps reach ~100 tokens per concept, the rest sits near R.
        axis.set_yscale("log", base=2)
        axis.set_title(f"{key.replace('_', ' ')} (tokens per concept)")
        axis.set_xlabel("optimizer step")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def smooth(values: list[float]) -> list[float]:
    """Running mean over the last 5% of the steps (at least one)."""
    width = max(1, len(values) // 20)
    return [statistics.fmean(values[max(0, index + 1 - width) : index + 1]) for index in range(len(values))]


def mean_smoothed(runs: list[dict], key: str) -> list[float]:
    """`key` over each run's training history, smoothed (`smooth`) and averaged over the runs (seeds)."""
    curves = [smooth([step[key] for step in run["history"]]) for run in runs]
    return [statistics.fmean(column) for column in zip(*curves, strict=True)]


def load_data(args: argparse.Namespace) -> dict:
    """The bundled corpus's train rows and validation documents (BPE `bundled_tokenizer`), or with
    `--corpus` the saved corpus's (`corpus_data.load_corpus`)."""
    if getattr(args, "corpus", None):
        return corpus_data.load_corpus(args)
    tokenizer = bundled_tokenizer()
    # Whole documents are tokenized at once and cut into windows here: no length warning for them.
    tokenizer.model_max_length = 1 << 30
    train_documents = tokenized_documents(tokenizer, "train")
    rows = [ids for _, ids in train_documents if len(ids) > args.context]
    heldout = tokenized_documents(tokenizer, "validation")
    sizes = {kind: sum(len(ids) for k, ids in heldout if k == kind) for kind in CONTENT_TYPES}
    print(
        f"train: {sum(len(r) for r in rows)} tokens in {len(rows)} documents; held-out tokens {sizes}",
        flush=True,
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return dict(rows=rows, heldout=heldout, vocab_size=len(tokenizer), pad_id=pad_id, heldout_tokens=sizes)


_LOADED: dict = {}


def load_data_once(args: argparse.Namespace) -> dict:
    """`load_data`, once per process: the reproductions' worker processes each load the corpus once."""
    if "data" not in _LOADED:
        _LOADED["data"] = load_data(args)
    return _LOADED["data"]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.sweep_dir and sweep.open_sweep_or_exit(args, lambda: sweep_specs(args)):
        return {}
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    data = load_data(args)
    corpus_data.require_windows(data, args, args.steps, "each run")
    runs = [run(args, name, seed, data) for seed in args.seeds for name in CONFIGS]
    wall = time.perf_counter() - start
    print_curve_table(runs)
    print_heldout_table(runs, f"{args.corpus}'s held_out split" if args.corpus else "corpus validation split")
    verdict = directions(runs)
    print("\n[directions] " + "; ".join(f"{key}: {runner.answer(value)}" for key, value in verdict.items()))
    runner.print_wall_time(args, wall)
    drawn = draw(runs, args.png) if args.png else False
    return runner.write_result(
        args, seeds=list(args.seeds), wall_seconds=wall, runs=runs, directions=verdict,
        heldout_tokens=data["heldout_tokens"], png=args.png if drawn else None, paper=PAPER,
    )  # fmt: skip


if __name__ == "__main__":
    main()
