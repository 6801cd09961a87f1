"""ConceptMoE converted from a Llama model against that same Llama model: prefill, decode, KV-cache bytes.

Legend: L tokens (prompt length), R compression ratio (tokens per concept), E / C / D encoder, concept
and decoder layers.

One process builds a seeded random `LlamaForCausalLM` (fp32, sdpa, eval) and converts it to ConceptMoE
(`--via converter`: `hf_concept.conversion.conceptmoe.convert_to_conceptmoe` on a saved copy, loaded with
`ConceptMoEForCausalLM.from_pretrained`; `--via memory`: the source state dict renamed to the ConceptMoE
module tree, new tensors left at the model's own init). Before any timing it checks that the converted
model with fixed chunking and R = 1 reproduces the source logits (assert_close, 1e-4), so the comparison
is against the right model. Then, under `torch.inference_mode`, after a warm-up, for each prompt length
and each repeat it times in turn the source and each converted model (interleaved, so machine noise
hits all of them alike):

- prefill: one forward over L tokens with an empty cache, logits of the last token only (as generate);
- decode: `--decode-tokens` greedy steps continuing from that prefilled cache (only the steps timed);
- KV bytes after prefill: `ConceptCache.num_bytes()` against the sum of the source `DynamicCache`'s
  key/value tensor bytes; ideal ratio (E + D + C / R) / (E + C + D) with R the realised tokens per
  concept (exactly `--ratio` for fixed chunking).

Chunking "fixed" (every R-th token opens a concept) gives the stable figure; "dynamic" uses the
untrained cosine router as converted (random q/k, seeded), whose realised R is whatever it is: it is
printed, never tuned. Prints one table per chunking mode (ratios are medians over the repeats) and the
project's targets (prefill >= 1.5x and decode >= 1.3x at the longest length, KV within 5% of ideal)
marked met / not met; it asserts none of them. `--profile` adds a per-section time breakdown of the
converted model (perf_counter around its stages, wrapped at run time: no model file is changed).
The default model (12 layers, width 256, 4 heads, 2 KV heads, MLP 1024, vocabulary 8192) runs the full
default benchmark, profile included, in about 3 minutes on 2 cores.

`--trained DIR` adds the trained-router row: DIR is what `benchmarks/train_conceptmoe_router.py` writes, a
Llama of the same shape on the bundled BPE vocabulary pretrained on the bundled corpus (DIR/source) and
its dynamic-router conversion trained on to R = 2 (DIR/conceptmoe), both loaded with `from_pretrained`
(fp32, sdpa, eval). Its prompts are real text, not random ids: the first L tokens of the corpus's
validation split (`corpus_text("validation")`, tokenized with DIR/source's tokenizer, `<s>` first), with
the train split's text appended only where a length needs more tokens than the validation split has
(printed). Before timing it checks that the trained model's cached greedy decoding gives the logits of a
full recomputation over prompt + decoded tokens (a boundary decided differently in the two paths fails
it). The two models are timed as above (interleaved, medians) and printed as the "[trained dynamic
router, target R=2]" table, whose `R pre` is the realised inference ratio on the benchmark text. Their
decode steps are fed the text that follows each prompt (`--trained-decode text`, the default; the argmax
is still computed), so that `R dec` is the router's rate on text: greedy continuation of this small
model falls into repeats, on which the router opens almost no concept, and that would flatter decode
(`--trained-decode greedy` shows it). Its
decode target is raised to 1.5x at the longest length (the other rows keep 1.3x: an untrained router is
not expected to reach it); `--profile` profiles it too. `--chunking none` skips the random-model rows
(and their R = 1 exactness check, which needs them), so the trained row can run alone.

    python benchmarks/bench_conceptmoe.py [--layers 12] [--hidden 256] [--seq-lens 1024,2048,4096,8192]
        [--decode-tokens 32] [--encoder-layers 2] [--decoder-layers 2] [--ratio 2]
        [--chunking fixed|dynamic|both|none] [--repeats 5] [--threads N] [--via converter|memory]
        [--trained DIR] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from hf_concept.conversion.sources import plain_config_from_source, plain_tensors
from hf_concept.data.corpus import corpus_text
from hf_concept.modeling import concept_stack, modeling_conceptmoe
from hf_concept.modeling.concept_cache import ConceptCache
from hf_concept.modeling.configuration_conceptmoe import ConceptMoEConfig
from hf_concept.modeling.forward_only_cache import cache_num_bytes
from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM
from hf_concept.modeling.transformers_compat import cache_kwarg, output_cache
from hf_concept.tables import format_table

try:
    from hf_concept.conversion.conceptmoe import convert_to_conceptmoe
except ImportError:
    convert_to_conceptmoe = None

TARGET_PREFILL = 1.5
TARGET_DECODE = 1.3
# A router trained to realise R = 2 should decode at least this much faster at the longest length.
TARGET_DECODE_TRAINED = 1.5
TRAINED = "trained"
# Greedy steps of the trained model's cached-decoding check.
CHECK_DECODE_STEPS = 8
TARGET_KV_DEVIATION = 0.05
EXACTNESS_TOLERANCE = 1e-4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12, help="source layers (E + C + D)")
    parser.add_argument("--hidden", type=int, default=256, help="width D")
    parser.add_argument("--intermediate", type=int, default=1024, help="MLP width")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (head dim = hidden / heads)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    parser.add_argument("--seq-lens", default="1024,2048,4096,8192", help="comma-separated prompt lengths")
    parser.add_argument("--decode-tokens", type=int, default=32, help="greedy steps timed after prefill")
    parser.add_argument("--encoder-layers", type=int, default=2)
    parser.add_argument("--decoder-layers", type=int, default=2)
    parser.add_argument("--ratio", type=int, default=2, help="target tokens per concept R")
    parser.add_argument(
        "--chunking", choices=("fixed", "dynamic", "both", "none"), default="both", help="random-model rows"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per length (median)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    parser.add_argument("--via", choices=("converter", "memory"), default=None, help="how to convert")
    parser.add_argument("--profile", action="store_true", help="per-section breakdown of the converted model")
    parser.add_argument(
        "--trained", type=Path, default=None, help="folder from train_conceptmoe_router.py: adds its row"
    )
    parser.add_argument(
        "--trained-decode",
        choices=("text", "greedy"),
        default="text",
        help="trained row's decode steps: the text after the prompt (default) or greedy tokens",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.seq_lens = [int(item) for item in args.seq_lens.split(",")]
    if args.via is None:
        args.via = "converter" if convert_to_conceptmoe is not None else "memory"
    if args.via == "converter" and convert_to_conceptmoe is None:
        raise ValueError("--via converter: hf_concept.conversion.conceptmoe.convert_to_conceptmoe is missing")
    if args.hidden % args.heads != 0:
        raise ValueError(f"--hidden={args.hidden} must be divisible by --heads={args.heads}")
    if args.chunking == "none" and args.trained is None:
        raise ValueError("--chunking none leaves nothing to measure without --trained DIR")
    if args.trained is not None:
        for part in ("source", "conceptmoe"):
            if not (args.trained / part / "config.json").is_file():
                raise ValueError(
                    f"--trained {args.trained}: no {part}/config.json (train_conceptmoe_router.py)"
                )
    return args


# ---------------------------------------------------------------------------------------------- models


def build_source(args: argparse.Namespace) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq_lens) + args.decode_tokens + 16,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config).to(torch.float32).eval()


def conversion_options(args: argparse.Namespace, chunking: str, ratio: int) -> dict:
    return dict(
        encoder_layers=args.encoder_layers,
        decoder_layers=args.decoder_layers,
        compression_ratio=ratio,
        chunking=chunking,
    )


def convert_in_memory(source: LlamaForCausalLM, options: dict, seed: int) -> ConceptMoEForCausalLM:
    """The contract's conversion done on a state dict: same names, same layer split, new tensors at init."""
    fields = plain_config_from_source(source.config).to_dict()
    for key in ("model_type", "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype"):
        fields.pop(key, None)
    config = ConceptMoEConfig(**fields, **options, dechunk_residual="delta")
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = ConceptMoEForCausalLM(config)
    encoder, concept = config.encoder_layers, config.num_concept_layers
    state = {}
    for key, tensor in source.state_dict().items():
        for name, value in plain_tensors(key, tensor, "llama"):
            if name.startswith("model.layers."):
                index, rest = name[len("model.layers.") :].split(".", 1)
                index = int(index)
                stage = (
                    "encoder" if index < encoder else "concept" if index < encoder + concept else "decoder"
                )
                offset = {"encoder": 0, "concept": encoder, "decoder": encoder + concept}[stage]
                name = f"model.{stage}_layers.{index - offset}.{rest}"
            state[name] = value
    missing, unexpected = model.load_state_dict(state, strict=False)
    added = [name for name in missing if not (name.startswith("model.chunker.") or ".concept_" in name)]
    if unexpected or added:
        raise ValueError(f"in-memory conversion: unexpected {unexpected}, missing {added}")
    return model.eval()


class Converter:
    """Makes converted models of one source by the chosen route (the source saved once for the converter)."""

    def __init__(self, source: LlamaForCausalLM, args: argparse.Namespace, workdir: Path) -> None:
        self.source, self.args, self.workdir = source, args, workdir
        if args.via == "converter":
            source.save_pretrained(workdir / "source")

    def __call__(self, chunking: str, ratio: int) -> ConceptMoEForCausalLM:
        options = conversion_options(self.args, chunking, ratio)
        if self.args.via == "memory":
            return convert_in_memory(self.source, options, self.args.seed)
        destination = self.workdir / f"conceptmoe-{chunking}-r{ratio}"
        convert_to_conceptmoe(self.workdir / "source", destination, **options, seed=self.args.seed)
        model = ConceptMoEForCausalLM.from_pretrained(
            destination, dtype=torch.float32, attn_implementation="sdpa"
        )
        return model.eval()


def check_exactness(source: LlamaForCausalLM, convert: Converter, args: argparse.Namespace) -> float:
    """Fixed chunking, R = 1 reproduces the source's logits; returns the largest difference."""
    model = convert("fixed", 1)
    input_ids = prompt(min(256, min(args.seq_lens)), args.vocab, args.seed + 1)
    with torch.inference_mode():
        expected = source(input_ids=input_ids).logits
        actual = model(input_ids=input_ids).logits
    torch.testing.assert_close(actual, expected, atol=EXACTNESS_TOLERANCE, rtol=EXACTNESS_TOLERANCE)
    return (actual - expected).abs().max().item()


def prompt(length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


# (length, seed) -> ((1, length) prompt ids, (1, decode tokens + 1) ids to feed as the decode steps, or
# None to decode greedily).
PromptOf = Callable[[int, int], tuple[torch.Tensor, torch.Tensor | None]]


def random_prompts(args: argparse.Namespace) -> PromptOf:
    return lambda length, seed: (prompt(length, args.vocab, seed), None)


def text_prompts(text_ids: torch.Tensor, args: argparse.Namespace) -> PromptOf:
    """Prefixes of `text_ids` (1, N); with `--trained-decode text` the decode steps are fed the text's next
    tokens."""
    if args.trained_decode == "greedy":
        return lambda length, seed: (text_ids[:, :length], None)
    return lambda length, seed: (
        text_ids[:, :length],
        text_ids[:, length : length + args.decode_tokens + 1],
    )


# ------------------------------------------------------------------------------------- trained router


def load_trained(folder: Path) -> tuple[LlamaForCausalLM, ConceptMoEForCausalLM, object]:
    """(source, trained ConceptMoE, tokenizer) from a `train_conceptmoe_router.py` folder."""
    options = dict(dtype=torch.float32, attn_implementation="sdpa")
    source = LlamaForCausalLM.from_pretrained(folder / "source", **options).eval()
    trained = ConceptMoEForCausalLM.from_pretrained(folder / "conceptmoe", **options).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder / "source")
    if trained.config.chunking != "dynamic":
        raise ValueError(f"{folder / 'conceptmoe'}: chunking={trained.config.chunking!r}, expected 'dynamic'")
    return source, trained, tokenizer


def text_prompt(tokenizer, length: int) -> tuple[torch.Tensor, str]:
    """(1, >= length) ids of the corpus's validation text, the train text appended only when too short,
    and a description of what was used."""
    # The whole split is tokenized at once and cut to each prompt length here: no length warning.
    tokenizer.model_max_length = 1 << 30
    ids = tokenizer(corpus_text("validation"), return_tensors="pt")["input_ids"]  # (1, N)
    described = f"the corpus validation split ({ids.shape[1]} tokens)"
    if ids.shape[1] < length:
        more = tokenizer("\n\n" + corpus_text("train"), add_special_tokens=False, return_tensors="pt")
        described += f", continued with the train split for the tokens beyond {ids.shape[1]}"
        ids = torch.cat([ids, more["input_ids"]], dim=1)
    if ids.shape[1] < length:
        raise ValueError(f"the bundled corpus has {ids.shape[1]} tokens, fewer than the {length} asked for")
    return ids, described


def trained_summary(folder: Path) -> str:
    """One line from the folder's training.json (the held-out figures it was trained to)."""
    path = folder / "training.json"
    if not path.is_file():
        return f"({path} is missing: no training figures)"
    result = json.loads(path.read_text(encoding="utf-8"))
    source, conceptmoe = result["source"]["heldout"], result["conceptmoe"]["heldout"]
    return (
        f"training.json: {result['args']['pretrain_steps']} source + {result['args']['router_steps']} "
        f"ConceptMoE steps; held-out loss source {source['loss']:.3f}, ConceptMoE {conceptmoe['loss']:.3f}, "
        f"realised inference ratio {conceptmoe['inference_ratio']:.3f}"
    )


def check_cached_decode(model: ConceptMoEForCausalLM, input_ids: torch.Tensor, steps: int) -> float:
    """Greedy decoding through the cache gives, at every decoded position, the logits of one full forward
    over prompt + decoded tokens; returns the largest difference (assert_close at 1e-4 otherwise)."""
    with torch.inference_mode():
        output = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
        cache, stepped, decoded = output_cache(output), [output.logits[:, -1]], []
        for _ in range(steps):
            decoded.append(stepped[-1].argmax(dim=-1, keepdim=True))  # (1, 1)
            output = model(input_ids=decoded[-1], **cache_kwarg(cache), use_cache=True, logits_to_keep=1)
            stepped.append(output.logits[:, -1])
        full = model(input_ids=torch.cat([input_ids, *decoded], dim=1), use_cache=False).logits
    expected = full[:, input_ids.shape[1] - 1 :]  # (1, steps + 1, V)
    actual = torch.stack(stepped, dim=1)
    torch.testing.assert_close(actual, expected, atol=EXACTNESS_TOLERANCE, rtol=EXACTNESS_TOLERANCE)
    return (actual - expected).abs().max().item()


# ------------------------------------------------------------------------------------------- measuring


@dataclass
class Sample:
    prefill_s: float
    decode_s: float
    kv_bytes: int
    tokens_per_concept: float | None
    decode_tokens_per_concept: float | None


def concepts_so_far(cache) -> int | None:
    if isinstance(cache, ConceptCache) and cache.state is not None:
        return int(cache.state.concept_count.sum())
    return None


def run_once(
    model,
    input_ids: torch.Tensor,
    decode_tokens: int,
    on_prefilled: Callable[[], None] | None = None,
    continuation: torch.Tensor | None = None,
) -> Sample:
    """Prefill (timed), KV bytes, then decode steps from that cache (timed): greedy, or fed the tokens of
    `continuation` (1, >= decode_tokens) in turn, the argmax still taken so that the work is the same."""
    with torch.inference_mode():
        start = time.perf_counter()
        output = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - start
        cache = output_cache(output)
        kv_bytes = cache_num_bytes(cache)
        ratio = getattr(output, "compression_ratio", None)
        next_token = output.logits[:, -1].argmax(dim=-1, keepdim=True)
        if continuation is not None:
            next_token = continuation[:, :1]
        concepts_before = concepts_so_far(cache)
        if on_prefilled is not None:
            on_prefilled()
        start = time.perf_counter()
        for step in range(1, decode_tokens + 1):
            output = model(input_ids=next_token, **cache_kwarg(cache), use_cache=True, logits_to_keep=1)
            next_token = output.logits[:, -1].argmax(dim=-1, keepdim=True)
            if continuation is not None:
                next_token = continuation[:, step : step + 1]
        decode_s = time.perf_counter() - start
        decode_ratio = None
        if concepts_before is not None and decode_tokens > 0:
            decode_ratio = decode_tokens / max(concepts_so_far(cache) - concepts_before, 1)
    return Sample(prefill_s, decode_s, kv_bytes, None if ratio is None else ratio.item(), decode_ratio)


@dataclass
class Row:
    length: int
    samples: dict[str, list[Sample]] = field(default_factory=lambda: defaultdict(list))


def measure(models: dict, args: argparse.Namespace, prompt_of: PromptOf) -> list[Row]:
    """Interleaved rounds: per length and repeat, every model prefills and decodes once, in turn."""
    warm_ids, warm_continuation = prompt_of(min(args.seq_lens), args.seed + 2)
    for model in models.values():
        run_once(model, warm_ids, min(args.decode_tokens, 4), continuation=warm_continuation)
    rows = []
    for length in args.seq_lens:
        row = Row(length)
        input_ids, continuation = prompt_of(length, args.seed + 3)
        for repeat in range(args.repeats):
            for name, model in models.items():
                sample = run_once(model, input_ids, args.decode_tokens, continuation=continuation)
                row.samples[name].append(sample)
            print(f"  L={length} round {repeat + 1}/{args.repeats} done", flush=True)
        rows.append(row)
    return rows


# -------------------------------------------------------------------------------------------- printing


def ideal_kv_ratio(config: ConceptMoEConfig, tokens_per_concept: float) -> float:
    token_layers = config.encoder_layers + config.decoder_layers
    return (token_layers + config.num_concept_layers / tokens_per_concept) / config.num_hidden_layers


def mode_figures(row: Row, mode: str, args: argparse.Namespace, config: ConceptMoEConfig) -> dict[str, float]:
    source, converted = row.samples["source"], row.samples[mode]
    prefill = statistics.median(s.prefill_s for s in source) / statistics.median(
        s.prefill_s for s in converted
    )
    source_rate = args.decode_tokens / statistics.median(s.decode_s for s in source)
    converted_rate = args.decode_tokens / statistics.median(s.decode_s for s in converted)
    realised = converted[0].tokens_per_concept
    kv = converted[0].kv_bytes / source[0].kv_bytes
    ideal = ideal_kv_ratio(config, realised)
    return dict(
        prefill=prefill,
        source_prefill_ms=statistics.median(s.prefill_s for s in source) * 1e3,
        converted_prefill_ms=statistics.median(s.prefill_s for s in converted) * 1e3,
        source_rate=source_rate,
        converted_rate=converted_rate,
        decode=converted_rate / source_rate,
        kv=kv,
        ideal=ideal,
        deviation=(kv - ideal) / ideal,
        realised=realised,
        decode_realised=statistics.median(s.decode_tokens_per_concept for s in converted),
    )


def heading(mode: str) -> str:
    return "trained dynamic router" if mode == TRAINED else f"{mode} chunking"


# The figures of a table row between L and the deviation (in percent), in column order, with their formats.
FIGURE_FORMATS = (
    ("realised", ".3f"),
    ("decode_realised", ".2f"),
    ("source_prefill_ms", ".1f"),
    ("converted_prefill_ms", ".1f"),
    ("prefill", ".2f"),
    ("source_rate", ".1f"),
    ("converted_rate", ".1f"),
    ("decode", ".2f"),
    ("kv", ".4f"),
    ("ideal", ".4f"),
)


def print_tables(rows: list[Row], models: dict, modes: list[str], args: argparse.Namespace) -> None:
    headers = ["L", "R pre", "R dec", "src ms", "cmoe ms", "prefill x", "src tok/s", "cmoe tok/s"]
    headers += ["decode x", "KV ratio", "ideal", "dev %"]
    widths = (6, 6, 6, 9, 9, 9, 9, 10, 8, 8, 6, 6)
    for mode in modes:
        config = models[mode].config
        print(
            f"\n[{heading(mode)}, target R={config.compression_ratio:g}] R pre / R dec: realised tokens per "
            "concept in the prompt / in the decoded tokens; prefill x = source/converted time (medians), "
            "decode x = converted/source tokens/s, KV = converted/source bytes after prefill, ideal = "
            "(E + D + C/R pre)/L, dev = KV/ideal - 1"
        )
        cells = []
        for row in rows:
            fig = mode_figures(row, mode, args, config)
            figures = [format(fig[key], spec) for key, spec in FIGURE_FORMATS]
            cells.append([row.length, *figures, f"{fig['deviation'] * 100:+.2f}"])
        print(format_table(headers, cells, align=">", widths=widths, sep=" "))
        print_targets(rows, mode, args, config)


def print_targets(rows: list[Row], mode: str, args: argparse.Namespace, config: ConceptMoEConfig) -> None:
    longest = max(rows, key=lambda row: row.length)
    fig = mode_figures(longest, mode, args, config)
    worst = max(abs(mode_figures(row, mode, args, config)["deviation"]) for row in rows)
    decode_target = TARGET_DECODE_TRAINED if mode == TRAINED else TARGET_DECODE

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    print(
        f"targets ({mode}): prefill >= {TARGET_PREFILL}x at L={longest.length}: {fig['prefill']:.2f}x "
        f"{verdict(fig['prefill'] >= TARGET_PREFILL)}; decode >= {decode_target}x at L={longest.length}: "
        f"{fig['decode']:.2f}x {verdict(fig['decode'] >= decode_target)} (realised R pre "
        f"{fig['realised']:.2f}, R dec {fig['decode_realised']:.2f}); KV within "
        f"{TARGET_KV_DEVIATION:.0%} of ideal (worst {worst:.2%}): {verdict(worst <= TARGET_KV_DEVIATION)}"
    )


# ------------------------------------------------------------------------------------------- profiling


class Sections:
    """Inclusive perf_counter seconds per named stage of the converted model, wrapped at run time."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.undo: list[Callable[[], None]] = []

    def wrap(self, owner, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)

        @functools.wraps(original)
        def timed(*call_args, **call_kwargs):
            start = time.perf_counter()
            try:
                return original(*call_args, **call_kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        setattr(owner, attribute, timed)
        had_own = attribute in vars(owner)
        self.undo.append(
            lambda: setattr(owner, attribute, original) if had_own else delattr(owner, attribute)
        )

    def restore(self) -> None:
        for undo in reversed(self.undo):
            undo()
        self.undo.clear()


@contextlib.contextmanager
def sections_of(model: ConceptMoEForCausalLM) -> Iterator[Sections]:
    sections = Sections()
    inner = model.model
    sections.wrap(inner, "forward", "model forward (all below)")
    # The model calls the plain family's mask builder through the class: wrap it there, restored after.
    sections.wrap(concept_stack.PlainDecoderModel, "attention_masks", "token masks (masking_utils)")
    for stage in ("encoder_layers", "concept_layers", "decoder_layers"):
        for layer in getattr(inner, stage):
            sections.wrap(layer, "forward", f"{stage} (all)")
    sections.wrap(inner, "concept_step", "concept_step (all below)")
    sections.wrap(inner, "boundaries", "  boundaries (router/fixed)")
    sections.wrap(modeling_conceptmoe, "emit_concepts", "  emit_concepts (pooling, slots)")
    sections.wrap(inner, "run_concept_model", "  run_concept_model (incl. concept layers)")
    sections.wrap(concept_stack, "slot_attention_mask", "    slot_attention_mask")
    sections.wrap(modeling_conceptmoe, "probability_smoothing", "  dechunk EMA (probability_smoothing)")
    sections.wrap(inner, "read_concepts", "  read_concepts")
    sections.wrap(model.lm_head, "forward", "lm_head")
    try:
        yield sections
    finally:
        sections.restore()


def profile_one(
    model, input_ids: torch.Tensor, steps: int, continuation: torch.Tensor | None = None
) -> tuple[Sample, dict, dict]:
    """One prefill + decode with stage timers: (sample, prefill seconds, decode seconds per step)."""
    with sections_of(model) as sections:
        prefill: dict[str, float] = {}

        def snapshot() -> None:
            prefill.update(sections.seconds)
            sections.seconds.clear()

        sample = run_once(model, input_ids, steps, on_prefilled=snapshot, continuation=continuation)
        decode = {key: value / steps for key, value in sections.seconds.items()}
    return sample, prefill, decode


def profile_converted(models: dict, args: argparse.Namespace, prompt_of: PromptOf) -> None:
    """Where the converted models' time goes at the longest length (sdpa already gets no mask where the
    concept layers' mask is plain causal attention, so the former what-if run is gone)."""
    length = max(args.seq_lens)
    steps = max(args.decode_tokens, 1)
    input_ids, continuation = prompt_of(length, args.seed + 3)
    source = run_once(models["source"], input_ids, steps, continuation=continuation)
    print(
        f"\nprofile at L={length}: source prefill {source.prefill_s * 1e3:.1f} ms, "
        f"decode {source.decode_s / steps * 1e3:.2f} ms/step"
    )
    for name, model in models.items():
        if name == "source":
            continue
        sample, prefill, decode = profile_one(model, input_ids, steps, continuation)
        print(
            f"profile [{name}]: prefill {sample.prefill_s * 1e3:.1f} ms, "
            f"decode {sample.decode_s / steps * 1e3:.2f} ms/step (inclusive perf_counter sections)"
        )
        print(f"  {'section':<46} {'prefill ms':>10} {'decode ms/step':>14}")
        for key in sorted(prefill, key=lambda item: -prefill[item]):
            print(f"  {key:<46} {prefill[key] * 1e3:>10.1f} {decode.get(key, 0.0) * 1e3:>14.3f}")


# ------------------------------------------------------------------------------------------------ main


def run_random(args: argparse.Namespace) -> dict[str, list[dict]]:
    """The seeded random source and its conversions (`--chunking`): exactness check, tables, profile."""
    modes = ["fixed", "dynamic"] if args.chunking == "both" else [args.chunking]
    source = build_source(args)
    print(
        f"source: LlamaForCausalLM layers={args.layers} hidden={args.hidden} "
        f"intermediate={args.intermediate} "
        f"heads={args.heads} kv_heads={args.kv_heads} vocab={args.vocab} fp32 "
        f"attn={source.config._attn_implementation}; converted: E={args.encoder_layers} "
        f"C={args.layers - args.encoder_layers - args.decoder_layers} D={args.decoder_layers} R={args.ratio} "
        f"via {args.via}; threads={torch.get_num_threads()} torch={torch.__version__}"
    )
    with tempfile.TemporaryDirectory() as workdir:
        convert = Converter(source, args, Path(workdir))
        difference = check_exactness(source, convert, args)
        print(f"exactness: fixed R=1 converted logits equal the source's (max |diff| {difference:.2e})")
        models = {"source": source}
        for mode in modes:
            models[mode] = convert(mode, args.ratio)
    return run_suite(models, modes, args, random_prompts(args))


def run_trained(args: argparse.Namespace) -> list[dict]:
    """The trained pair of `--trained` on real text: cached-decoding check, table, profile."""
    source, trained, tokenizer = load_trained(args.trained)
    text_ids, described = text_prompt(tokenizer, max(args.seq_lens) + max(args.decode_tokens, 1) + 1)
    config = trained.config
    print(
        f"\ntrained ({args.trained}): source LlamaForCausalLM layers={source.config.num_hidden_layers} "
        f"hidden={source.config.hidden_size} vocab={source.config.vocab_size}; ConceptMoE "
        f"E={config.encoder_layers} C={config.num_concept_layers} D={config.decoder_layers} "
        f"R={config.compression_ratio:g} router={config.router}; prompts: {described}; decode steps: "
        + ("greedy" if args.trained_decode == "greedy" else "fed the text that follows each prompt")
    )
    print(trained_summary(args.trained))
    length = min(256, min(args.seq_lens))
    difference = check_cached_decode(trained, text_ids[:, :length], CHECK_DECODE_STEPS)
    print(
        f"exactness: trained model's cached greedy decode ({CHECK_DECODE_STEPS} tokens after L={length}) "
        f"equals full recomputation (max |logit diff| {difference:.2e})"
    )
    models = {"source": source, TRAINED: trained}
    return run_suite(models, [TRAINED], args, text_prompts(text_ids, args))[TRAINED]


def run_suite(models: dict, modes: list[str], args: argparse.Namespace, prompt_of: PromptOf) -> dict:
    """Time `models` ("source" and `modes`) on the same prompts, print their tables (and profile)."""
    rows = measure(models, args, prompt_of)
    print_tables(rows, models, modes, args)
    if args.profile:
        profile_converted(models, args, prompt_of)
    return {
        mode: [mode_figures(row, mode, args, models[mode].config) | {"length": row.length} for row in rows]
        for mode in modes
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    figures = run_random(args) if args.chunking != "none" else {}
    if args.trained is not None:
        figures[TRAINED] = run_trained(args)
    return figures


if __name__ == "__main__":
    main()
