"""Hidden Decoding against its own source model: training-step cost, KV-cache bytes and decode speed vs n.

Legend: L tokens per row, n streams, D width, B batch; "expanded" length is n·L. Layouts: "all-full"
(every layer causal over the n·L expanded positions, as the public HD release runs), "1-in-4"
(`default_stream_layout(layers, 4)`: every fourth layer full, the others intra-stream, HD Appendix H),
"all-intra" (no cross-stream layer; KV only) and "1-in-4 shared" (`stream_kv="shared"`, HD §5.2: intra
layers keep only the final stream's keys and values; KV only).

One process builds a seeded random `PlainDecoderForCausalLM` (fp32, sdpa) as the source and, for each
(layout, n), a `HiddenDecodingForCausalLM` with the same weights (its n embedding tables all copies of the
source table, i.e. `E.repeat(1, n)`). Before timing it checks that n = 1 reproduces the source's logits
(assert_close, 1e-4) for each layout, so every ratio compares the same network. Then:

1. training step (forward + backward of the next-token loss, batch 1, L = `--seq-len`) for n in
   `--streams`, per layout, as a ratio to that layout's n = 1 step; rounds interleave every model, so
   machine noise hits them alike; medians over `--repeats` rounds after one warm-up step each. Printed
   beside it: the ratio that an operation count predicts (matmul multiply-adds, forward: projections and
   MLP grow n×, intra attention n×, full attention n²×, the LM head runs on the final stream only), and
   the source's step for scale. The target: 1-in-4 at n = 4 costs <= 4.6x the n = 1 step (the
   paper measured 5.1x and 4.4x at 80B/617B; all-full attention alone would approach 16x).
2. KV-cache bytes per token after a prefill of `--kv-prompt` tokens: `StreamCache.num_bytes()` against
   the source's `DynamicCache` key/value bytes, with the ratio the layout implies (per_stream: every layer
   holds n·L entries; shared: intra layers hold L).
3. decode: `--decode-tokens` greedy cached steps after a prefill of each of `--decode-contexts` tokens,
   at each batch size in `--decode-batches`, for the `--decode-layouts` at each n of `--decode-streams`:
   tokens per second against the source's (interleaved rounds, medians; every round starts from a copy
   of one prefilled cache). The target: 1-in-4 at n = 4, batch 1, keeps >= 0.85x the source's
   tokens/s (the paper's serving benchmark keeps 83-88%).
4. profile: one 1-in-4 training step per n under `torch.profiler`, self CPU time split into attention
   kernels (sdpa forward and backward), matmuls and everything else: where the ratio of part 1 comes from.
5. decode-profile: the same split for batch-1 decode steps of the source and each decode model at the
   shortest and longest context, with cache appends (concatenations and in-place copies) on their own.

Prints one table per part and the target, marked met / not met; it asserts none of them. `--quick` runs
minuscule sizes once (a smoke run). The defaults (8 layers, width 256, 4 heads, 2 KV heads, MLP 1024,
vocabulary 8192, L = 1024: the ConceptMoE benchmark's widths) take about 10 minutes on 2 CPU cores;
n = 8 all-full training and the 4k-token prefills at n = 4 dominate.

    python benchmarks/bench_hidden_decoding.py [--seq-len 1024] [--streams 1,2,4,8] [--repeats 5]
        [--layers 8] [--hidden 256] [--intermediate 1024] [--heads 4] [--kv-heads 2] [--vocab 8192]
        [--kv-prompt 512] [--decode-contexts 512,1024,2048,4096] [--decode-tokens 32]
        [--decode-streams 4] [--decode-batches 1,4] [--decode-layouts 1-in-4]
        [--parts train,kv,decode,profile,decode-profile] [--threads N] [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from transformers.cache_utils import Cache

from hf_concept.modeling.configuration_hidden_decoding import HiddenDecodingConfig, default_stream_layout
from hf_concept.modeling.configuration_plain import PlainDecoderConfig
from hf_concept.modeling.forward_only_cache import cache_num_bytes
from hf_concept.modeling.hidden_decoding_cache import GROWTH_BLOCK_TOKENS, BlockGrowthLayer
from hf_concept.modeling.modeling_hidden_decoding import HiddenDecodingForCausalLM
from hf_concept.modeling.modeling_plain import PlainDecoderForCausalLM
from hf_concept.modeling.transformers_compat import cache_kwarg, output_cache
from hf_concept.tables import format_table

TARGET_STEP_RATIO = 4.6
# The paper's serving benchmark keeps 83-88% of the source's tokens/s at batch 1.
TARGET_DECODE_RATIO = 0.85
TARGET_STREAMS = 4
EXACTNESS_TOLERANCE = 1e-4
PARTS = ("train", "kv", "decode", "profile", "decode-profile")
QUICK = dict(
    layers=4, hidden=32, intermediate=64, heads=4, kv_heads=2, vocab=64, seq_len=32, kv_prompt=16,
    decode_contexts=[8, 16], decode_tokens=3, repeats=1,
)  # fmt: skip


def _int_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256, help="width D")
    parser.add_argument("--intermediate", type=int, default=1024, help="MLP width")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (head dim = hidden / heads)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per training row (L)")
    parser.add_argument("--streams", type=_int_list, default=[1, 2, 4, 8], help="n for the training step")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--kv-prompt", type=int, default=512, help="prefill length for the KV bytes")
    parser.add_argument(
        "--decode-contexts",
        type=_int_list,
        default=[512, 1024, 2048, 4096],
        help="prompt tokens before decoding",
    )
    parser.add_argument("--decode-tokens", type=int, default=32, help="greedy cached steps timed")
    parser.add_argument("--decode-streams", type=_int_list, default=[4], help="n for decoding")
    parser.add_argument("--decode-batches", type=_int_list, default=[1, 4], help="batch sizes for decoding")
    parser.add_argument(
        "--decode-layouts", default="1-in-4", help="comma-separated subset of all-full,1-in-4 for decoding"
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument("--quick", action="store_true", help="minuscule sizes, one round (smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device", default="cpu", help="torch device of the models (decode part only on cuda)"
    )
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    args.parts = args.parts.split(",")
    args.decode_layouts = args.decode_layouts.split(",")
    if args.device != "cpu" and set(args.parts) - {"decode"}:
        parser.error(f"--device={args.device} times the decode part only: pass --parts decode")
    if not set(args.decode_layouts) <= {"all-full", "1-in-4"}:
        parser.error(f"--decode-layouts={args.decode_layouts} must be a subset of all-full,1-in-4")
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts has {unknown}; choose from {PARTS}")
    if args.hidden % args.heads != 0:
        parser.error(f"--hidden={args.hidden} must be divisible by --heads={args.heads}")
    if 1 not in args.streams:
        parser.error(f"--streams={args.streams} must include 1 (the baseline of the training ratios)")
    return args


# ---------------------------------------------------------------------------------------------- models


def build_source(args: argparse.Namespace) -> PlainDecoderForCausalLM:
    """The seeded random source on `--device` in `--dtype`."""
    longest = max(args.seq_len, args.kv_prompt, max(args.decode_contexts) + args.decode_tokens + 1)
    config = PlainDecoderConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.streams + args.decode_streams) * longest + 16,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    return PlainDecoderForCausalLM(config).eval().to(args.device, getattr(torch, args.dtype))


def layouts(layers: int) -> dict[str, tuple[list[str], str]]:
    """Name -> (stream_attention_layout, stream_kv)."""
    one_in_four = default_stream_layout(layers, 4)
    return {
        "all-full": (["full"] * layers, "per_stream"),
        "1-in-4": (one_in_four, "per_stream"),
        "all-intra": (["intra"] * layers, "per_stream"),
        "1-in-4 shared": (one_in_four, "shared"),
    }


def hidden_decoding_from(
    source: PlainDecoderForCausalLM, streams: int, layout: list[str], stream_kv: str
) -> HiddenDecodingForCausalLM:
    """The source's weights in an HD model: n copies of the embedding table, everything else as is."""
    fields = source.config.to_dict()
    for key in ("model_type", "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype"):
        fields.pop(key, None)
    # layer_types follows the layout in HD configs.
    fields.pop("layer_types", None)
    config = HiddenDecodingConfig(
        **fields, num_streams=streams, stream_attention_layout=list(layout), stream_kv=stream_kv
    )
    config._attn_implementation = "sdpa"
    model = HiddenDecodingForCausalLM(config)
    state = dict(source.state_dict())
    # (V, n·D): row v = [E(v) | E(v) | ...]
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"].repeat(1, streams)
    model = model.to(source.device, source.dtype)
    model.load_state_dict(state, strict=True)
    return model.eval()


def check_exactness(source: PlainDecoderForCausalLM, models: dict, args: argparse.Namespace) -> float:
    """Every n = 1 model reproduces the source's logits; returns the largest difference."""
    input_ids = prompt(1, min(64, args.seq_len), args.vocab, args.seed + 1)
    worst = 0.0
    with torch.inference_mode():
        expected = source(input_ids=input_ids, use_cache=False).logits
        for (_, streams), model in models.items():
            if streams == 1:
                actual = model(input_ids=input_ids, use_cache=False).logits
                torch.testing.assert_close(
                    actual, expected, atol=EXACTNESS_TOLERANCE, rtol=EXACTNESS_TOLERANCE
                )
                worst = max(worst, (actual - expected).abs().max().item())
    return worst


def prompt(batch: int, length: int, vocab: int, seed: int, device: str = "cpu") -> torch.Tensor:
    ids = torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
    return ids.to(device)


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that a timer read after it measures that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------- measuring


def interleaved_medians(calls: dict[object, Callable[[], float]], repeats: int, label: str) -> dict:
    """Median of the seconds each call reports; one warm-up each, then `repeats` rounds that run every
    call in turn (so machine noise hits all of them alike)."""
    for call in calls.values():
        call()
    seconds = defaultdict(list)
    for repeat in range(repeats):
        for key, call in calls.items():
            seconds[key].append(call())
        print(f"  {label}: round {repeat + 1}/{repeats} done", flush=True)
    return {key: statistics.median(values) for key, values in seconds.items()}


def training_step(model, input_ids: torch.Tensor) -> Callable[[], float]:
    """A call that runs forward + backward of the next-token loss and returns its seconds."""

    def step() -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
        return time.perf_counter() - start

    return step


def prefill(model, input_ids: torch.Tensor, cache: Cache | None = None):
    """(cache, next token (B, 1)) after one cached forward over the prompt (into `cache` if given)."""
    output = model(input_ids=input_ids, **cache_kwarg(cache), use_cache=True, logits_to_keep=1)
    return output_cache(output), output.logits[:, -1].argmax(dim=-1, keepdim=True)


def block_cache(model) -> Cache:
    """The source's cache in `StreamCache`'s block-growing layers: a baseline without concatenation."""
    return Cache(
        layers=[BlockGrowthLayer(GROWTH_BLOCK_TOKENS) for _ in range(model.config.num_hidden_layers)]
    )


def greedy_decode(model, input_ids: torch.Tensor, steps: int, blocks: bool = False) -> Callable[[], float]:
    """Prefills once (untimed; into `block_cache` when `blocks`); each call decodes `steps` greedy cached
    steps from a copy of that cache and returns their seconds (the copy, also untimed, keeps every round
    on the same context)."""
    with torch.inference_mode():
        prefilled, first_token = prefill(model, input_ids, block_cache(model) if blocks else None)

    def run() -> float:
        with torch.inference_mode():
            cache, next_token = copy.deepcopy(prefilled), first_token
            synchronize(input_ids.device)
            start = time.perf_counter()
            for _ in range(steps):
                output = model(input_ids=next_token, **cache_kwarg(cache), use_cache=True, logits_to_keep=1)
                next_token = output.logits[:, -1].argmax(dim=-1, keepdim=True)
            synchronize(input_ids.device)
            return time.perf_counter() - start

    return run


def step_kinds(events) -> dict[str, float]:
    """Self CPU ms of profiler events by kind: attention kernels, matmuls, cache appends (concatenation
    and in-place copies) and everything else."""
    kinds = dict(attention=0.0, matmul=0.0, cache=0.0, other=0.0)
    for event in events:
        if "scaled_dot_product" in event.key:
            kind = "attention"
        elif event.key in ("aten::mm", "aten::bmm", "aten::addmm", "aten::matmul", "aten::linear"):
            kind = "matmul"
        elif event.key in ("aten::cat", "aten::copy_"):
            kind = "cache"
        else:
            kind = "other"
        kinds[kind] += event.self_cpu_time_total / 1e3
    return kinds


# ------------------------------------------------------------------------------------------ estimating


def forward_macs(args: argparse.Namespace, layout: list[str], streams: int, length: int) -> float:
    """Matmul multiply-adds of one forward: the count the measured ratios are compared with."""
    head_dim = args.hidden // args.heads
    projections = 2 * args.hidden * args.heads * head_dim + 2 * args.hidden * args.kv_heads * head_dim
    per_token_layer = projections + 3 * args.hidden * args.intermediate
    # Causal attention: query t reads t + 1 keys; scores and the weighted sum each cost head_dim per key.
    causal_pairs = lambda size: size * (size + 1) / 2  # noqa: E731
    attention = 0.0
    for kind in layout:
        pairs = streams * causal_pairs(length) if kind == "intra" else causal_pairs(streams * length)
        attention += 2 * args.heads * head_dim * pairs
    lm_head = length * args.hidden * args.vocab
    return streams * length * len(layout) * per_token_layer + attention + lm_head


def attention_share(args: argparse.Namespace, layers: int, length: int) -> float:
    """Fraction of the n = 1 forward's multiply-adds spent in attention scores and weighted sums."""
    total = forward_macs(args, ["full"] * layers, 1, length)
    without = total - 2 * args.hidden * layers * length * (length + 1) / 2
    return 1 - without / total


# ------------------------------------------------------------------------------------------------ parts


def bench_training(source, args: argparse.Namespace) -> list[dict]:
    shapes = {name: value for name, value in layouts(args.layers).items() if name in ("all-full", "1-in-4")}
    models = {
        (name, streams): hidden_decoding_from(source, streams, layout, stream_kv).train()
        for name, (layout, stream_kv) in shapes.items()
        for streams in args.streams
    }
    difference = check_exactness(source, models, args)
    print(f"exactness: n=1 HD logits equal the source's for both layouts (max |diff| {difference:.2e})")
    input_ids = prompt(1, args.seq_len, args.vocab, args.seed + 2)
    calls = {key: training_step(model, input_ids) for key, model in models.items()}
    calls["source"] = training_step(source.train(), input_ids)
    seconds = interleaved_medians(calls, args.repeats, f"training L={args.seq_len}")
    source.eval()
    rows = []
    for (name, streams), _ in models.items():
        layout = shapes[name][0]
        rows.append(
            dict(
                layout=name,
                streams=streams,
                step_ms=seconds[(name, streams)] * 1e3,
                ratio=seconds[(name, streams)] / seconds[(name, 1)],
                estimate=forward_macs(args, layout, streams, args.seq_len)
                / forward_macs(args, layout, 1, args.seq_len),
                source_ms=seconds["source"] * 1e3,
            )
        )
    del models, calls
    return rows


def bench_kv(source, args: argparse.Namespace) -> list[dict]:
    input_ids = prompt(1, args.kv_prompt, args.vocab, args.seed + 3)
    with torch.inference_mode():
        source_bytes = cache_num_bytes(prefill(source, input_ids)[0])
        rows = []
        for name, (layout, stream_kv) in layouts(args.layers).items():
            for streams in args.streams:
                model = hidden_decoding_from(source, streams, layout, stream_kv)
                kv_bytes = cache_num_bytes(prefill(model, input_ids)[0])
                held = sum(1 if kind == "intra" and stream_kv == "shared" else streams for kind in layout)
                rows.append(
                    dict(
                        layout=name,
                        streams=streams,
                        bytes_per_token=kv_bytes / args.kv_prompt,
                        ratio=kv_bytes / source_bytes,
                        expected=held / len(layout),
                        source_bytes_per_token=source_bytes / args.kv_prompt,
                    )
                )
    return rows


def decode_models(source, args: argparse.Namespace) -> dict:
    """ "source" and (layout, n) -> model for the decode parts."""
    models = {"source": source}
    for name in args.decode_layouts:
        layout, stream_kv = layouts(args.layers)[name]
        for streams in args.decode_streams:
            models[(name, streams)] = hidden_decoding_from(source, streams, layout, stream_kv)
    return models


def bench_decode(source, args: argparse.Namespace) -> list[dict]:
    models = decode_models(source, args)
    rows = []
    for batch in args.decode_batches:
        for context in args.decode_contexts:
            input_ids = prompt(batch, context, args.vocab, args.seed + 4, args.device)
            calls = {
                key: greedy_decode(model, input_ids, args.decode_tokens) for key, model in models.items()
            }
            calls["source blocks"] = greedy_decode(source, input_ids, args.decode_tokens, blocks=True)
            seconds = interleaved_medians(calls, args.repeats, f"decode B={batch} T={context}")
            del calls
            rates = {key: batch * args.decode_tokens / value for key, value in seconds.items()}
            for key in models:
                if key not in ("source", "source blocks"):
                    name, streams = key
                    rows.append(
                        dict(
                            layout=name,
                            streams=streams,
                            batch=batch,
                            context=context,
                            source_rate=rates["source"],
                            rate=rates[key],
                            ratio=rates[key] / rates["source"],
                            blocks_rate=rates["source blocks"],
                            blocks_ratio=rates[key] / rates["source blocks"],
                        )
                    )
    return rows


def bench_decode_profile(source, args: argparse.Namespace) -> list[dict]:
    """Where a batch-1 decode step's time goes, per model, at the shortest and longest context: self CPU
    ms per step under torch.profiler, by kind (`step_kinds`), over `--decode-tokens` steps."""
    models = decode_models(source, args)
    rows = []
    for context in sorted({min(args.decode_contexts), max(args.decode_contexts)}):
        input_ids = prompt(1, context, args.vocab, args.seed + 4)
        for key, model in models.items():
            with torch.inference_mode():
                cache, next_token = prefill(model, input_ids)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                    for _ in range(args.decode_tokens):
                        output = model(
                            input_ids=next_token, **cache_kwarg(cache), use_cache=True, logits_to_keep=1
                        )
                        next_token = output.logits[:, -1].argmax(dim=-1, keepdim=True)
            kinds = step_kinds(profile.key_averages())
            per_step = {kind: value / args.decode_tokens for kind, value in kinds.items()}
            name = "source" if key == "source" else f"{key[0]} n={key[1]}"
            rows.append(dict(model=name, context=context, **per_step))
            del cache
    return rows


def step_breakdown(model, input_ids: torch.Tensor) -> dict[str, float]:
    """Milliseconds of one training step by kind of kernel (torch.profiler, self CPU time): attention
    (sdpa forward and backward), matmul, everything else (norms, RoPE, copies for folding/interleaving)."""
    step = training_step(model, input_ids)
    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step()
    kinds = step_kinds(profile.key_averages())
    kinds["other"] += kinds.pop("cache")
    return kinds


def bench_breakdown(source, args: argparse.Namespace) -> list[dict]:
    """Where the 1-in-4 step's time goes at each n: the attention share explains the ratio."""
    layout, stream_kv = layouts(args.layers)["1-in-4"]
    input_ids = prompt(1, args.seq_len, args.vocab, args.seed + 2)
    rows = []
    for streams in args.streams:
        model = hidden_decoding_from(source, streams, layout, stream_kv).train()
        rows.append(dict(layout="1-in-4", streams=streams, **step_breakdown(model, input_ids)))
        del model
    return rows


# -------------------------------------------------------------------------------------------- printing


def print_training(rows: list[dict], args: argparse.Namespace) -> None:
    share = attention_share(args, args.layers, args.seq_len)
    print(
        f"\n[training step: forward + backward, batch 1, L={args.seq_len}, sdpa; source step "
        f"{rows[0]['source_ms']:.1f} ms; attention is {share:.1%} of the n=1 forward's multiply-adds]"
    )
    cells = []
    for row in rows:
        figures = [f"{row['step_ms']:.1f}", f"{row['ratio']:.2f}", f"{row['estimate']:.2f}"]
        cells.append([row["layout"], row["streams"], row["streams"] * args.seq_len, *figures])
    headers = ("layout", "n", "expanded", "step ms", "x n=1", "x est.")
    print(format_table(headers, cells, align="<>", widths=(10, 2, 8, 10, 7, 7), sep=" "))
    target = [row for row in rows if row["layout"] == "1-in-4" and row["streams"] == TARGET_STREAMS]
    if target:
        ratio = target[0]["ratio"]
        verdict = "met" if ratio <= TARGET_STEP_RATIO else "NOT met"
        print(
            f"target: 1-in-4 at n={TARGET_STREAMS} <= {TARGET_STEP_RATIO}x the n=1 step: "
            f"{ratio:.2f}x {verdict}"
        )


def print_breakdown(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\n[profile: one 1-in-4 training step, L={args.seq_len}, self CPU ms by kernel kind]")
    base = sum(rows[0][kind] for kind in ("attention", "matmul", "other"))
    cells = []
    for row in rows:
        total = row["attention"] + row["matmul"] + row["other"]
        figures = [f"{row[kind]:.1f}" for kind in ("attention", "matmul", "other")]
        cells.append([row["streams"], *figures, f"{row['attention'] / total:.1%}", f"{total / base:.2f}"])
    headers = ("n", "attention", "matmul", "other", "attn %", "x n=1")
    print(format_table(headers, cells, align=">", widths=(2, 10, 10, 10, 7, 7), sep=" "))


def print_kv(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\n[KV cache after a {args.kv_prompt}-token prefill, fp32; source DynamicCache "
        f"{rows[0]['source_bytes_per_token']:.0f} bytes/token]"
    )
    cells = []
    for row in rows:
        figures = [f"{row['bytes_per_token']:.0f}", f"{row['ratio']:.3f}", f"{row['expected']:.3f}"]
        cells.append([row["layout"], row["streams"], *figures])
    headers = ("layout", "n", "bytes/token", "x source", "expected")
    print(format_table(headers, cells, align="<>", widths=(14, 2, 11, 8, 8), sep=" "))


def print_decode(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\n[decode: {args.decode_tokens} greedy cached steps after a prefill of T tokens; tokens/s over the "
        "batch; src: the source with transformers' DynamicCache; src blk: the source with the block-growing "
        "layers HD's StreamCache uses]"
    )
    formats = {
        "source_rate": ".1f",
        "rate": ".1f",
        "ratio": ".2f",
        "blocks_rate": ".1f",
        "blocks_ratio": ".2f",
    }
    cells = []
    for row in rows:
        figures = [format(row[key], spec) for key, spec in formats.items()]
        cells.append([row["layout"], row["streams"], row["batch"], row["context"], *figures])
    headers = ("layout", "n", "batch", "T", "src tok/s", "HD tok/s", "x source", "src blk", "x src blk")
    print(format_table(headers, cells, align="<>", widths=(10, 2, 5, 6, 10, 10, 8, 8, 9), sep=" "))
    target = [
        row
        for row in rows
        if row["layout"] == "1-in-4" and row["streams"] == TARGET_STREAMS and row["batch"] == 1
    ]
    if target:
        met = [str(row["context"]) for row in target if row["ratio"] >= TARGET_DECODE_RATIO]
        missed = [str(row["context"]) for row in target if row["ratio"] < TARGET_DECODE_RATIO]
        print(
            f"target: 1-in-4 at n={TARGET_STREAMS}, batch 1, >= {TARGET_DECODE_RATIO}x the source's "
            f"tokens/s: met at T={','.join(met) or 'none'}; NOT met at T={','.join(missed) or 'none'}"
        )


def print_decode_profile(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\n[decode profile: batch 1, self CPU ms per step by kernel kind, over {args.decode_tokens} steps]"
    )
    kinds = ("attention", "matmul", "cache", "other")
    cells = []
    for row in rows:
        figures = [row[kind] for kind in kinds]
        cells.append([row["model"], row["context"], *(f"{f:.2f}" for f in [*figures, sum(figures)])])
    headers = ("model", "T", *kinds, "total")
    print(format_table(headers, cells, align="<>", widths=(12, 6, 10, 8, 8, 8, 8), sep=" "))


# ------------------------------------------------------------------------------------------------ main


def _load() -> str:
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    source = build_source(args)
    print(
        f"source: PlainDecoderForCausalLM layers={args.layers} hidden={args.hidden} "
        f"intermediate={args.intermediate} heads={args.heads} kv_heads={args.kv_heads} vocab={args.vocab} "
        f"{args.dtype} on {args.device}, "
        f"sdpa; 1-in-4 layout {default_stream_layout(args.layers, 4)}; "
        f"threads={torch.get_num_threads()} torch={torch.__version__}; load average {_load()}"
    )
    if os.getloadavg()[0] > 0.5 * len(os.sched_getaffinity(0)):
        # On a 2-core VM another busy process slows each threaded kernel many times over, unevenly.
        print("WARNING: the machine is busy (load above); timings and ratios of this run are unreliable")
    figures = {}
    if "train" in args.parts:
        figures["train"] = bench_training(source, args)
        print_training(figures["train"], args)
    if "kv" in args.parts:
        figures["kv"] = bench_kv(source, args)
        print_kv(figures["kv"], args)
    if "decode" in args.parts:
        figures["decode"] = bench_decode(source, args)
        print_decode(figures["decode"], args)
    if "profile" in args.parts:
        figures["profile"] = bench_breakdown(source, args)
        print_breakdown(figures["profile"], args)
    if "decode-profile" in args.parts:
        figures["decode_profile"] = bench_decode_profile(source, args)
        print_decode_profile(figures["decode_profile"], args)
    # Other processes on a small machine skew every ratio: the load before and after shows whether they ran.
    print(f"\nload average at the end {_load()} (1, 5, 15 min; {len(os.sched_getaffinity(0))} cores)")
    if args.json is not None:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=1)
    return figures


if __name__ == "__main__":
    main()
