"""Held-out bits per byte of byte-level causal LMs on the bundled English, Chinese and Japanese text.

Rows of the table:
- "gpt2-byte": a GPT-2 (`hf_concept.evaluation.byte_gpt2_baseline`) on the 261-id byte vocabulary, trained
  here from a fixed seed for `--steps` AdamW steps on the `train` split of every bundled language
  (`hf_concept.data`): each batch row is a random `--context`-token crop of one language's
  `<BoS> bytes`, the language drawn in proportion to its size; lr warms up linearly over the first 10% of
  the steps, then decays by a cosine to 10%. Its shape comes from `--params` (matched with
  `match_gpt2_to`, e.g. to an LSLM's count, at depth `--layers` if given) or `--layers`/`--width`.
- one row per `--model PATH`: any checkpoint that `AutoModelForCausalLM.from_pretrained(PATH,
  trust_remote_code=True)` loads and that predicts the next byte id from the byte ids before it (a GPT-2
  saved with `--save`, for instance). An LSLM also spends bits on segment markers and boundary decisions;
  those come from its own outputs, not from this byte-only count.

Each cell is `bits_per_byte` over the `heldout` split with `--context`-token windows and stride
context/2 (counting rules: `hf_concept.evaluation`'s docstring; a uniform model scores log2(261) = 8.03).
`--quick` is a smoke run: a tiny model, a few steps, the first 512 bytes of each held-out text.

    python benchmarks/eval_bits_per_byte.py [--steps 300] [--params N [--layers L] | --layers 4 --width 128]
        [--context 256] [--batch-size 16] [--lr 2e-3] [--seed 0] [--model PATH ...] [--no-baseline]
        [--save DIR] [--json PATH] [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from hf_concept.data import LANGUAGES, load_text
from hf_concept.evaluation import bits_per_byte, byte_gpt2_baseline
from hf_concept.modeling.tokenization_lslm import BYTE_OFFSET, SEQUENCE_START_ID, VOCAB_SIZE, ByteTokenizer

QUICK = dict(steps=4, layers=1, width=32, context=64, batch_size=4, eval_bytes=512)
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
    if args.no_baseline and not args.model:
        parser.error("--no-baseline leaves nothing to evaluate: add --model PATH")
    return args


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


def learning_rate_factor(step: int, steps: int) -> float:
    warmup = max(1, int(steps * WARMUP_FRACTION))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))


def train_baseline(args: argparse.Namespace) -> tuple[nn.Module, float]:
    """The GPT-2 byte baseline after `args.steps` steps, and its mean training loss over the last 10%."""
    torch.manual_seed(args.seed)
    if args.params is not None:
        model = byte_gpt2_baseline(args.params, n_layer=args.layers, n_positions=args.context)
    else:
        model = byte_gpt2_baseline(n_layer=args.layers or 4, n_embd=args.width, n_positions=args.context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: learning_rate_factor(step, args.steps)
    )
    rows, rng = train_token_rows(), random.Random(args.seed)
    model.train()
    losses = []
    for step in range(args.steps):
        batch = sample_batch(rows, args.batch_size, args.context, rng)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if (step + 1) % max(1, args.steps // 10) == 0 or step + 1 == args.steps:
            print(f"  step {step + 1}/{args.steps}  loss {loss.item():.3f} nats/token", flush=True)
    tail = losses[-max(1, len(losses) // 10) :]
    return model, sum(tail) / len(tail)


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


def load_checkpoint(path: str) -> nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
    vocab = getattr(model.config, "vocab_size", None)
    if vocab != VOCAB_SIZE:
        raise ValueError(f"--model {path}: vocab_size={vocab}, but the byte vocabulary has {VOCAB_SIZE} ids")
    return model


def print_table(results: list[dict], texts: dict[str, str]) -> None:
    sizes = "  ".join(f"{language}={len(text.encode('utf-8'))}" for language, text in texts.items())
    print(f"\nheld-out bits per byte (bytes scored: {sizes}; uniform = {math.log2(VOCAB_SIZE):.2f})")
    header = f"{'model':<24} {'params':>10} {'train s':>8} {'train loss':>10} " + " ".join(
        f"{language:>7}" for language in LANGUAGES
    )
    print(header)
    print("-" * len(header))
    for row in results:
        train_s = f"{row['train_seconds']:.1f}" if row["train_seconds"] is not None else "-"
        train_loss = f"{row['train_loss']:.3f}" if row["train_loss"] is not None else "-"
        cells = " ".join(f"{row['bits_per_byte'][language]:>7.3f}" for language in LANGUAGES)
        print(f"{row['model']:<24} {row['parameters']:>10} {train_s:>8} {train_loss:>10} {cells}")


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    texts = heldout_texts(args.eval_bytes)
    results = []
    if not args.no_baseline:
        print(f"training the GPT-2 byte baseline for {args.steps} steps (seed {args.seed})", flush=True)
        start = time.perf_counter()
        model, train_loss = train_baseline(args)
        seconds = time.perf_counter() - start
        if args.save:
            model.save_pretrained(args.save)
            ByteTokenizer().save_pretrained(args.save)
        results.append(
            dict(model="gpt2-byte", parameters=model.num_parameters(), train_seconds=seconds,
                 train_loss=train_loss, bits_per_byte=evaluate(model, texts, args))
        )  # fmt: skip
    for path in args.model:
        model = load_checkpoint(path)
        results.append(
            dict(model=os.path.basename(os.path.normpath(path)), parameters=model.num_parameters(),
                 train_seconds=None, train_loss=None, bits_per_byte=evaluate(model, texts, args))
        )  # fmt: skip
    print_table(results, texts)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"args": vars(args), "results": results}, handle, indent=2)
    return results


if __name__ == "__main__":
    main()
