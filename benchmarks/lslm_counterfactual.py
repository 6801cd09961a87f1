"""Probe: what would each end decision cost? Counterfactual (flipped) decisions of the LSLM's router on
the synthetic language with known words.

For a sparse set of bytes per row (one every `--gap`, random offset), the decoder is run again with those
decisions flipped (no gradient, same token states), and each flip's advantage of ending,
A_i = cost(z_i = 0) − cost(z_i = 1), is the change in the decoder's loss over the `--window` bytes from i
(byte targets only with `--bytes-only`; else `<nxt>` targets too where the objective scores them). Under
an otherwise fixed sample this is the exact derivative of the expected cost with respect to q_i ("local
expectation"), truncated to the window. With `--rest inferred` the flips are made against inference's
deterministic decisions instead of the training sample. The script prints A at true word starts against
other bytes, and the AUC of that ordering, as training goes, and can feed A back to the router
(`--feedback`):

- `surrogate`: loss −Σ_i A_i q_i · gap / predicted bytes (optionally centred over the flips);
- `rank`: binary cross-entropy of the router's logits at the flips toward "A in the top prior_mean share";
- `oracle`: the surrogate with A replaced by ±1 at true word starts / other bytes (is the path strong?);
- `supervised`: cross-entropy toward the true word starts (can the router represent them at all?);
- `none`: measure only.

`--router-gradient none` drops the router's gradient from the ELBO (straight-through and prior) and holds
the rate with a squared penalty on each row's mean q instead. Not a shipped estimator: a diagnostic whose
figures are in REPRODUCTION.md. Run:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lslm_counterfactual.py --steps 600 --feedback surrogate
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import lslm_synthetic as synthetic
import torch
import torch.nn.functional as F

from hf_concept.data.synthetic_words import SyntheticWords
from hf_concept.modeling.lslm_loss import scored_targets
from hf_concept.modeling.lslm_segmental import flipped
from hf_concept.modeling.tokenization_lslm import BYTE_OFFSET
from hf_concept.training.lslm import drop_other_group_gradients, is_inference_parameter, update_phase

FEEDBACK = ("none", "surrogate", "rank", "oracle", "supervised")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--gap", type=int, default=16, help="bytes between flipped decisions")
    parser.add_argument("--window", type=int, default=8, help="bytes whose cost a flip is charged")
    parser.add_argument("--feedback", choices=FEEDBACK, default="none")
    parser.add_argument(
        "--rest",
        choices=("sample", "inferred"),
        default="sample",
        help="the decisions the flips are made against: the training sample, or inference's (deterministic)",
    )
    parser.add_argument("--weight", type=float, default=1.0, help="weight of the feedback term")
    parser.add_argument("--center", action="store_true", help="centre A over each step's flips")
    parser.add_argument("--normalize", action="store_true", help="divide A by its spread over the flips")
    parser.add_argument("--bytes-only", action="store_true", help="leave <nxt> targets out of the cost")
    parser.add_argument(
        "--generator-layout",
        choices=("router", "random", "gold"),
        default="router",
        help="train the encoders and decoder on the router's sampled ends, on ends drawn at random at the "
        "prior mean (independent of the router, so the decoder cannot adapt to where the router ends), or on "
        "the true word ends (the optimum: how strong is the signal there?)",
    )
    parser.add_argument("--router-gradient", choices=("elbo", "none"), default="elbo")
    parser.add_argument("--rate-weight", type=float, default=10.0, help="with --router-gradient none")
    parser.add_argument("--joint", action="store_true", help="update every parameter at every step")
    parser.add_argument("--set", action="append", default=[], help="LSLMConfig field=JSON value")
    parser.add_argument("--log-every", type=int, default=60)
    args = parser.parse_args(argv)
    overrides = [part for item in args.set for part in ("--set", item)]
    base = synthetic.parse_args(["--steps", str(args.steps), *overrides])
    for name, value in vars(base).items():
        if name not in vars(args):
            setattr(args, name, value)
    return args


def column_costs(model, view, token_states, segmentation, bytes_only: bool) -> torch.Tensor:
    """(B, T) the decoder's loss charged to each view column: its own slot's target (the next byte, or
    `<nxt>` when the objective scores it: `segment_end_loss`) plus, where it opens a segment, its `<bos>`
    slot's (the byte itself)."""
    inner = model.model
    segments, valid, documents = inner.encode_segments(token_states, segmentation, view)
    slots = inner.decoder_slots(view, segmentation)
    logits = model.lm_head(inner.decode(slots, segments, valid, documents)).float()  # (B, S, V)
    targets = slots.targets
    kept = targets >= BYTE_OFFSET if bytes_only else scored_targets(targets, model.config)
    losses = F.cross_entropy(logits.transpose(1, 2), targets.clamp(min=0), reduction="none") * kept
    last = losses.shape[1] - 1
    own = torch.gather(losses, 1, slots.token_slot.clamp(0, last)) * view.mask
    opening = torch.gather(losses, 1, (slots.token_slot - 1).clamp(0, last)) * segmentation.opens
    return own + opening


def with_free_ends(segmentation, ends: torch.Tensor, view):
    """The segmentation whose router-decided (free) end decisions are `ends`'s; forced ends unchanged."""
    free = view.mask & ~segmentation.forced
    return flipped(segmentation, (segmentation.ends ^ ends) & free, view)


@torch.no_grad()
def advantages(model, seen: dict, args) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, flips), both (B, T): A_i = cost(z_i = 0) − cost(z_i = 1) at the flipped bytes, 0 elsewhere."""
    view, states, segmentation = seen["view"], seen["states"].detach(), seen["segmentation"]
    free = view.mask & ~segmentation.forced
    if args.rest == "inferred":
        segmentation = with_free_ends(segmentation, segmentation.inferred, view)
    batch, length = free.shape
    offsets = torch.randint(0, args.gap, (batch, 1))
    flips = ((torch.arange(length)[None] - offsets) % args.gap == 0) & free
    sampled = column_costs(model, view, states, segmentation, args.bytes_only)
    other = column_costs(model, view, states, flipped(segmentation, flips, view), args.bytes_only)
    totals = F.pad((other - sampled).cumsum(1), (1, 0))  # (B, T + 1)
    columns = torch.arange(length)
    window = totals[:, (columns + args.window).clamp(max=length)] - totals[:, columns]
    # window = cost(flipped) − cost(sampled); an end that was taken is the z = 1 side.
    return torch.where(segmentation.ends, window, -window) * flips, flips


def feedback_loss(model, seen: dict, gold: torch.Tensor, args, predicted: int) -> tuple:
    """The feedback term for the router (see the module docstring) and the step's (A, flips)."""
    segmentation = seen["segmentation"]
    free = seen["view"].mask & ~segmentation.forced
    if args.feedback == "supervised":
        logits = segmentation.logits[free]
        return args.weight * F.binary_cross_entropy_with_logits(logits, gold[free].float()), None
    advantage, flips = advantages(model, seen, args)
    if args.feedback == "oracle":
        advantage = torch.where(gold, 1.0, -1.0) * flips
    if args.center and flips.any():
        advantage = (advantage - advantage[flips].mean()) * flips
    if args.normalize and int(flips.sum()) > 1:
        advantage = advantage / advantage[flips].std().clamp(min=1e-6)
    if args.feedback == "rank":
        values = advantage[flips]
        labels = (values >= torch.quantile(values, 1 - model.config.prior_mean)).float()
        term = F.binary_cross_entropy_with_logits(segmentation.logits[flips], labels)
    else:
        term = -(args.gap / predicted) * (advantage * segmentation.probs).sum()
    scale = 0.0 if args.feedback == "none" else args.weight
    return scale * term, (advantage, flips)


def gold_ends(texts, shape: tuple[int, int], context: int) -> torch.Tensor:
    """(B, 1 + context) True at column c when the byte there (text byte c - 1) ends a word, i.e. text
    byte c starts the next one: an end decision there is a correct one."""
    gold = torch.zeros(shape, dtype=torch.bool)
    for row, text in enumerate(texts):
        for start in text.word_starts:
            if 1 <= start < context:
                gold[row, start] = True
    return gold


def backward(model, output, extra: torch.Tensor, seen: dict, args) -> None:
    """ELBO + feedback; with --router-gradient none the router keeps only the feedback and a rate term."""
    if args.router_gradient == "elbo":
        (output.loss + extra).backward()
        return
    output.loss.backward(retain_graph=True)
    for name, parameter in model.named_parameters():
        if is_inference_parameter(name):
            parameter.grad = None
    segmentation = seen["segmentation"]
    free = seen["view"].mask & ~segmentation.forced
    rate = (segmentation.probs * free).sum(1) / free.sum(1).clamp(min=1)
    (extra + args.rate_weight * ((rate - model.config.prior_mean) ** 2).sum()).backward()


def train(model, args, language, rng: random.Random, interleave: int | None) -> list[dict]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, synthetic.lr_factor(args.steps))
    seen: dict = {}
    original = model.model.segment

    def segment(view, token_states):
        segmentation = original(view, token_states)
        if model.training and args.generator_layout != "router":
            if args.generator_layout == "random":
                drawn = torch.rand(view.mask.shape) < model.config.prior_mean
            else:
                drawn = seen["gold"]
            segmentation = with_free_ends(segmentation, drawn, view)
        seen.update(view=view, states=token_states, segmentation=segmentation)
        return segmentation

    model.model.segment = segment
    model.train()
    log, recent = [], []
    for step in range(args.steps):
        texts = synthetic.sample_rows(language, args.batch_size, args.context, rng)
        batch = synthetic.rows_of(texts, args.context)
        gold = gold_ends(texts, tuple(batch.shape), args.context)
        seen["gold"] = gold
        output = model(input_ids=batch, labels=batch)
        extra, measured = torch.zeros(()), None
        if interleave is None or update_phase(step, interleave) != "generator":
            extra, measured = feedback_loss(model, seen, gold, args, int(batch[:, 1:].numel()))
        optimizer.zero_grad(set_to_none=True)
        backward(model, output, extra, seen, args)
        if interleave is not None:
            drop_other_group_gradients(model, step, interleave)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        recent.append(step_figures(seen, gold, measured))
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            log.append(summary(step + 1, output, recent[-args.log_every :]))
            print(json.dumps(log[-1]), file=sys.stderr, flush=True)
    return log


def step_figures(seen: dict, gold: torch.Tensor, measured) -> list[float]:
    """[A at word starts, A elsewhere, its AUC, q at word starts, q elsewhere] of one step (nan where
    absent)."""
    segmentation = seen["segmentation"]
    free = seen["view"].mask & ~segmentation.forced
    probs = segmentation.probs.detach()
    figures = [float("nan")] * 3
    if measured is not None:
        advantage, flips = measured
        at_ends, elsewhere = advantage[flips & gold], advantage[flips & ~gold]
        # AUC: the share of (word end, other byte) pairs whose advantages are in the right order.
        pairs = (at_ends[:, None] > elsewhere[None]).float() + 0.5 * (at_ends[:, None] == elsewhere[None])
        figures = [at_ends.mean().item(), elsewhere.mean().item(), pairs.mean().item()]
    return [*figures, probs[gold & free].mean().item(), probs[~gold & free].mean().item()]


def summary(step: int, output, recent: list[list[float]]) -> dict:
    means = torch.tensor(recent).nanmean(0).tolist()
    names = ("advantage_at_word_ends", "advantage_elsewhere", "advantage_auc")
    names += ("q_at_word_ends", "q_elsewhere")
    return {
        "step": step,
        "loss": round(output.loss.item(), 4),
        "rate": round(output.boundary_rate.item(), 4),
        **{name: round(value, 4) for name, value in zip(names, means, strict=True)},
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    language = SyntheticWords(seed=args.language_seed)
    heldout = synthetic.sample_rows(
        language, args.heldout_rows, args.context, random.Random(10_000 + args.language_seed)
    )
    rate = sum(len(t.word_starts) for t in heldout) / sum(len(t.text) for t in heldout)
    torch.manual_seed(args.seed)
    model = synthetic.lslm_model(args, prior_mean=round(rate, 3))
    started = time.perf_counter()
    interleave = None if args.joint else model.config.update_schedule
    log = train(model, args, language, random.Random(args.seed), interleave)
    result = {"argv": sys.argv[1:] if argv is None else argv, "log": log}
    result.update(synthetic.evaluate(model, heldout, args.context), seconds=time.perf_counter() - started)
    print(json.dumps({key: value for key, value in result.items() if key != "log"}), flush=True)
    return result


if __name__ == "__main__":
    main()
