"""Does the LSLM find known word boundaries? Train it on a synthetic language with a fixed prefix-free
dictionary (`hf_concept.data.synthetic_words`) next to a matched byte baseline, then report boundary
precision / recall against the true word starts and held-out bits per byte of both.

Every batch is fresh text (no text is seen twice); the held-out texts come from another seed. The prior
mean is the language's word-start rate, everything else is `LSLMConfig`'s defaults unless a flag says
otherwise. Run:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lslm_synthetic.py --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time

import torch
import torch.nn.functional as F

from hf_concept.data.synthetic_words import SyntheticText, SyntheticWords
from hf_concept.evaluation import byte_decoder_baseline
from hf_concept.modeling.configuration_lslm import LSLMConfig
from hf_concept.modeling.modeling_lslm import LSLMForCausalLM
from hf_concept.modeling.tokenization_lslm import BYTE_OFFSET, SEQUENCE_START_ID
from hf_concept.training.lslm import drop_other_group_gradients, is_inference_parameter

# Who decides the segment ends (`--ends`): "gold" feeds the true word ends through the LSLM's
# `inference_decisions`, the hook every non-router `boundary_source` goes through in training and eval.
ENDS = ("router", "gold", "random", "every")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (model init and batches)")
    parser.add_argument("--language-seed", type=int, default=0, help="seed of the dictionary")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=128, help="bytes per row (after <BoS>)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", default="1,3,1", help="token,segment,decoder layers of the LSLM")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--heldout-rows", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument(
        "--clip-after-drop", action="store_true", help="clip each phase's own gradients (interleaved updates)"
    )
    parser.add_argument("--joint", action="store_true", help="update every parameter at every step")
    parser.add_argument(
        "--router-lr-factor", type=float, default=1.0, help="the router's peak lr as a multiple of --lr"
    )
    parser.add_argument(
        "--set", action="append", default=[], help='LSLMConfig field=value (JSON value), e.g. prior_loss="kl"'
    )
    parser.add_argument(
        "--ends",
        choices=ENDS,
        default="router",
        help="who decides the LSLM's segment ends in training and evaluation: its router (the default), "
        "the true word ends (an oracle: what the objective gains from words), random ends at the word-start "
        "rate, or every byte",
    )
    parser.add_argument("--json", default=None, help="append one JSON line per seed here")
    return parser.parse_args(argv)


def rows_of(texts: list[SyntheticText], context: int) -> torch.Tensor:
    """(B, 1 + context) ids: `<BoS>` then the first `context` bytes of each text."""
    return torch.tensor(
        [
            [SEQUENCE_START_ID, *(BYTE_OFFSET + byte for byte in text.text.encode()[:context])]
            for text in texts
        ]
    )


def sample_rows(
    language: SyntheticWords, count: int, context: int, rng: random.Random
) -> list[SyntheticText]:
    # Words are at most 6 letters and at least 2: context // 2 + 1 words always fill the row.
    return [language.sample(context // 2 + 1, rng) for _ in range(count)]


def lslm_model(args: argparse.Namespace, prior_mean: float) -> LSLMForCausalLM:
    token, segment, decoder = (int(part) for part in args.layers.split(","))
    fields = dict(
        vocab_size=261,
        hidden_size=args.width,
        intermediate_size=4 * args.width,
        num_attention_heads=heads(args.width),
        token_encoder_layers=token,
        segment_encoder_layers=segment,
        decoder_layers=decoder,
        max_position_embeddings=args.context + 8,
        prior_mean=prior_mean,
    )
    if args.ends != "router":
        # "gold" takes the given-ends path of a non-router source, its ends replaced (`GoldEnds`).
        fields["boundary_source"] = "every" if args.ends == "gold" else args.ends
    for item in args.set:
        name, _, value = item.partition("=")
        fields[name] = json.loads(value)
    return LSLMForCausalLM(LSLMConfig(**fields))


class GoldEnds:
    """The true word ends as an LSLM's segment ends: installed over `LSLMModel.inference_decisions`, it
    answers with the ends of the texts last given to `use` (position p ends a segment when byte p, the
    one after it, starts a word; position 0 is `<BoS>`)."""

    def __init__(self, model: LSLMForCausalLM) -> None:
        self.table: torch.Tensor | None = None
        model.model.inference_decisions = self.decisions

    def use(self, texts: list[SyntheticText], context: int) -> None:
        table = torch.zeros(len(texts), context + 1, dtype=torch.bool)
        for row, text in enumerate(texts):
            table[row, [start for start in text.word_starts if start <= context]] = True
        self.table = table

    def decisions(self, probs: torch.Tensor, counted: torch.Tensor, view) -> torch.Tensor:
        return self.table.gather(1, view.position_ids) & counted


def heads(width: int) -> int:
    return max(width // 32, 1) * 2


def baseline_model(args: argparse.Namespace) -> torch.nn.Module:
    """The project's own byte decoder at the LSLM's width and total depth (`byte_decoder_baseline`)."""
    depth = sum(int(part) for part in args.layers.split(","))
    return byte_decoder_baseline(
        depth, args.width, head_dim=args.width // heads(args.width), n_positions=args.context + 8
    )


def lr_factor(steps: int):
    """The LR multiplier per step: 10% linear warm-up, then cosine down to 10%."""
    warmup = max(1, steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def parameter_groups(model, args) -> list[dict]:
    """AdamW's groups: the router's parameters at `--router-lr-factor` × `--lr` (an LSLM), the rest at
    `--lr`."""
    router = [p for name, p in model.named_parameters() if is_inference_parameter(name)]
    rest = [p for name, p in model.named_parameters() if not is_inference_parameter(name)]
    groups = [{"params": rest, "lr": args.lr}]
    if router:
        groups.append({"params": router, "lr": args.lr * args.router_lr_factor})
    return groups


def train(
    model, args, language, rng: random.Random, interleave: int | None, gold: GoldEnds | None = None
) -> list[float]:
    optimizer = torch.optim.AdamW(parameter_groups(model, args), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(args.steps))
    model.train()
    losses = []
    for step in range(args.steps):
        texts = sample_rows(language, args.batch_size, args.context, rng)
        if gold is not None:
            gold.use(texts, args.context)
        batch = rows_of(texts, args.context)
        output = model(input_ids=batch, labels=batch)
        optimizer.zero_grad(set_to_none=True)
        output.loss.backward()
        if interleave is not None and args.clip_after_drop:
            drop_other_group_gradients(model, step, interleave)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if interleave is not None and not args.clip_after_drop:
            drop_other_group_gradients(model, step, interleave)
        optimizer.step()
        schedule.step()
        losses.append(output.loss.item())
        if (step + 1) % max(1, args.steps // 6) == 0:
            rate = getattr(output, "boundary_rate", None)
            extra = (
                ""
                if rate is None
                else f" rate {rate.item():.3f} expected {output.expected_boundary_rate.item():.3f}"
            )
            print(f"    step {step + 1} loss {output.loss.item():.3f}{extra}", file=sys.stderr, flush=True)
    return losses


@torch.no_grad()
def evaluate(model, texts: list[SyntheticText], context: int) -> dict:
    """Bits per byte over the held-out rows (softmax over the 256 byte ids: a valid code for both models,
    the LSLM's segmentation being causal in eval mode) and, for an LSLM, the boundary figures."""
    model.eval()
    ids = rows_of(texts, context)
    output = model(input_ids=ids)
    logits = output.logits[:, :-1, BYTE_OFFSET : BYTE_OFFSET + 256].double()
    targets = ids[:, 1:] - BYTE_OFFSET
    nats = F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1), reduction="sum").item()
    figures = {"bits_per_byte": nats / (targets.numel() * math.log(2))}
    opens = getattr(output, "boundaries", None)
    if opens is not None:
        # Column c >= 2 is byte c - 1 of the text; column 1 (the first byte) is forced open, left out.
        predicted = opens[:, 2:].bool()
        gold = torch.zeros_like(predicted)
        for row, text in enumerate(texts):
            for start in text.word_starts:
                if 1 <= start < context:
                    gold[row, start - 1] = True
        hits = (predicted & gold).sum().item()
        figures.update(
            precision=hits / max(predicted.sum().item(), 1),
            recall=hits / max(gold.sum().item(), 1),
            open_rate=predicted.float().mean().item(),
            gold_rate=gold.float().mean().item(),
        )
        # The router's q behind those opens: whether it separates word starts at all, or is a constant
        # whose running sum opens at fixed intervals (the "rate" rule).
        probs = output.boundary_probs[:, 2:].double()
        figures.update(
            q_word_starts=probs[gold].mean().item(),
            q_elsewhere=probs[~gold].mean().item(),
            q_std=probs.std().item(),
        )
    return figures


def run_seed(args: argparse.Namespace, seed: int) -> dict:
    language = SyntheticWords(seed=args.language_seed)
    heldout = sample_rows(
        language, args.heldout_rows, args.context, random.Random(10_000 + args.language_seed)
    )
    word_rate = sum(len(t.word_starts) for t in heldout) / sum(len(t.text) for t in heldout)
    result: dict = {"seed": seed, "word_start_rate": word_rate, "settings": args.set, "steps": args.steps}
    result["ends"] = args.ends
    torch.manual_seed(seed)
    model = lslm_model(args, prior_mean=round(word_rate, 3))
    gold = GoldEnds(model) if args.ends == "gold" else None
    started = time.perf_counter()
    schedule = None if args.joint else model.config.update_schedule
    train(model, args, language, random.Random(seed), schedule, gold)
    if gold is not None:
        gold.use(heldout, args.context)
    result["lslm"] = evaluate(model, heldout, args.context)
    result["lslm"]["seconds"] = time.perf_counter() - started
    result["lslm"]["parameters"] = sum(p.numel() for p in model.parameters())
    if not args.no_baseline:
        torch.manual_seed(seed)
        baseline = baseline_model(args)
        started = time.perf_counter()
        train(baseline, args, language, random.Random(seed), None)
        result["baseline"] = evaluate(baseline, heldout, args.context)
        result["baseline"]["seconds"] = time.perf_counter() - started
        result["baseline"]["parameters"] = sum(p.numel() for p in baseline.parameters())
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    for seed in (int(part) for part in args.seeds.split(",")):
        result = run_seed(args, seed)
        print(json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(result) + "\n")
        results.append(result)
    return results


if __name__ == "__main__":
    main()
