"""LSLM at toy scale: does a latent-segment LM beat a parameter-matched byte GPT-2 on Chinese and Japanese
(LSLM Table 1, §4.1), and does it learn a non-uniform segmentation? Three seeds, six models (a seventh
opt-in) and two count references, one runner.

Models, per seed (each built right after `torch.manual_seed(seed)`), trained one after the other on the
very same batches (`eval_bits_per_byte.train`: crops of `--context` tokens of the en/zh/ja `train` split,
language drawn in proportion to its size), steps, AdamW, peak lr, weight decay and schedule (10% linear
warm-up, cosine to 10%):
- "gpt2": `hf_concept.evaluation.byte_gpt2_baseline` at the LSLM's width (`--width`) and head width (32),
  its depth the one whose parameter count is nearest the LSLM's (`gpt2_num_parameters`); the run stops
  unless the counts are within 5%.
- "byte": the fair baseline, `hf_concept.evaluation.byte_decoder_baseline`: the project's own
  decoder (SwiGLU, RMSNorm, RoPE: the layers of the LSLM's stages) at the LSLM's width and total depth
  (`--layers` summed), heads of width 32; matched by shape, not by parameter count (it has no router,
  cross-attention or second embedding). The GPT-2 row stays for reference.
- "lslm": `LSLMForCausalLM` with `--layers` token/segment/decoder layers (1 + 3 + 1 by default: the
  paper's 4 + 10 + 4 proportions at five layers), every stage `--width` wide, heads of width 32, MLPs 4x
  wide, and `LSLMConfig`'s defaults, the paper's setting: the Beta prior on the boundary rate (mean 0.7,
  concentration 100, `prior_loss="beta_binomial"`), β = `kl_weight` = 1, mean ("dynamic") pooling with
  the Gumbel-sigmoid straight-through estimator into the pooling matrix, the latest segment in the
  decoder's input, the config's update schedule (`update_schedule`: joint updates by default; rows of
  REPRODUCTION.md dated before the change were trained with the paper's interleaving, k = 1), the
  decoder's bytes scored without its `<nxt>` markers (`segment_end_loss`, off by default since the
  hierarchy was measured apart; earlier rows scored them), and `boundary_rule="rate"`.
- "dtp": the same LSLM (same weights at step 0) with `prior_loss="binomial"` (DTP's count prior,
  −log Binomial(k; n, 0.7), weighted by `kl_weight`), all parameters updated at every step whatever
  the config's schedule. DTP's own hourglass architecture is NOT implemented: this row is "dynamic
  pooling with DTP's prior" inside LSLM's architecture.
- "every" and "random": the "lslm" row with `boundary_source="every"` (every byte its own segment) and
  `"random"` (ends at fixed random bytes at the prior mean): the hierarchy without the router.
- "segmental" (opt-in: `--models` must name it, each of its steps costs about five of the LSLM's): the
  "lslm" row with the segmental router estimator (not the paper's; `SEGMENTAL`: 8 flipped bytes per row,
  DTP's count prior at weight 10, which holds the rate).
- "unigram" and "bigram" (references, nothing trained): add-one unigram and interpolated bigram counts
  of the bytes of the very batches the seed's models read (`lslm_rows.count_references`).

Figures (held-out split of every language; never used for any choice):
- bits per byte: `hf_concept.evaluation.bits_per_byte` (windows of `--context`, stride context/2) with
  the softmax over the 256 byte ids (`normalization="bytes"`: a valid, decodable code for every model,
  an LSLM's eval-mode segmentation being a causal function of the bytes read), and beside it the figure
  over all 261 ids that earlier reports gave (for an LSLM it loses the decoder's mass on `<nxt>`);
  bits per character = the same total bits / the number of characters of the scored text;
- for lslm and dtp: the training boundary rate (sampled ends per free byte, `boundary_rate`, and the
  mean q_t, `expected_boundary_rate`, averaged over the last 10% of the steps) against the held-out
  inference rate (share of scored bytes that open a segment in the eval-mode `boundaries`, each byte
  read in the window that scores it; the text's first byte, forced open, left out), with the ±20% check;
  bytes per segment; precision/recall of "a byte opens a segment" against the first byte of each
  whitespace-separated word (en) or each UTF-8 character start (zh, ja: bytes not 0b10xxxxxx), beside
  the share of gold bytes (the precision of segments placed at random); the ELBO view
  (`eval_bits_per_byte.evaluate_elbo_view`: the `<nxt>` bits the decoder spends on top of the bytes);
  one example line per language, segments shown by `|`;
- for every LSLM row: its bits per byte under other evaluation segmentations, the trained model
  unchanged (`lslm_rows.swapped_scores`): random ends at its own held-out rate (a router's; the prior
  mean for "every" and "random") from another hash seed, and every byte its own segment, with the paired
  differences own − swapped (a decoder that uses its segments loses when they are replaced).
- wall time per model (train, eval) and in total; mean ± sample std over the seeds, per-seed values and
  the per-step training curves (loss; sampled boundary rate for lslm and dtp) in `--json`; `--png` draws
  the curves (matplotlib, the `plots` extra; without it the tables are printed and the picture skipped).

`--validation` replaces held-out by a validation slice of the train split (its last ~10% per language,
cut at a line start; the models then train on the rest): the only data any tuning may look at.
`--quick` is a smoke run (tiny models, 4 steps, one seed, 512 held-out bytes per language).

`--corpus DIR` trains and scores on a corpus saved by `hf-concept build-corpus` instead:
batches are windows of `--context` bytes of its train split, each read at most once, in the seed's order
(every model of a seed reads the same ones; `benchmarks/corpus_data.py`), so no byte is seen twice and a
run asking for more windows than the split has is refused; scored are `--heldout-bytes` bytes of each
language/kind cell of its held_out split, in 1 KB pieces spread over all of the cell's text
(`--heldout-sample first`: its first documents, the cut of sweeps begun before the flag), and every
table is per cell. Each run also prints its `gap`: held-out minus training cross-entropy of the bytes in
nats per byte (the held-out figure over all ids, cells weighted by their share of the training bytes,
against the training batches' over the last 5% of the steps).

`--sweep-dir DIR` runs the same models as a resumable sweep (`hf_concept.training.sweep`): a manifest
of the runs (model, seed and the flags that change a result), a checkpoint of each run every
`--checkpoint-minutes`, one line per finished run in `DIR/results.jsonl`; started again after a kill it
skips the finished runs and resumes the others to the results an uninterrupted sweep gives. `--status`
prints each run as done / running / left with time estimates, and trains nothing.

    python benchmarks/reproduce_lslm.py [--seeds 0,1,2] [--steps 400] [--width 96] [--layers 1,3,1]
        [--context 256] [--batch-size 16] [--lr 2e-3] [--weight-decay 0.01] [--threads 1]
        [--eval-bytes N] [--validation] [--json PATH] [--png PATH] [--quick] [--models byte,segmental]
        [--corpus DIR [--heldout-bytes N]]
        [--sweep-dir DIR [--checkpoint-minutes 5] [--status]]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

# The shared runner (sampler, schedule, training loop, evaluation) lives beside this script.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import corpus_data
import eval_bits_per_byte as runner
import lslm_rows
from lslm_report import (
    LSLM_ROWS,
    by_model,
    directions,
    print_boundary_tables,
    print_score_tables,
    print_segmentation_tables,
    print_timings,
)

from hf_concept.data import LANGUAGES, load_text
from hf_concept.evaluation import (
    byte_decoder_baseline,
    byte_gpt2_baseline,
    gpt2_num_parameters,
    padded_windows,
    scoring_windows,
)
from hf_concept.modeling.configuration_lslm import LSLMConfig
from hf_concept.modeling.modeling_lslm import LSLMForCausalLM
from hf_concept.modeling.tokenization_lslm import BYTE_OFFSET, SEQUENCE_START_ID
from hf_concept.training import sweep
from hf_concept.utils import eval_mode

MODELS = ("gpt2", "byte", "lslm", "dtp", "every", "random")
# Rows run only when `--models` names them: "segmental" costs SEGMENTAL["segmental_flips"] + 1 decoder
# passes per row and step.
OPT_IN = ("segmental",)
# Matched by parameters (within MAX_PARAMETER_GAP); "byte" is matched by width and depth instead.
PARAMETER_MATCHED = ("gpt2", "lslm", "dtp", "every", "random", "segmental")
# The "segmental" row: the LSLM with the opt-in estimator (not the paper's), 8 free bytes flipped per row
# (unbiased, `LSLMConfig.segmental_flips`), and DTP's count prior at weight 10, which holds the rate
# where the estimator carries the decoder's whole preference for fewer ends (docs/lslm.md).
SEGMENTAL = dict(boundary_estimator="segmental", segmental_flips=8, prior_loss="binomial", kl_weight=10.0)
# The LSLM rows whose segment ends a `boundary_source` other than the router decides.
SOURCE_ROWS = ("every", "random")
HEAD_WIDTH = 32
MAX_PARAMETER_GAP = 0.05
VALIDATION_FRACTION = 0.1
EXAMPLE_CHARS = 48
# The per-step training curves kept in `--json` and drawn by `--png` (boundary rate: lslm and dtp only).
CURVES = ("loss", "boundary_rate")
QUICK = dict(seeds=(0,), steps=4, width=32, layers=(1, 1, 1), context=64, batch_size=4, eval_bytes=512)
# LSLM Table 1 (byte vocabulary, mean of five runs): the paper's BPC, for the report.
PAPER_TABLE_1 = {
    "gpt2": dict(en=1.418, zh=1.785, ja=1.668),
    "dtp": dict(en=1.379, zh=1.722, ja=1.648),
    "lslm": dict(en=1.390, zh=1.667, ja=1.564),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=runner.seed_list, default=(0, 1, 2), help="comma-separated seeds")
    parser.add_argument("--steps", type=int, default=400, help="AdamW steps, every model")
    parser.add_argument("--width", type=int, default=96, help="width of every stage and of the GPT-2")
    parser.add_argument("--layers", type=runner._layer_split, default=(1, 3, 1), help="token,segment,decoder")
    parser.add_argument("--context", type=int, default=256, help="tokens per training crop and eval window")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    # One thread: on the shared 2-core VM a second busy process made 2-thread steps ~10x slower (measured
    # 5.2 s against 0.5 s per GPT-2 step), one thread kept its pace.
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--eval-bytes", type=int, default=None, help="score only this many bytes per text")
    parser.add_argument("--validation", action="store_true", help="evaluate on a slice of train (tuning)")
    parser.add_argument("--json", default=None, help="write every per-seed figure here")
    parser.add_argument("--png", default=None, help="draw the training curves here (needs matplotlib)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny models, 4 steps, 1 seed")
    parser.add_argument(
        "--models",
        type=model_list,
        default=MODELS,
        help=f"comma-separated rows to train, of {', '.join(MODELS + OPT_IN)} (default: all but "
        f"{', '.join(OPT_IN)}); the count references always run",
    )
    parser.add_argument(
        "--corpus",
        default=None,
        help="train and score on this saved corpus (hf-concept build-corpus): byte windows of its train "
        "split read at most once, held-out figures per language/kind cell of its held_out split",
    )
    parser.add_argument(
        "--heldout-bytes",
        type=int,
        default=corpus_data.HELDOUT_BYTES,
        help="with --corpus: bytes scored per cell",
    )
    corpus_data.add_heldout_sample_flag(parser)
    sweep.add_sweep_flags(parser)
    args = parser.parse_args(argv)
    sweep.check_sweep_flags(parser, args)
    runner.apply_quick(args, QUICK, argv)
    for field in ("steps", "context", "batch_size", "threads", "width"):
        if getattr(args, field) < 1:
            parser.error(f"--{field.replace('_', '-')}={getattr(args, field)} must be >= 1")
    if args.width % HEAD_WIDTH and not args.quick:
        parser.error(f"--width={args.width} must be a multiple of the head width {HEAD_WIDTH}")
    return args


def model_list(text: str) -> tuple[str, ...]:
    """`--models`: known row names, each once, in the order given."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in MODELS + OPT_IN]
    if unknown or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give distinct names of {', '.join(MODELS + OPT_IN)}"
            + (f" ({', '.join(unknown)} unknown)" if unknown else "")
        )
    return names


def runner_args(args: argparse.Namespace, seed: int, name: str) -> argparse.Namespace:
    """The shared runner's namespace for model `name` at `seed` (its parser fills every other field)."""
    defaults = LSLMConfig()
    width = str(args.width)
    argv = [
        "--steps", str(args.steps), "--context", str(args.context), "--batch-size", str(args.batch_size),
        "--lr", str(args.lr), "--weight-decay", str(args.weight_decay), "--seed", str(seed),
        "--threads", str(args.threads), "--lslm", defaults.pooling,
        "--lslm-layers", ",".join(map(str, args.layers)), "--lslm-width", width,
        "--lslm-token-width", width, "--lslm-decoder-width", width,
        "--lslm-prior", str(defaults.prior_mean), "--lslm-kl-weight", str(defaults.kl_weight),
        "--lslm-update-schedule", str(defaults.update_schedule),
        "--lslm-prior-loss", "binomial" if name == "dtp" else defaults.prior_loss,
    ]  # fmt: skip
    if name == "dtp":
        argv.append("--lslm-joint")
    return runner.parse_args(argv)


def build_model(args: argparse.Namespace, name: str, seed: int) -> torch.nn.Module:
    """Model `name` freshly initialised from `seed`; the GPT-2 at the depth that matches the LSLM."""
    shared = runner_args(args, seed, name)
    torch.manual_seed(seed)
    if name in LSLM_ROWS:
        config = runner.lslm_config(shared, shared.lslm[0])
        if name in SOURCE_ROWS:
            config.boundary_source = name
        if name == "segmental":
            for field, value in SEGMENTAL.items():
                setattr(config, field, value)
        return LSLMForCausalLM(config)
    if name == "byte":
        return byte_decoder_baseline(
            sum(args.layers), args.width, head_dim=HEAD_WIDTH, n_positions=args.context
        )
    depth = gpt2_depth(args)
    return byte_gpt2_baseline(n_layer=depth, n_embd=args.width, n_positions=args.context, head_dim=HEAD_WIDTH)


def gpt2_depth(args: argparse.Namespace) -> int:
    """The GPT-2 depth at `--width` whose parameter count is nearest the LSLM's."""
    target = lslm_parameters(args)
    return min(
        range(1, 65), key=lambda depth: abs(gpt2_num_parameters(depth, args.width, args.context) - target)
    )


def lslm_parameters(args: argparse.Namespace) -> int:
    shared = runner_args(args, 0, "lslm")
    with torch.device("meta"):
        return LSLMForCausalLM(runner.lslm_config(shared, shared.lslm[0])).num_parameters()


def check_parameter_match(counts: dict[str, int]) -> None:
    """Every pair of models within `MAX_PARAMETER_GAP` (relative to the smaller), or SystemExit."""
    low, high = min(counts.values()), max(counts.values())
    if high > low * (1 + MAX_PARAMETER_GAP):
        raise SystemExit(f"parameter counts {counts} differ by more than {MAX_PARAMETER_GAP:.0%}")


def split_validation(text: str) -> tuple[str, str]:
    """(fit, validation): validation starts at the first line start at or after 90% of `text`'s bytes."""
    data = text.encode("utf-8")
    newline = data.find(b"\n", int(len(data) * (1 - VALIDATION_FRACTION)))
    if newline == -1 or newline + 1 >= len(data):
        raise ValueError("the train text has no line break in its last 10%: cannot cut a validation slice")
    return data[: newline + 1].decode("utf-8"), data[newline + 1 :].decode("utf-8")


def texts_for(args: argparse.Namespace, data: dict | None) -> tuple[dict[str, str] | None, dict[str, str]]:
    """(training texts, scored texts) per language: train and held-out, or fit and validation; with a
    corpus (`data`), no training texts (its windows are the batches) and its held-out texts per cell."""
    if data is not None:
        return None, data["heldout"]
    if args.validation:
        pairs = {language: split_validation(load_text(language)) for language in LANGUAGES}
        fit = {language: pair[0] for language, pair in pairs.items()}
        scored = {language: pair[1] for language, pair in pairs.items()}
    else:
        fit, scored = {language: load_text(language) for language in LANGUAGES}, runner.heldout_texts(None)
    if args.eval_bytes:
        scored = {
            lang: text.encode()[: args.eval_bytes].decode(errors="ignore") for lang, text in scored.items()
        }
    return fit, scored


def token_rows(texts: dict[str, str]) -> list[torch.Tensor]:
    """`<BoS> bytes` of each text, in `LANGUAGES` order (what `runner.train_token_rows` gives for train)."""
    return [
        torch.tensor([SEQUENCE_START_ID, *(BYTE_OFFSET + b for b in texts[language].encode("utf-8"))])
        for language in LANGUAGES
    ]


@torch.no_grad()
def segmentation_of(model: torch.nn.Module, text: str, context: int, batch_size: int) -> torch.Tensor:
    """(N,) bool over the N bytes of `text`: does the byte open a segment? From eval-mode `boundaries` over
    `bits_per_byte`'s windows (stride context/2), each byte read in the window that scores it, so that its
    decision sees at least context/2 bytes before it (all of them near the start)."""
    tokens = torch.tensor([SEQUENCE_START_ID, *(BYTE_OFFSET + b for b in text.encode("utf-8"))])
    windows = scoring_windows(len(tokens), context, max(1, context // 2))
    opens = torch.zeros(len(tokens), dtype=torch.bool)
    with eval_mode(model):
        for index in range(0, len(windows), batch_size):
            batch = windows[index : index + batch_size]
            input_ids, attention_mask = padded_windows(tokens, batch)
            boundaries = model(input_ids=input_ids, attention_mask=attention_mask).boundaries  # (B, T)
            for row, (start, first, end) in enumerate(batch):
                opens[first:end] = boundaries[row, first - start : end - start]
    return opens[1:]


def gold_starts(language: str, text: str) -> torch.Tensor:
    """(N,) bool: the first byte of each whitespace-separated word (en) or each UTF-8 character start;
    `language` may be a corpus cell ("en/prose")."""
    language = language.split("/")[0]
    data = text.encode("utf-8")
    if language == "en":
        space = torch.tensor([byte in b" \t\n\r\f\v" for byte in data])
        previous = torch.cat([torch.tensor([True]), space[:-1]])
        return ~space & previous
    return torch.tensor([byte & 0xC0 != 0x80 for byte in data])


def boundary_agreement(opens: torch.Tensor, gold: torch.Tensor) -> dict[str, float]:
    """Rate, bytes per segment, precision/recall of `opens` against `gold`; the first byte (forced open
    after `<BoS>`) is left out of everything but bytes per segment."""
    predicted, reference = opens[1:], gold[1:]
    hits = int((predicted & reference).sum())
    return dict(
        rate=float(predicted.float().mean()),
        bytes_per_segment=len(opens) / max(1, int(opens.sum())),
        precision=hits / max(1, int(predicted.sum())),
        recall=hits / max(1, int(reference.sum())),
        gold_rate=float(reference.float().mean()),
    )


def render_segments(text: str, opens: torch.Tensor, offset: int, chars: int) -> str:
    """`chars` characters of `text` from byte `offset` (a character start), `|` before each character
    whose first byte opens a segment, `·` after one that a segment opens inside (between its bytes)."""
    pieces, position = [], offset
    for char in text.encode("utf-8")[offset:].decode("utf-8")[:chars]:
        size = len(char.encode("utf-8"))
        inside = bool(opens[position + 1 : position + size].any())
        pieces.append(("|" if opens[position] else "") + char.replace("\n", "⏎") + ("·" if inside else ""))
        position += size
    return "".join(pieces)


def example_offset(text: str) -> int:
    """Byte offset of the first line of `text` with at least `EXAMPLE_CHARS` characters (else 0): a
    choice by length alone, made before any model looks at the text."""
    offset = 0
    for line in text.split("\n"):
        if len(line) >= EXAMPLE_CHARS:
            return offset
        offset += len(line.encode("utf-8")) + 1
    return 0


def train_rates(history: list[dict]) -> dict[str, float]:
    """Mean of each recorded training metric (the LSLM's `boundary_rate`, `expected_boundary_rate`, the
    share the inference rule would close, losses) over the last 10% of the steps."""
    tail = history[-max(1, len(history) // 10) :]
    names = [name for name in tail[0] if all(name in step for step in tail)]
    return {name: statistics.fmean(step[name] for step in tail) for name in names}


def evaluate_segmenter(model, shared: argparse.Namespace, texts: dict[str, str]) -> dict:
    """Boundary figures of a trained LSLM on the scored `texts` (see the module docstring)."""
    per_language, opened, scored = {}, 0, 0
    for language, text in texts.items():
        opens = segmentation_of(model, text, shared.context, shared.batch_size)
        cell = boundary_agreement(opens, gold_starts(language, text))
        offset = example_offset(text)
        cell["example"] = render_segments(text, opens, offset, EXAMPLE_CHARS)
        per_language[language] = cell
        opened, scored = opened + int(opens[1:].sum()), scored + len(opens) - 1
    elbo = runner.evaluate_elbo_view(model, texts, shared)
    for language, cell in per_language.items():
        cell.update(boundary_bits=elbo[language]["boundary_bits"], mean_q=elbo[language]["mean_q"])
    return dict(languages=per_language, pooled_rate=opened / max(1, scored))


def tail_loss(history: list[dict]) -> float:
    """The mean loss over the last 10% of the steps (`runner.train`'s return value)."""
    tail = [step["loss"] for step in history[-max(1, len(history) // 10) :]]
    return sum(tail) / len(tail)


def run_spec(args: argparse.Namespace, name: str, seed: int) -> sweep.RunSpec:
    """Model `name` at `seed` in a sweep; its settings are the flags that change its result (torch
    threads too: they can move the last bits)."""
    fields = ("steps", "width", "layers", "context", "batch_size", "lr", "weight_decay", "threads",
              "eval_bytes", "validation")  # fmt: skip
    settings = {field: getattr(args, field) for field in fields}
    if args.corpus:
        settings.update(corpus=str(Path(args.corpus).resolve()), heldout_bytes=args.heldout_bytes)
        settings.update(corpus_data.heldout_sample_setting(args))
        if corpus_data.heldout_sample(args) == "spread":
            # The spread sample's pieces come from anywhere in a document since this setting; a sweep
            # begun with the first KB of each document (no such key) does not resume under it.
            settings.update(heldout_spread="pieces")
    return sweep.RunSpec("lslm", name, seed, settings)


def run_model(
    args: argparse.Namespace, name: str, seed: int, fit: dict | None, texts: dict, data: dict | None = None
) -> dict:
    """Train model `name` from `seed` on the shared batches (crops of `fit`, or `data`'s corpus windows in
    the seed's order: every model of a seed reads the same ones), then score it on `texts`; under
    `--sweep-dir` as a resumable run of the sweep."""
    shared = runner_args(args, seed, name)
    model = build_model(args, name, seed)
    generator_steps = None if name in ("gpt2", "byte", "dtp") else model.config.update_schedule
    print(
        f"[seed {seed}] training {name} ({model.num_parameters()} parameters), {args.steps} steps", flush=True
    )
    start = time.perf_counter()
    if data is None:
        stateful, step = runner.trainer(model, shared, generator_steps, token_rows(fit))
    else:
        _, draw = corpus_data.batch_source(data, args, seed)
        stateful, step = runner.trainer(model, shared, generator_steps, [], draw)

    def finish(history: list[dict]) -> dict:
        record = score_model(model, name, seed, shared, texts, history, time.perf_counter() - start)
        if data is not None:
            record["gap"] = heldout_gap(record, history, data["train_bytes"])
            print(f"[seed {seed}] {name}: gap (held-out - training, nats per byte) {record['gap']:+.3f}")
        return record

    if args.sweep_dir:
        spec = run_spec(args, name, seed)
        record = sweep.run_resumable(
            spec, args.sweep_dir, stateful, step, args.steps, finish, args.checkpoint_minutes
        )
    else:
        record = finish([step(index) for index in range(args.steps)])
    print(f"[seed {seed}] {name}: train {record['train_seconds']:.0f}s, eval {record['eval_seconds']:.0f}s",
          flush=True)  # fmt: skip
    return record


def score_model(
    model: torch.nn.Module, name: str, seed: int, shared: argparse.Namespace, texts: dict, history: list,
    train_seconds: float,
) -> dict:  # fmt: skip
    """The record of trained model `name`: bits per byte and per character on `texts`, the training
    curves, and for a segmenter its boundary figures."""
    start = time.perf_counter()
    # The code length over the 256 byte ids (a valid code: each position's logits read the bytes before
    # it alone, an LSLM's segmentation included), and over every output id as earlier reports gave it.
    bpb = lslm_rows.renormalized_bits(model, texts, shared)
    bpb_all = runner.evaluate(model, texts, shared)
    # Bits per character: the same total bits over the text's characters instead of its bytes.
    bpc = {language: bpb[language] * len(text.encode()) / len(text) for language, text in texts.items()}
    record = dict(model=name, seed=seed, parameters=model.num_parameters(), train_loss=tail_loss(history),
                  train_seconds=train_seconds, bits_per_byte=bpb, bits_per_byte_all_ids=bpb_all,
                  bits_per_char=bpc)  # fmt: skip
    kept = [key for key in CURVES if all(key in step for step in history)]
    record["curves"] = {key: [step[key] for step in history] for key in kept}
    if name in LSLM_ROWS:
        record.update(train_rates=train_rates(history), boundary_rule=model.config.boundary_rule,
                      heldout=evaluate_segmenter(model, shared, texts))  # fmt: skip
        record["eval_segmentations"] = lslm_rows.swapped_scores(model, record, shared, texts)
    record["eval_seconds"] = time.perf_counter() - start
    return record


def heldout_gap(record: dict, history: list[dict], train_bytes: dict[str, int]) -> float:
    """Held-out minus training cross-entropy of the bytes, nats per byte: the held-out figure over all
    ids (`bits_per_byte_all_ids`, the cells weighted by their share of the training bytes) against the
    training batches' over the last 5% of the steps (an LSLM's `bits_per_byte` metric, a byte model's
    loss), so that both sides are the same quantity."""
    shares = {cell: train_bytes[cell] for cell in record["bits_per_byte_all_ids"]}
    heldout = sum(record["bits_per_byte_all_ids"][cell] * count for cell, count in shares.items())
    heldout = heldout / sum(shares.values()) * math.log(2)
    tail = history[-max(1, len(history) // 20) :]
    train = [
        step["bits_per_byte"] * math.log(2) if "bits_per_byte" in step else step["loss"] for step in tail
    ]
    return heldout - statistics.fmean(train)


def print_models(counts: dict[str, int], args: argparse.Namespace) -> None:
    print(f"\n[models] width {args.width} everywhere, heads of width {HEAD_WIDTH}")
    shapes = dict(
        gpt2=f"GPT-2 {gpt2_depth(args)} layers",
        byte=f"the project's decoder, {sum(args.layers)} layers (the LSLM's depth)",
        lslm=f"LSLM {'+'.join(map(str, args.layers))} layers, config defaults (update_schedule "
        f"{LSLMConfig().update_schedule})",
        dtp=f"LSLM {'+'.join(map(str, args.layers))} layers, binomial prior, joint",
        every="the LSLM, every byte its own segment (boundary_source='every')",
        random="the LSLM, random ends at the prior mean (boundary_source='random')",
        segmental="the LSLM, " + ", ".join(f"{field}={value!r}" for field, value in SEGMENTAL.items()),
    )
    reference = lslm_parameters(args)
    for name, count in counts.items():
        print(f"{name:<9} {count:>9} parameters ({count / reference - 1:+.1%} vs lslm)  {shapes[name]}")


def reference_runs(args: argparse.Namespace, seed: int, fit: dict | None, data: dict | None, texts: dict):
    """The byte-count references of `seed` (`lslm_rows.count_references`), counted over the very batches
    the models of the seed read, as run records."""
    source = data if data is not None else dict(rows=token_rows(fit))
    _, draw_batch = corpus_data.batch_source(source, args, seed)
    start = time.perf_counter()
    scores = lslm_rows.count_references(draw_batch, args.steps, texts)
    seconds = time.perf_counter() - start
    runs = []
    for name, bpb in scores.items():
        bpc = {lang: bpb[lang] * len(text.encode()) / len(text) for lang, text in texts.items()}
        runs.append(dict(model=name, seed=seed, bits_per_byte=bpb, bits_per_byte_all_ids=bpb, curves={},
                         bits_per_char=bpc, train_seconds=seconds, eval_seconds=0.0))  # fmt: skip
    return runs


def draw(runs: list[dict], path: str) -> bool:
    """The training curves per model, mean over seeds: the loss (nats per predicted token: the GPT-2's
    cross-entropy, the LSLMs' negative ELBO per byte) and the LSLMs' sampled boundary rate."""
    plt = runner.pyplot_or_none(path)
    if plt is None:
        return False
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, key in zip(axes, CURVES, strict=True):
        for name, group in by_model(runs).items():
            if key in group[0]["curves"]:
                curve = torch.tensor([run["curves"][key] for run in group]).mean(0)
                axis.plot(range(1, len(curve) + 1), curve, label=name)
        axis.set(title=f"training {key.replace('_', ' ')} (mean over seeds)", xlabel="optimizer step")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.sweep_dir and sweep.open_sweep_or_exit(
        args, lambda: [run_spec(args, name, seed) for seed in args.seeds for name in args.models]
    ):
        return {}
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    counts = {name: build_model(args, name, 0).num_parameters() for name in args.models}
    check_parameter_match({name: count for name, count in counts.items() if name in PARAMETER_MATCHED})
    print_models(counts, args)
    data = corpus_data.load_byte_corpus(args) if args.corpus else None
    if data is not None:
        corpus_data.require_windows(data, args, args.steps, "each run")
    fit, texts = texts_for(args, data)
    split = "validation" if args.validation else "held-out"
    sizes = ", ".join(f"{lang} {len(text.encode())} B / {len(text)} chars" for lang, text in texts.items())
    print(f"scored ({split}): {sizes}; torch {torch.__version__}, {args.threads} threads", flush=True)
    # A run already in the sweep's results is taken from there, not run again.
    done = sweep.read_results(args.sweep_dir) if args.sweep_dir else {}
    runs = [
        done.get(run_spec(args, name, seed).key) or run_model(args, name, seed, fit, texts, data)
        for seed in args.seeds
        for name in args.models
    ]
    runs += [run for seed in args.seeds for run in reference_runs(args, seed, fit, data, texts)]
    wall = time.perf_counter() - start
    print_score_tables(runs, split)
    print_segmentation_tables(runs, split)
    print_boundary_tables(runs, split)
    print_timings(runs, wall, args)
    verdict = directions(runs)
    print("\n[directions] " + "; ".join(f"{key}: {runner.answer(value)}" for key, value in verdict.items()))
    drawn = draw(runs, args.png) if args.png else False
    return runner.write_result(
        args, split=split, threads=args.threads, seeds=list(args.seeds), parameters=counts,
        gpt2_layers=gpt2_depth(args), wall_seconds=wall, runs=runs, directions=verdict,
        paper_table_1=PAPER_TABLE_1, png=args.png if drawn else None,
    )  # fmt: skip


if __name__ == "__main__":
    main()
