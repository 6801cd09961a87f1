"""Where should a converted ConceptMoE open its concepts? Its bits per byte with the decisions replaced.

A learned router is worth its cost only if *where* it opens concepts matters. This script takes a trained
ConceptMoE conversion (e.g. `recover_conceptmoe.py --save`) and scores one split of the built corpus with
its boundary decisions replaced, everything else (weights, threshold, ratio) as trained:

- `own`: the checkpoint's own decisions (its router with its `boundary_fixed_bonus`, or its fixed chunks);
- `fixed`: every R-th token of a document opens a concept (R = the checkpoint's `compression_ratio`);
- `random`: local ranks of uniform noise;
- `surprisal`, `entropy`, `depth`: local ranks of a score from the source model the checkpoint was
  converted from, read causally at each token t: the source's surprisal of x_t, the entropy of its
  next-token distribution at t, and how far its last layer moves that distribution from the one its first
  E layers give (KL(final ‖ logit lens after layer E), E the conversion's encoder layers: where the concept
  layers change the prediction most);
- `own-cap:N`: the own decisions, with a concept opened wherever N tokens have passed without one.

Score modes decide on local ranks over the checkpoint's `boundary_rank_window` W (64 where it has none)
at the threshold it was trained with (1 − 1/R for a fixed-chunk checkpoint, whose concepts are then read
whole, as the straight-through dechunk EMA does). Each row reports the realised tokens per concept: quality
follows the ratio, so compare rows at the ratio they realise. Choose among placements on the validation
split; the held-out split is for reporting.

    python benchmarks/concept_placement.py CHECKPOINT --source SOURCE --corpus CORPUS \\
        [--split validation] [--modes own,fixed,random,surprisal,entropy,depth] [--eval-bytes 4096] \\
        [--context 256] [--batch-size 8] [--json OUT] [--threads 1]
    python benchmarks/concept_placement.py --quick   # a tiny conversion of a random Llama, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path

import recover_conceptmoe as recover
import torch
import torch.nn.functional as F
from corpus_data import heldout_texts
from torch import nn

from hf_concept.training.data import load_saved_dataset
from hf_concept.training.sweep import atomic_write_json

SOURCE_SCORES = ("surprisal", "entropy", "depth")
MODES = ("own", "fixed", "random", *SOURCE_SCORES)
DEFAULT_WINDOW = 64


def parse_mode(text: str) -> tuple[str, int]:
    """ "own-cap:N" -> ("own-cap", N); any other mode -> (mode, 0). Raises ValueError naming the mode."""
    name, _, cap = text.partition(":")
    if name == "own-cap" and cap.isdigit() and int(cap) >= 1:
        return name, int(cap)
    if text in MODES:
        return text, 0
    raise ValueError(f"mode {text!r} must be one of {', '.join(MODES)} or own-cap:N (N >= 1)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", type=Path, help="a trained ConceptMoE conversion")
    parser.add_argument("--source", type=Path, help="the model it was converted from")
    parser.add_argument("--corpus", type=Path, help="a saved corpus DatasetDict (`build-corpus`)")
    parser.add_argument("--split", default="validation", choices=("validation", "held_out"))
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated placements")
    parser.add_argument("--eval-bytes", type=int, default=4096, help="bytes per language/kind cell")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a tiny random conversion, seconds")
    args = parser.parse_args(argv)
    if not args.quick and None in (args.checkpoint, args.source, args.corpus):
        parser.error("CHECKPOINT, --source and --corpus are required (or --quick)")
    try:
        args.modes = [parse_mode(mode) for mode in args.modes.split(",")]
    except ValueError as error:
        parser.error(f"--modes: {error}")
    return args


def source_scores(source: nn.Module, input_ids: torch.Tensor, attention_mask, kind: str, layers: int):
    """(B, L) the source's `kind` score at each token (module docstring), from its causal forward."""
    with torch.no_grad():
        output = source(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        log_probs = F.log_softmax(output.logits.float(), dim=-1)  # (B, L, V), position t predicts t + 1
        if kind == "surprisal":
            taken = log_probs[:, :-1].gather(-1, input_ids[:, 1:, None])[..., 0]  # (B, L - 1)
            return F.pad(-taken, (1, 0))  # a row's first token is a start, which always opens
        if kind == "entropy":
            return -(log_probs.exp() * log_probs).sum(-1)
        body = source.get_decoder() if hasattr(source, "get_decoder") else source.model
        lens = F.log_softmax(source.lm_head(body.norm(output.hidden_states[layers])).float(), dim=-1)
        return (log_probs.exp() * (log_probs - lens)).sum(-1)


def capped(opens: torch.Tensor, mask: torch.Tensor, cap: int) -> torch.Tensor:
    """(B, L) `opens` with a concept also opened at every real token that `cap` real tokens follow
    without one (the open concept's tokens counted from its opening)."""
    opens = opens.clone()
    run = torch.zeros(opens.shape[0], dtype=torch.long, device=opens.device)  # tokens in the open concept
    for index in range(opens.shape[1]):
        real = mask[:, index]
        opens[:, index] |= real & (run >= cap)
        run = torch.where(real & opens[:, index], 1, run + real.long())
    return opens


@contextlib.contextmanager
def settings(config, **values) -> Iterator[None]:
    """`config`'s attributes set to `values` inside the block, restored after it."""
    saved = {name: getattr(config, name) for name in values}
    for name, value in values.items():
        setattr(config, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


def decision_settings(config, mode: str) -> dict:
    """The config fields `mode` runs under (module docstring: local ranks for the score modes)."""
    ratio = config.compression_ratio
    if mode == "fixed":
        if not float(ratio).is_integer():
            raise ValueError(f"mode 'fixed' needs an integer compression_ratio, not {ratio}")
        return dict(chunking="fixed")
    if mode.startswith("own"):
        return {}
    if config.boundary_rank_window and config.chunking == "dynamic":
        return dict(boundary_fixed_bonus=0.0)  # the given scores alone decide
    # A fixed-chunk checkpoint, or one that thresholds probabilities (neither can carry a bonus, which
    # needs a rank window): ranks at 1 - 1/R, concepts whole.
    return dict(
        chunking="dynamic",
        boundary_rank_window=DEFAULT_WINDOW,
        boundary_threshold=1 - 1 / ratio,
        boundary_noise="none",
        dechunk_ema="straight_through",
    )


@contextlib.contextmanager
def placement(model: nn.Module, mode: str, cap: int, source: nn.Module | None) -> Iterator[None]:
    """`model` (a ConceptMoEForCausalLM) deciding its boundaries by `mode` inside the block."""
    inner = recover.concept_model(model)
    given: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(0)

    def read_call(module, args, kwargs) -> None:
        if mode in SOURCE_SCORES:
            ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
            given["scores"] = source_scores(source, ids, mask, mode, inner.config.encoder_layers)

    def decision_scores(self, probs, starts, mask, *rest):
        if mode == "random":
            given["scores"] = torch.rand(probs.shape, generator=generator).to(probs)
        scores = given["scores"].to(probs) if mode in ("random", *SOURCE_SCORES) else probs
        return type(self).decision_scores(self, scores, starts, mask, *rest)

    def decide_boundaries(self, scores, starts, mask, training):
        opens = type(self).decide_boundaries(self, scores, starts, mask, training)
        return capped(opens, mask, cap) if cap else opens

    hook = model.register_forward_pre_hook(read_call, with_kwargs=True)
    inner.decision_scores = types.MethodType(decision_scores, inner)
    inner.decide_boundaries = types.MethodType(decide_boundaries, inner)
    try:
        with settings(inner.config, **decision_settings(inner.config, mode)):
            yield
    finally:
        hook.remove()
        del inner.decision_scores, inner.decide_boundaries


def score_modes(model: nn.Module, tokenizer, texts: dict, source: nn.Module | None, args) -> list[dict]:
    """One row per mode: pooled and per-cell bits per byte and tokens per concept (`recover.evaluate`)."""
    rows = []
    for mode, cap in args.modes:
        with placement(model, mode, cap, source):
            result = recover.evaluate(model, tokenizer, texts, args)
        rows.append({"mode": mode if not cap else f"{mode}:{cap}", **result})
        print(
            f"{rows[-1]['mode']:<12} {result['bits_per_byte']:.4f} bits/byte  "
            f"{result['tokens_per_concept']:.3f} tokens/concept",
            flush=True,
        )
    return rows


def print_table(rows: list[dict]) -> None:
    """Markdown table: each mode against the checkpoint's own decisions (when scored)."""
    own = next((row["bits_per_byte"] for row in rows if row["mode"] == "own"), None)
    print("\n| placement | bits/byte | vs own | tokens/concept |\n| --- | ---: | ---: | ---: |")
    for row in rows:
        versus = "" if own is None else f"{row['bits_per_byte'] - own:+.4f}"
        print(f"| {row['mode']} | {row['bits_per_byte']:.4f} | {versus} | {row['tokens_per_concept']:.3f} |")


def quick_checkpoint(folder: Path) -> tuple[Path, Path, Path]:
    """--quick: a random Llama (recover's fixture) converted at R = 2 with one encoder and decoder layer."""
    from hf_concept.conversion.conceptmoe import convert_to_conceptmoe

    source, corpus = recover.quick_fixture(folder)
    convert_to_conceptmoe(
        source, folder / "converted", encoder_layers=1, decoder_layers=1, compression_ratio=2, seed=0
    )
    return folder / "converted", source, corpus


def run(args: argparse.Namespace) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.source)
    texts = heldout_texts(load_saved_dataset(args.corpus)[args.split], args.eval_bytes)
    model = recover.ConceptMoEForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    source = None
    if any(mode in SOURCE_SCORES for mode, _ in args.modes):
        source = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.float32).eval()
    rows = score_modes(model, tokenizer, texts, source, args)
    print_table(rows)
    if args.json is not None:
        atomic_write_json(args.json, {"checkpoint": str(args.checkpoint), "split": args.split, "rows": rows})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.quick:
        return run(args)
    with tempfile.TemporaryDirectory(prefix="concept-placement-") as scratch:
        args.checkpoint, args.source, args.corpus = quick_checkpoint(Path(scratch))
        args.eval_bytes, args.context, args.batch_size = 300, 32, 2
        return run(args)


if __name__ == "__main__":
    main()
