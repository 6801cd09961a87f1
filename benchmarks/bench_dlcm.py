"""DLCM: replicated cross-attention against the explicit L x M form, and DLCM prefill against a Llama.

Legend: B batch, L tokens, R tokens per concept, M = ceil(L / R) concept slots, H heads, K head dim.

Part 1, cross-attention (DLCM §4.1), for each R of `--attention-ratios` (2, 4, 8) and each L. Fixed
chunking: token t carries slot t // R (slot 0 is the learned null concept of the first chunk, slot j the
concept of chunk j - 1, readable once that chunk closed), so token t reads slots 0..t // R, slot n
weighted by how many positions s <= t carried it. Five forms of that one function, all starting from
(B, H, L, K) queries, (B, H, M, K) concept keys/values and the (B, L) slot index:
- replicated: `dlcm_replication.replicated_concept_attention(..., plain_causal=True)`: gather the concept
  K/V to token positions (repeat_interleave semantics) and run SDPA's causal kernel (L x L, no mask);
- counted: the library's L x M form as a fresh model call runs it (`cross_attention_form="counted"`):
  log(count) bias from each slot's run of positions (`run_count_bias`), SDPA with it as float mask;
- L x M eager: a direct implementation of the paper's L x M formulation: build the (L, M) availability
  mask and log(count) bias from the index (each slot's run of positions), scores q k^T over the M
  concepts plus that bias, softmax, times V;
- L x M sdpa: the same (L, M) bias built the same way, handed to SDPA as a float mask (the closest CPU
  analogue of the paper's flex-attention baseline: a fused kernel reading a materialised mask);
- L x M sdpa prebuilt: that kernel alone, the bias built once beforehand.
All but the last build the bias inside the call (the mapping of tokens to concepts changes every batch).
Before timing, all forms (and the library's decoding form, `concept_attention_counted` over cumulative
counts) are checked equal: outputs within 1e-5, gradients within 1e-4. Ratios are L x M time /
replicated time, forward and forward+backward, medians over interleaved rounds; per R, the faster of
the library's two training forms at each L is printed (the crossover `dlcm_replication.preferred_form`
encodes for "auto"). The project's target: >= 1.3x at L = 4096, R = 4 (the paper's Table 6:
1.26-1.73x for its GPU kernels against flex attention).

Part 2, whole model. A seeded random DLCM (`chunking="fixed"`, so exactly R tokens per concept) against a
Llama-style `PlainDecoderForCausalLM` whose MLP width is solved so that the non-embedding parameter
counts match (both printed). Per length: prefill (empty cache, `use_cache=True`, last logits only, as
generate) and a cache-less forward, no grad, the DLCM in its default cross-attention form ("auto");
the DLCM's two agree on the last logits (checked); KV bytes per token after prefill:
`ConceptCache.num_bytes()` against the plain `DynamicCache`'s key/value bytes, with the ideal ratio from
the layer shapes.

    python benchmarks/bench_dlcm.py [--seq-lens 1024,2048,4096,8192] [--attention-ratios 2,4,8]
        [--ratio 4] [--heads 8] [--head-dim 64] [--model-seq-lens 2048,4096] [--hidden 256]
        [--concept-hidden 512] [--plain-hidden 512] [--repeats 5] [--threads N] [--skip-attention]
        [--skip-model] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hf_concept.modeling.configuration_dlcm import DLCMConfig
from hf_concept.modeling.configuration_plain import PlainDecoderConfig
from hf_concept.modeling.dlcm_replication import (
    concept_attention_biased,
    concept_attention_counted,
    replicated_concept_attention,
    run_count_bias,
)
from hf_concept.modeling.forward_only_cache import cache_num_bytes
from hf_concept.modeling.modeling_dlcm import DLCMForCausalLM
from hf_concept.modeling.modeling_plain import PlainDecoderForCausalLM
from hf_concept.modeling.transformers_compat import output_cache
from hf_concept.tables import format_table

TARGET_LENGTH = 4096
TARGET_RATIO = 1.3
OUTPUT_TOLERANCE = 1e-5
GRADIENT_TOLERANCE = 1e-4
LOGITS_TOLERANCE = 1e-4
QUICK = dict(
    seq_lens="64,128",
    attention_ratios="2,4",
    model_seq_lens="64,128",
    heads=2,
    head_dim=16,
    hidden=32,
    concept_hidden=64,
    plain_hidden=64,
    token_heads=2,
    concept_heads=4,
    intermediate=64,
    vocab=64,
    repeats=1,
)


def lengths(text: str) -> list[int]:
    """Comma-separated positive lengths (an argparse type: a bad value exits 2 with a one-line message)."""
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every length must be at least 1")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=lengths, default="1024,2048,4096,8192", help="cross-attention L")
    parser.add_argument(
        "--ratio", type=int, default=4, help="whole-model tokens per concept R (fixed chunking)"
    )
    parser.add_argument(
        "--attention-ratios", type=lengths, default="2,4,8", help="cross-attention tokens per concept R"
    )
    parser.add_argument("--batch", type=int, default=1, help="rows B")
    parser.add_argument("--heads", type=int, default=8, help="cross-attention heads H")
    parser.add_argument("--head-dim", type=int, default=64, help="cross-attention head dim K")
    parser.add_argument("--model-seq-lens", type=lengths, default="2048,4096", help="whole-model lengths")
    parser.add_argument("--hidden", type=int, default=256, help="DLCM d_token")
    parser.add_argument("--concept-hidden", type=int, default=512, help="DLCM d_concept")
    parser.add_argument("--plain-hidden", type=int, default=512, help="width of the plain model")
    parser.add_argument(
        "--token-heads", type=int, default=4, help="DLCM token-stage heads (K = d_token / heads)"
    )
    parser.add_argument("--concept-heads", type=int, default=8, help="DLCM concept-stage heads")
    parser.add_argument("--intermediate", type=int, default=1024, help="DLCM token-stage MLP width")
    parser.add_argument("--encoder-layers", type=int, default=2)
    parser.add_argument("--concept-layers", type=int, default=4)
    parser.add_argument("--decoder-layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per length (median)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    parser.add_argument("--skip-attention", action="store_true", help="leave out part 1")
    parser.add_argument("--skip-model", action="store_true", help="leave out part 2")
    parser.add_argument("--quick", action="store_true", help="minuscule default sizes (a smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    if parser.parse_known_args(argv)[0].quick:
        # Defaults only: flags given explicitly still win.
        parser.set_defaults(**QUICK)
    args = parser.parse_args(argv)
    for name in ("ratio", "repeats", "heads", "head_dim", "batch", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    return args


def timed(function: Callable[[], object]) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def interleaved(
    calls: dict[str, Callable[[], object]], repeats: int, warm_up: bool = True
) -> dict[str, float]:
    """Median seconds per call; each round runs every call once, in turn (after one warm-up call each)."""
    if warm_up:
        for call in calls.values():
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            times[name].append(timed(call))
    return {name: statistics.median(values) for name, values in times.items()}


def verdict(ratio: float | None, length: int) -> str:
    if ratio is None:
        return f"not measured (L={length} not run)"
    return f"{ratio:.2f}x {'met' if ratio >= TARGET_RATIO else 'NOT met'}"


# ------------------------------------------------------------------------------ part 1: cross-attention


def fixed_index(batch: int, length: int, ratio: int) -> torch.Tensor:
    """Long (B, L): token t carries slot t // R (fixed chunking, one document, no pads)."""
    return (torch.arange(length) // ratio).expand(batch, length).contiguous()


def count_bias(index: torch.Tensor, num_slots: int) -> torch.Tensor:
    """(B, 1, L, M) float: log #{s <= t: index[s] = m} where concept m is available to token t, else -inf.

    The materialised (L, M) availability mask of the L x M formulation, with the replication weights.
    Built from each slot's run of positions (first, last): under replication a slot is carried by one
    contiguous run (from when it becomes readable until the next one does), so the count is
    clamp(min(t, last) - first + 1, 0): a few elementwise passes over (L, M) floats."""
    batch_size, length = index.shape
    positions = torch.arange(length, device=index.device).expand(batch_size, length)
    first = torch.full((batch_size, num_slots), length, device=index.device)
    first = first.scatter_reduce(1, index, positions, "amin")
    last = torch.full((batch_size, num_slots), -1, device=index.device)
    last = last.scatter_reduce(1, index, positions, "amax")
    run = (last - first + 1).float().unsqueeze(1)  # (B, 1, M)
    counts = positions.float().unsqueeze(2) - first.float().unsqueeze(1) + 1  # (B, L, M)
    counts = torch.minimum(counts, run).clamp_(min=0)
    bias = torch.where(counts > 0, counts.log(), float("-inf"))
    return bias.unsqueeze(1)


def lxm_eager(query, concept_k, concept_v, index, scale: float) -> torch.Tensor:
    """(B, H, L, K): softmax over the M concepts of q k^T * scale + bias, times V (explicit scores)."""
    bias = count_bias(index, concept_k.shape[2])
    scores = torch.matmul(query, concept_k.transpose(-1, -2)) * scale + bias  # (B, H, L, M)
    return torch.matmul(torch.softmax(scores, dim=-1), concept_v)


def lxm_sdpa(query, concept_k, concept_v, index, scale: float) -> torch.Tensor:
    """(B, H, L, K): the same, with the (L, M) bias given to SDPA as a float mask."""
    bias = count_bias(index, concept_k.shape[2])
    return F.scaled_dot_product_attention(query, concept_k, concept_v, attn_mask=bias, scale=scale)


def replicated(query, concept_k, concept_v, index, scale: float) -> torch.Tensor:
    """(B, H, L, K): concept K/V gathered to token positions, SDPA's causal kernel."""
    mask = torch.ones_like(index, dtype=torch.bool)
    starts = torch.zeros_like(mask)
    starts[:, 0] = True
    return replicated_concept_attention(
        query, concept_k, concept_v, index, mask, starts, scale=scale, plain_causal=True
    )


def counted(query, concept_k, concept_v, index, scale: float) -> torch.Tensor:
    """(B, H, L, K): the library's L x M form as the model runs it in a fresh call: counts from each slot's
    run of positions (`run_count_bias`), then SDPA with it as float mask (`concept_attention_biased`)."""
    mask = torch.ones_like(index, dtype=torch.bool)
    starts = torch.zeros_like(mask)
    starts[:, 0] = True
    bias, sees = run_count_bias(index, mask, starts, concept_k.shape[2])
    return concept_attention_biased(query, concept_k, concept_v, bias, sees, scale=scale)


LXM_FORMS = {
    "counted": "LxM counted (library)",
    "lxm_eager": "LxM eager",
    "lxm_sdpa": "LxM sdpa",
    "lxm_prebuilt": "LxM sdpa prebuilt",
}


def attention_forms(index: torch.Tensor, num_slots: int) -> dict[str, Callable[..., torch.Tensor]]:
    """The forms timed, by name; `lxm_prebuilt` is the SDPA form given a bias built once, outside the call
    (the kernel alone: the floor under what any L x M implementation with a materialised mask costs)."""
    bias = count_bias(index, num_slots)

    def lxm_prebuilt(query, concept_k, concept_v, index, scale: float) -> torch.Tensor:
        return F.scaled_dot_product_attention(query, concept_k, concept_v, attn_mask=bias, scale=scale)

    return dict(
        replicated=replicated,
        counted=counted,
        lxm_eager=lxm_eager,
        lxm_sdpa=lxm_sdpa,
        lxm_prebuilt=lxm_prebuilt,
    )


def attention_inputs(args: argparse.Namespace, length: int, ratio: int) -> tuple[torch.Tensor, ...]:
    """Queries (B, H, L, K), concept keys/values (B, H, M, K), upstream gradient (B, H, L, K), index."""
    generator = torch.Generator().manual_seed(args.seed + length)
    num_slots = -(-length // ratio)
    shape = (args.batch, args.heads)
    query = torch.randn(*shape, length, args.head_dim, generator=generator)
    concept_k = torch.randn(*shape, num_slots, args.head_dim, generator=generator)
    concept_v = torch.randn(*shape, num_slots, args.head_dim, generator=generator)
    upstream = torch.randn(*shape, length, args.head_dim, generator=generator)
    return query, concept_k, concept_v, upstream, fixed_index(args.batch, length, ratio)


def forward_backward(form, query, concept_k, concept_v, upstream, index, scale: float):
    leaves = [tensor.detach().requires_grad_(True) for tensor in (query, concept_k, concept_v)]
    output = form(*leaves, index, scale)
    output.backward(upstream)
    return output.detach(), *(leaf.grad for leaf in leaves)


def check_forms(inputs: tuple[torch.Tensor, ...], forms: dict, scale: float) -> float:
    """Largest output difference of the L x M forms (and the library's counted form) to the replicated one."""
    query, concept_k, concept_v, _, index = inputs
    expected = forward_backward(replicated, *inputs, scale)
    counts = torch.cumsum(F.one_hot(index, concept_k.shape[2]), dim=1)
    with torch.no_grad():
        counted = concept_attention_counted(query, concept_k, concept_v, counts, scale=scale)
    torch.testing.assert_close(counted, expected[0], atol=OUTPUT_TOLERANCE, rtol=OUTPUT_TOLERANCE)
    worst = (counted - expected[0]).abs().max().item()
    for name in LXM_FORMS:
        actual = forward_backward(forms[name], *inputs, scale)
        torch.testing.assert_close(actual[0], expected[0], atol=OUTPUT_TOLERANCE, rtol=OUTPUT_TOLERANCE)
        for grad, expected_grad in zip(actual[1:], expected[1:], strict=True):
            torch.testing.assert_close(grad, expected_grad, atol=GRADIENT_TOLERANCE, rtol=GRADIENT_TOLERANCE)
        worst = max(worst, (actual[0] - expected[0]).abs().max().item())
    return worst


def attention_row(args: argparse.Namespace, length: int, ratio: int) -> dict[str, float]:
    inputs = attention_inputs(args, length, ratio)
    query, concept_k, concept_v, _, index = inputs
    scale = args.head_dim**-0.5
    forms = attention_forms(index, concept_k.shape[2])
    difference = check_forms(inputs, forms, scale)

    def forward_call(form):
        def call():
            with torch.no_grad():
                form(query, concept_k, concept_v, index, scale)

        return call

    forward = interleaved({name: forward_call(form) for name, form in forms.items()}, args.repeats)
    both = interleaved(
        {name: lambda form=form: forward_backward(form, *inputs, scale) for name, form in forms.items()},
        args.repeats,
    )
    build = interleaved({"bias": lambda: count_bias(index, concept_k.shape[2])}, args.repeats)["bias"]
    row = dict(
        length=length, ratio=ratio, slots=concept_k.shape[2], difference=difference, bias_ms=build * 1e3
    )
    for mode, medians in (("fwd", forward), ("fwdbwd", both)):
        for name, seconds in medians.items():
            row[f"{mode}_{name}_ms"] = seconds * 1e3
        for name in LXM_FORMS:
            row[f"{mode}_{name}_x"] = medians[name] / medians["replicated"]
    return row


def print_attention(rows: list[dict[str, float]], args: argparse.Namespace) -> None:
    print(
        f"\n[cross-attention, B={args.batch} H={args.heads} K={args.head_dim}; x = L x M time / replicated "
        f"time (below 1: the L x M form is faster); medians of {args.repeats} rounds; ms per call]"
    )
    names = ["replicated", *LXM_FORMS]
    columns = ["replicated", "counted", "eager", "sdpa", "prebuilt", "counted x", "eager x", "sdpa x"]
    cells = []
    for row in rows:
        for mode, label in (("fwd", "fwd"), ("fwdbwd", "fwd+bwd")):
            figures = [row[f"{mode}_{name}_ms"] for name in names]
            figures += [row[f"{mode}_{name}_x"] for name in ("counted", "lxm_eager", "lxm_sdpa")]
            cells.append([row["length"], row["ratio"], row["slots"], label, *(f"{f:.2f}" for f in figures)])
    widths = (6, 3, 5, 8, *[10] * len(columns))
    print(format_table(["L", "R", "M", "mode", *columns], cells, align=">", widths=widths, sep=" "))
    print(
        "columns: counted = the library's L x M form as the model runs it (log(count) bias from each "
        "slot's run of positions, SDPA with it as float mask); eager / sdpa build the (L, M) bias the same "
        "way in the call; prebuilt = sdpa with that bias built once beforehand"
    )
    print_crossover(rows)
    at_target = {(row["length"], row["ratio"]): row for row in rows}.get((TARGET_LENGTH, 4))
    print(f"target (L x M time / replicated time >= {TARGET_RATIO}x at L={TARGET_LENGTH}, R=4):")
    for mode, label in (("fwd", "forward"), ("fwdbwd", "forward+backward")):
        parts = []
        for name, title in LXM_FORMS.items():
            ratio = None if at_target is None else at_target[f"{mode}_{name}_x"]
            parts.append(f"vs {title} {verdict(ratio, TARGET_LENGTH)}")
        print(f"  {label}: " + "; ".join(parts))


def print_crossover(rows: list[dict[str, float]]) -> None:
    """Per R, which of the library's two training forms is faster at each L (forward+backward)."""
    print("faster training form (forward+backward), library counted vs replicated, per R:")
    for ratio in sorted({row["ratio"] for row in rows}):
        cells = [
            f"L={row['length']}: {'counted' if row['fwdbwd_counted_x'] < 1 else 'replicated'} "
            f"({row['fwdbwd_counted_x']:.2f}x)"
            for row in rows
            if row["ratio"] == ratio
        ]
        print(f"  R={ratio}: " + "; ".join(cells))


def run_attention(args: argparse.Namespace) -> list[dict[str, float]]:
    rows = []
    for ratio in args.attention_ratios:
        for length in args.seq_lens:
            rows.append(attention_row(args, length, ratio))
            print(
                f"  L={length} R={ratio}: forms agree (outputs within {OUTPUT_TOLERANCE:g}, gradients within "
                f"{GRADIENT_TOLERANCE:g}; max |diff| {rows[-1]['difference']:.2e}); timed",
                flush=True,
            )
    print_attention(rows, args)
    return rows


# ---------------------------------------------------------------------------------- part 2: whole model


def non_embedding_parameters(model: torch.nn.Module) -> int:
    """Parameters outside the token embedding and the LM head."""
    return sum(
        parameter.numel()
        for name, parameter in model.named_parameters()
        if not (name.startswith("model.embed_tokens.") or name.startswith("lm_head."))
    )


def build_dlcm(args: argparse.Namespace) -> DLCMForCausalLM:
    if args.hidden % args.token_heads or args.concept_hidden % args.concept_heads:
        raise ValueError(
            f"--hidden={args.hidden} / --concept-hidden={args.concept_hidden} must be divisible by "
            f"--token-heads={args.token_heads} / --concept-heads={args.concept_heads}"
        )
    config = DLCMConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_attention_heads=args.token_heads,
        num_key_value_heads=args.token_heads,
        head_dim=args.hidden // args.token_heads,
        encoder_layers=args.encoder_layers,
        concept_layers=args.concept_layers,
        decoder_layers=args.decoder_layers,
        concept_hidden_size=args.concept_hidden,
        concept_num_attention_heads=args.concept_heads,
        compression_ratio=args.ratio,
        chunking="fixed",
        max_position_embeddings=max(args.model_seq_lens) + 16,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    return DLCMForCausalLM(config).to(torch.float32).eval()


def build_plain(args: argparse.Namespace, target: int) -> PlainDecoderForCausalLM:
    """A Llama-style model of width --plain-hidden (head dim as the DLCM's token stage, no GQA) whose layer
    count and MLP width are solved so that its non-embedding parameters come closest to `target`."""
    width, head_dim = args.plain_hidden, args.hidden // args.token_heads
    if width % head_dim:
        raise ValueError(f"--plain-hidden={width} must be a multiple of the head dim {head_dim}")
    attention = 4 * width * width + 2 * width  # q, k, v, o and the two norms of a layer

    def total(layers: int, intermediate: int) -> int:
        return layers * (attention + 3 * width * intermediate) + width

    layers = max(1, round(target / (attention + 12 * width * width)))
    step = 16 if width >= 256 else 1
    intermediate = max(step, round((target - total(layers, 0)) / (3 * width * layers) / step) * step)
    config = PlainDecoderConfig(
        vocab_size=args.vocab,
        hidden_size=width,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=width // head_dim,
        num_key_value_heads=width // head_dim,
        head_dim=head_dim,
        max_position_embeddings=max(args.model_seq_lens) + 16,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed + 1)
    return PlainDecoderForCausalLM(config).to(torch.float32).eval()


def ideal_kv_ratio(dlcm: DLCMConfig, plain: PlainDecoderConfig) -> float:
    """K/V floats per token: token layers per token, concept and cross-attention layers per concept."""
    token = (dlcm.encoder_layers + dlcm.decoder_layers) * dlcm.num_key_value_heads * dlcm.head_dim
    concept = dlcm.concept_layers * dlcm.concept_num_key_value_heads * dlcm.concept_head_dim
    cross = dlcm.decoder_layers * dlcm.cross_num_key_value_heads * dlcm.cross_head_dim
    baseline = plain.num_hidden_layers * plain.num_key_value_heads * plain.head_dim
    return (token + (concept + cross) / dlcm.compression_ratio) / baseline


def prefill(model, input_ids: torch.Tensor):
    with torch.inference_mode():
        return model(input_ids=input_ids, use_cache=True, logits_to_keep=1)


def forward(model, input_ids: torch.Tensor):
    with torch.inference_mode():
        return model(input_ids=input_ids, use_cache=False, logits_to_keep=1)


def model_row(dlcm, plain, args: argparse.Namespace, length: int) -> dict[str, float]:
    input_ids = torch.randint(3, args.vocab, (1, length), generator=torch.Generator().manual_seed(length))
    # The first calls are the warm-up and the checks: the cached prefill (counted L x M reading) and the
    # cache-less forward (replicated reading) give the same last logits; the caches give the KV bytes.
    dlcm_prefilled, plain_prefilled = prefill(dlcm, input_ids), prefill(plain, input_ids)
    dlcm_logits = forward(dlcm, input_ids).logits
    forward(plain, input_ids)
    torch.testing.assert_close(
        dlcm_prefilled.logits, dlcm_logits, atol=LOGITS_TOLERANCE, rtol=LOGITS_TOLERANCE
    )
    realised = dlcm_prefilled.compression_ratio.item()
    calls = {
        "dlcm_prefill": lambda: prefill(dlcm, input_ids),
        "plain_prefill": lambda: prefill(plain, input_ids),
        "dlcm_forward": lambda: forward(dlcm, input_ids),
        "plain_forward": lambda: forward(plain, input_ids),
    }
    medians = interleaved(calls, args.repeats, warm_up=False)
    dlcm_bytes = cache_num_bytes(output_cache(dlcm_prefilled)) / length
    plain_bytes = cache_num_bytes(output_cache(plain_prefilled)) / length
    return dict(
        length=length,
        realised=realised,
        **{f"{name}_ms": seconds * 1e3 for name, seconds in medians.items()},
        prefill_x=medians["plain_prefill"] / medians["dlcm_prefill"],
        forward_x=medians["plain_forward"] / medians["dlcm_forward"],
        dlcm_kv_per_token=dlcm_bytes,
        plain_kv_per_token=plain_bytes,
        kv_ratio=dlcm_bytes / plain_bytes,
        ideal_kv_ratio=ideal_kv_ratio(dlcm.config, plain.config),
    )


def describe_models(dlcm, plain) -> dict[str, int]:
    dlcm_params, plain_params = non_embedding_parameters(dlcm), non_embedding_parameters(plain)
    d, p = dlcm.config, plain.config
    print(
        f"\nDLCM: d_token={d.hidden_size} (heads {d.num_attention_heads}x{d.head_dim}, MLP "
        f"{d.intermediate_size}), d_concept={d.concept_hidden_size} (heads {d.concept_num_attention_heads}x"
        f"{d.concept_head_dim}, MLP {d.concept_intermediate_size}), cross heads {d.cross_num_attention_heads}"
        f"x{d.cross_head_dim}, E/C/D = {d.encoder_layers}/{d.concept_layers}/{d.decoder_layers}, "
        f"R={d.compression_ratio:g} fixed chunking"
    )
    print(
        f"plain: {p.num_hidden_layers} layers, width {p.hidden_size} (heads {p.num_attention_heads}x"
        f"{p.head_dim}, MLP {p.intermediate_size}); vocabulary {p.vocab_size} for both, fp32, sdpa"
    )
    print(
        f"non-embedding parameters: DLCM {dlcm_params:,}, plain {plain_params:,} "
        f"(plain / DLCM {plain_params / dlcm_params:.3f})"
    )
    return dict(dlcm_params=dlcm_params, plain_params=plain_params)


def print_model(rows: list[dict[str, float]], args: argparse.Namespace) -> None:
    print(f"\n[whole model, B=1, no grad; x = plain time / DLCM time; medians of {args.repeats} rounds]")
    headers = [
        "L",
        "R",
        "DLCM pre ms",
        "plain pre ms",
        "prefill x",
        "DLCM fwd ms",
        "plain fwd ms",
        "forward x",
    ]
    headers += ["KV B/tok DLCM", "plain", "KV ratio", "ideal"]
    widths = (6, 5, 11, 12, 9, 11, 12, 9, 13, 7, 8, 6)
    cells = []
    for row in rows:
        prefill = [
            f"{row['dlcm_prefill_ms']:.1f}",
            f"{row['plain_prefill_ms']:.1f}",
            f"{row['prefill_x']:.2f}",
        ]
        forward = [
            f"{row['dlcm_forward_ms']:.1f}",
            f"{row['plain_forward_ms']:.1f}",
            f"{row['forward_x']:.2f}",
        ]
        kv = [f"{row['dlcm_kv_per_token']:.0f}", f"{row['plain_kv_per_token']:.0f}"]
        kv += [f"{row['kv_ratio']:.4f}", f"{row['ideal_kv_ratio']:.4f}"]
        cells.append([row["length"], f"{row['realised']:.2f}", *prefill, *forward, *kv])
    print(format_table(headers, cells, align=">", widths=widths, sep=" "))


def run_model(args: argparse.Namespace) -> dict:
    dlcm = build_dlcm(args)
    plain = build_plain(args, non_embedding_parameters(dlcm))
    counts = describe_models(dlcm, plain)
    rows = []
    for length in args.model_seq_lens:
        rows.append(model_row(dlcm, plain, args, length))
        print(f"  L={length}: DLCM cached prefill and cache-less forward agree on the last logits; timed")
    print_model(rows, args)
    return dict(rows=rows, **counts)


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"DLCM benchmark: threads={torch.get_num_threads()} torch={torch.__version__} fp32 CPU")
    figures = {}
    if not args.skip_attention:
        figures["attention"] = run_attention(args)
    if not args.skip_model:
        figures["model"] = run_model(args)
    return figures


if __name__ == "__main__":
    main()
