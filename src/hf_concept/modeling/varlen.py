"""Variable-length ("varlen") attention on PyTorch's built-in flash kernel, `torch.nn.attention.varlen`.

Legend: B batch, Lq / Lk query / key positions of a call, H query heads, G key/value heads (H a multiple
of G), K head dim, Nq / Nk packed query / key tokens, S segments.

Selected with `attn_implementation="hf_concept_varlen"` (registered below in transformers'
`AttentionInterface`, its masks built as for sdpa through `AttentionMaskInterface`). The kernel packs the
real tokens of every row into one (N, heads, K) tensor, segment after segment, and attends causally
within each segment (bottom-right aligned, as flash attention: a segment's last query sees its last key),
optionally in a causal window of W keys (`window_size=(W - 1, 0)`), with grouped key/value heads.

Which masks map. The layout comes from the (B, 1, Lq, Lk) boolean mask the caller built
(`layout_from_mask`), or, without a mask, from `position_ids` resets to 0 (transformers' packing
convention; `layout_from_position_ids`) or one segment per row. A derived layout is used only if the mask
it stands for (`layout_mask`) equals the given mask exactly; otherwise the call falls back to sdpa with a
one-time warning naming the reason. That covers padded and packed rows, concept sequences of packed
documents, sliding windows counted in positions, and cache steps whose new queries close a row's
segment. It does not cover masks that are not causal-within-contiguous-segments: a window counted in
something other than the packed positions (concept layers' token-position windows), a query that sees a
block of later keys (Hidden Decoding's `token_block` cross-stream mask), or float masks that carry a bias
beyond 0/-inf. Dropout, a device other than CUDA or a dtype other than fp16/bf16 also fall back (the
kernel has no dropout and runs only there): on CPU the implementation computes what sdpa computes, with
one warning, so a checkpoint saved with this implementation still loads and runs everywhere.

Cost: the masks are built as for sdpa (O(Lq·Lk) booleans where a mask is needed: padded or packed rows),
and reading a layout off one takes a few more passes over it; calls without a mask (plain causal rows,
decode steps without padding) skip both. `benchmarks/gpu_suite.py` measures the whole path.

Pure tensor bookkeeping lives here and is tested on CPU against `varlen_reference`, a per-segment
sdpa of the kernel's contract; `use_varlen_kernel(varlen_reference)` substitutes it for the kernel.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers.utils import logging

logger = logging.get_logger(__name__)

VARLEN_ATTENTION = "hf_concept_varlen"
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
CAUSAL = (-1, 0)


@dataclass
class VarlenLayout:
    """Where the packed tokens come from and how they split into segments.

    `query_positions` (Nq,) / `key_positions` (Nk,) are flat row-major indices into (B·Lq) / (B·Lk), in
    segment order; `cu_seq_q` / `cu_seq_k` int32 (S + 1,) cumulative segment lengths; `max_q` / `max_k`
    the longest segment; `window_size` the kernel's (left, right) argument."""

    query_positions: torch.Tensor
    key_positions: torch.Tensor
    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor
    max_q: int
    max_k: int
    window_size: tuple[int, int] = CAUSAL

    @property
    def num_segments(self) -> int:
        return self.cu_seq_q.numel() - 1


def window_size_for(sliding_window: int | None) -> tuple[int, int]:
    """The kernel's (left, right) for a causal window of `sliding_window` keys, the query's own included
    (transformers' convention: key s is visible from t when t - s < W), or plain causal for None."""
    if sliding_window is None:
        return CAUSAL
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    return (sliding_window - 1, 0)


def gqa_groups(num_heads: int, kv_heads: int) -> int:
    """Query heads per key/value head (query head h reads key/value head h // groups, as `repeat_kv`)."""
    if kv_heads < 1 or num_heads % kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of key/value heads ({kv_heads})")
    return num_heads // kv_heads


def _cumulative(opens: torch.Tensor, total: int) -> tuple[torch.Tensor, int]:
    """int32 (S + 1,) cumulative lengths from the packed indices where segments open, and the longest."""
    boundaries = torch.nonzero(opens).flatten()
    end = torch.tensor([total], device=opens.device)
    cu_seqlens = torch.cat([boundaries, end]).to(torch.int32)
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if boundaries.numel() else 0
    return cu_seqlens, longest


def layout_from_documents(
    real: torch.Tensor, starts: torch.Tensor, sliding_window: int | None = None
) -> VarlenLayout:
    """Self-attention layout of (B, L) bool `real` tokens, a segment opening at each `starts` token, at
    each row's first real token and after each run of pads; pads are left out."""
    flat_real = real.reshape(-1)
    positions = torch.nonzero(flat_real).flatten()  # (N,)
    previous_real = F.pad(real[:, :-1], (1, 0), value=False)
    opens = (real & (starts | ~previous_real)).reshape(-1)[positions]
    cu_seqlens, longest = _cumulative(opens, positions.numel())
    return VarlenLayout(
        positions, positions, cu_seqlens, cu_seqlens, longest, longest, window_size_for(sliding_window)
    )


def layout_from_position_ids(
    position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, sliding_window: int | None = None
) -> VarlenLayout:
    """Self-attention layout of a (B, L) batch whose `position_ids` restart at 0 for each document
    (`DataCollatorWithFlattening`); a (B, L) `attention_mask` (1 = real) leaves its pads out."""
    real = (
        torch.ones_like(position_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    )
    return layout_from_documents(real, position_ids == 0, sliding_window)


def _segment_tables(
    positions: torch.Tensor, cu_seqlens: torch.Tensor, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per flat position (`size`): segment id (-1 outside), index within the segment, segment length."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=positions.device), lengths)
    local = torch.arange(positions.numel(), device=positions.device) - cu_seqlens[:-1].long()[segment]
    dense_segment = torch.full((size,), -1, dtype=torch.long, device=positions.device)
    dense_local = torch.zeros(size, dtype=torch.long, device=positions.device)
    dense_segment[positions] = segment
    dense_local[positions] = local
    return dense_segment, dense_local, lengths


def layout_mask(layout: VarlenLayout, batch: int, query_length: int, key_length: int) -> torch.Tensor:
    """Bool (B, 1, Lq, Lk): which keys each query reads under `layout` (what the kernel computes)."""
    seg_q, local_q, lengths_q = _segment_tables(layout.query_positions, layout.cu_seq_q, batch * query_length)
    seg_k, local_k, lengths_k = _segment_tables(layout.key_positions, layout.cu_seq_k, batch * key_length)
    seg_q, local_q = seg_q.view(batch, query_length, 1), local_q.view(batch, query_length, 1)
    seg_k, local_k = seg_k.view(batch, 1, key_length), local_k.view(batch, 1, key_length)
    # Bottom-right alignment: query i of a segment sits at key i + (keys - queries) of it.
    offset = (lengths_k - lengths_q)[seg_q.clamp(min=0)]
    aligned = local_q + offset
    allowed = (seg_q == seg_k) & (seg_q >= 0)
    left, right = layout.window_size
    if right >= 0:
        allowed = allowed & (local_k <= aligned + right)
    if left >= 0:
        allowed = allowed & (local_k >= aligned - left)
    return allowed[:, None]


def _derived_segments(allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Lq) and (B, Lk) segment ids (-1: left out) read off a (B, Lq, Lk) mask, assuming it is
    causal within contiguous segments; `layout_mask` checks that afterwards."""
    batch, query_length, key_length = allowed.shape
    offset = key_length - query_length
    real_q = allowed.any(-1)  # (B, Lq)
    queries = torch.arange(1, query_length, device=allowed.device)
    # A query continues the segment of the query before it iff it reads that query's aligned key.
    continues = F.pad(allowed[:, queries, queries - 1 + offset] & real_q[:, :-1], (1, 0), value=False)
    opens = real_q & ~continues
    segment_q = torch.cumsum(opens.reshape(-1).long(), 0).view(batch, query_length) - 1
    segment_q = torch.where(real_q, segment_q, -1)
    # New keys belong to their aligned query's segment; cached keys (before the first query) to the
    # row's first segment when some query reads them.
    segment_k = torch.full((batch, key_length), -1, dtype=torch.long, device=allowed.device)
    aligned = torch.arange(query_length, device=allowed.device)
    own = allowed[:, aligned, aligned + offset]
    segment_k[:, offset:] = torch.where(own, segment_q, -1)
    if offset:
        first = torch.where(real_q, segment_q, torch.iinfo(torch.long).max).min(-1).values  # (B,)
        read = allowed[:, :, :offset].any(1)
        segment_k[:, :offset] = torch.where(read & (first[:, None] >= 0), first[:, None], -1)
    return segment_q, segment_k


def layout_from_mask(mask: torch.Tensor) -> VarlenLayout | None:
    """The layout a (B, 1, Lq, Lk) bool mask stands for (Lq <= Lk), window included, or None when it is
    not causal within contiguous segments of positions (then only a masked kernel computes it)."""
    batch, _, query_length, key_length = mask.shape
    if mask.shape[1] != 1 or query_length > key_length:
        return None
    allowed = mask[:, 0]
    segment_q, segment_k = _derived_segments(allowed)
    flat_q, flat_k = segment_q.reshape(-1), segment_k.reshape(-1)
    query_positions = torch.nonzero(flat_q >= 0).flatten()
    key_positions = torch.nonzero(flat_k >= 0).flatten()
    if query_positions.numel() == 0:
        return None
    num_segments = int(flat_q.max()) + 1
    count_q = torch.bincount(flat_q[query_positions], minlength=num_segments)
    count_k = torch.bincount(flat_k[key_positions], minlength=num_segments)
    if bool((torch.diff(flat_k[key_positions]) < 0).any()) or bool((count_k < count_q).any()):
        return None
    zero = count_q.new_zeros(1)
    cu_q = torch.cat([zero, count_q.cumsum(0)]).to(torch.int32)
    cu_k = torch.cat([zero, count_k.cumsum(0)]).to(torch.int32)
    layout = VarlenLayout(query_positions, key_positions, cu_q, cu_k, int(count_q.max()), int(count_k.max()))
    # A window shows as queries reading fewer keys than causality allows: W = the most any reads.
    reads = allowed.sum(-1).reshape(-1)[query_positions]
    causal_reads = layout_mask(layout, batch, query_length, key_length).sum(-1).reshape(-1)[query_positions]
    if bool((reads < causal_reads).any()):
        layout.window_size = window_size_for(int(reads.max()))
    return layout


def pack(states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(B, X, L, K) -> (N, X, K): the rows at flat (B·L) `positions`."""
    batch, heads, length, head_dim = states.shape
    return states.transpose(1, 2).reshape(batch * length, heads, head_dim)[positions]


def unpack(packed: torch.Tensor, positions: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """(N, X, K) -> (B, L, X, K), zeros where no packed token lands (pads, left-out queries)."""
    output = packed.new_zeros(batch * length, *packed.shape[1:])
    output[positions] = packed
    return output.view(batch, length, *packed.shape[1:])


def varlen_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    **unused: Any,
) -> torch.Tensor:
    """`varlen_attn`'s contract in plain PyTorch, one segment at a time with a masked sdpa on any device:
    (Nq, H, K) query, (Nk, G, K) key/value -> (Nq, H, K). The kernel's stand-in in CPU tests."""
    groups = gqa_groups(query.shape[1], key.shape[1])
    if groups > 1 and not enable_gqa:
        raise ValueError("key/value heads differ from query heads: pass enable_gqa=True")
    output = query.new_zeros(query.shape)
    bounds_q, bounds_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    left, right = window_size
    for segment in range(len(bounds_q) - 1):
        q_start, q_end = bounds_q[segment], bounds_q[segment + 1]
        k_start, k_end = bounds_k[segment], bounds_k[segment + 1]
        if q_end == q_start or k_end == k_start:
            continue
        aligned = (
            torch.arange(q_end - q_start, device=query.device)[:, None]
            + (k_end - k_start)
            - (q_end - q_start)
        )
        keys = torch.arange(k_end - k_start, device=query.device)[None, :]
        allowed = torch.ones_like(aligned & keys, dtype=torch.bool)
        if right >= 0:
            allowed = allowed & (keys <= aligned + right)
        if left >= 0:
            allowed = allowed & (keys >= aligned - left)
        # (1, H, n, K) per segment
        q = query[q_start:q_end].transpose(0, 1).unsqueeze(0)
        k = key[k_start:k_end].transpose(0, 1).unsqueeze(0).repeat_interleave(groups, dim=1)
        v = value[k_start:k_end].transpose(0, 1).unsqueeze(0).repeat_interleave(groups, dim=1)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        # Queries that read no key (a window past the segment) give zeros, as the kernel does.
        output[q_start:q_end] = torch.where(allowed.any(-1)[:, None, None], attended[0].transpose(0, 1), 0.0)
    return output


_kernel_override: Callable[..., torch.Tensor] | None = None


@contextmanager
def use_varlen_kernel(kernel: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Run every varlen call of the block on `kernel` (same contract as `varlen_attn`), on any device and
    dtype: `varlen_reference` here makes the whole path run on CPU (tests, `gpu_suite.py --cpu-smoke`)."""
    global _kernel_override
    previous, _kernel_override = _kernel_override, kernel
    try:
        yield
    finally:
        _kernel_override = previous


@functools.cache
def torch_kernel() -> Callable[..., torch.Tensor] | None:
    """torch's `varlen_attn` behind its 2.13 contract, or None where this torch has none. Older releases
    (the device image's 2.11, say) may lack `enable_gqa` (key/value heads are then repeated here),
    `scale` (folded into the queries) or `window_size` (then only causal layouts run: the wrapper's
    `windows` is False and a windowed layout falls back)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    accepted = inspect.signature(varlen_attn).parameters

    def kernel(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        *,
        scale=None,
        window_size=CAUSAL,
        enable_gqa=False,
    ):
        groups = query.shape[1] // key.shape[1]
        options: dict[str, Any] = {}
        if "scale" in accepted:
            options["scale"] = scale
        elif scale is not None:
            # Without a scale argument the kernel uses 1/sqrt(K): fold the ratio into the queries.
            query = query * (scale * query.shape[-1] ** 0.5)
        if "enable_gqa" in accepted:
            options["enable_gqa"] = enable_gqa
        elif groups > 1:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        if "window_size" in accepted:
            options["window_size"] = tuple(window_size)
        else:
            options["is_causal"] = tuple(window_size) == CAUSAL
        return varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **options)

    kernel.windows = "window_size" in accepted
    return kernel


def kernel_for(query: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """The varlen kernel for `query`: the override, else torch's `varlen_attn` on CUDA in fp16/bf16 (the
    only place its flash kernel runs), else None."""
    if _kernel_override is not None:
        return _kernel_override
    if not query.is_cuda or query.dtype not in KERNEL_DTYPES:
        return None
    return torch_kernel()


def warn_fallback(reason: str) -> None:
    """One warning per distinct reason: this call runs on sdpa instead of the varlen kernel."""
    logger.warning_once(f"attn_implementation={VARLEN_ATTENTION!r} falls back to sdpa here: {reason}.")


def _allowed_keys(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """A bool view of a boolean or additive (0 / very negative) float mask; None for a float mask that
    carries any other value (a bias the kernel cannot add)."""
    if attention_mask.dtype == torch.bool:
        return attention_mask
    allowed = attention_mask == 0
    if bool((attention_mask[~allowed] > torch.finfo(attention_mask.dtype).min / 2).any()):
        return None
    return allowed


def _packed_position_ids(position_ids: torch.Tensor | None, shape: tuple[int, int]) -> bool:
    """Whether (B, L) `position_ids` of this shape count up by one and only restart at 0 (documents
    packed in a row, as `DataCollatorWithFlattening` writes them), with at least one restart."""
    if position_ids is None or tuple(position_ids.shape) != shape or shape[1] < 2:
        return False
    later = position_ids[:, 1:]
    steps = (later - position_ids[:, :-1] == 1) | (later == 0)
    return bool(steps.all()) and bool((later == 0).any())


def _unmasked_layout(
    batch: int, query_length: int, key_length: int, position_ids: torch.Tensor | None, device: torch.device
) -> tuple[VarlenLayout | None, str | None]:
    """No mask means what sdpa reads from it: causal rows (a row of packed documents when the position
    ids say so), or one query reading every cached key."""
    if query_length == key_length:
        if _packed_position_ids(position_ids, (batch, query_length)):
            return layout_from_position_ids(position_ids), None
        real = torch.ones(batch, key_length, dtype=torch.bool, device=device)
        return layout_from_documents(real, torch.zeros_like(real)), None
    if query_length == 1:
        queries = torch.arange(batch, device=device)
        keys = torch.arange(batch * key_length, device=device)
        cu_q = torch.arange(batch + 1, device=device, dtype=torch.int32)
        return VarlenLayout(queries, keys, cu_q, cu_q * key_length, 1, key_length), None
    # sdpa's causal flag would align these queries top-left; callers always pass a mask here.
    return None, "several queries over cached keys without a mask"


def layout_for(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> tuple[VarlenLayout | None, str | None]:
    """The layout of one attention call, or None and the reason the kernel cannot run it."""
    batch, query_length, key_length = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask is None:
        return _unmasked_layout(batch, query_length, key_length, position_ids, query.device)
    # As sdpa does: a mask may be built for more key positions than this call has.
    allowed = _allowed_keys(attention_mask[..., :key_length])
    if allowed is None:
        return None, "the float mask carries a bias beyond 0 / -inf"
    if allowed.dim() != 4 or allowed.shape[1] != 1:
        return None, f"a mask of shape {tuple(allowed.shape)} (per head, or not 4-D)"
    allowed = allowed.expand(batch, 1, query_length, key_length)
    layout = layout_from_mask(allowed)
    if layout is None or not torch.equal(layout_mask(layout, batch, query_length, key_length), allowed):
        return None, "the mask is not causal within contiguous segments (with at most a position window)"
    return layout, None


def attend_packed(
    kernel: Callable[..., torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: VarlenLayout,
    scale: float | None = None,
) -> torch.Tensor:
    """(B, H, Lq, K) query, (B, G, Lk, K) key/value -> (B, Lq, H, K): `layout`'s tokens packed, `kernel`
    run over its segments, the outputs put back (zeros at the positions the layout leaves out)."""
    batch, num_heads, query_length, _ = query.shape
    packed = kernel(
        pack(query, layout.query_positions),
        pack(key, layout.key_positions),
        pack(value, layout.key_positions),
        layout.cu_seq_q,
        layout.cu_seq_k,
        layout.max_q,
        layout.max_k,
        scale=scale,
        window_size=layout.window_size,
        enable_gqa=gqa_groups(num_heads, key.shape[1]) > 1,
    )  # (Nq, H, K)
    return unpack(packed.to(query.dtype), layout.query_positions, batch, query_length)


def varlen_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (B, H, Lq, K) query, (B, G, Lk, K) key/value, the mask
    the caller built -> ((B, Lq, H, K) output, None), on the varlen kernel where the mask maps, else sdpa."""
    kernel = kernel_for(query)
    reason = None
    if not getattr(module, "is_causal", True):
        reason = "the module is not causal"
    elif kernel is None:
        reason = f"varlen_attn runs on CUDA in fp16/bf16 only (got {query.device.type}, {query.dtype})"
        if query.is_cuda and query.dtype in KERNEL_DTYPES:
            reason = f"this torch ({torch.__version__}) has no torch.nn.attention.varlen"
    elif dropout > 0:
        reason = "varlen_attn has no attention dropout"
    else:
        layout, reason = layout_for(query, key, attention_mask, kwargs.get("position_ids"))
        if layout is not None and layout.window_size != CAUSAL and not getattr(kernel, "windows", True):
            reason = f"this torch's varlen_attn ({torch.__version__}) takes no window_size"
    if reason is not None:
        warn_fallback(reason)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return attend_packed(kernel, query, key, value, layout, scaling), None


# The first import registers: a checkpoint's remote-code copy of this module, loaded later in the same
# process (trust_remote_code), finds the name taken and leaves it, so the registry keeps pointing at the
# module that was imported first (whose kernel lookup tests and users may patch).
if VARLEN_ATTENTION not in ALL_ATTENTION_FUNCTIONS:
    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
if VARLEN_ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS:
    AttentionMaskInterface.register(VARLEN_ATTENTION, sdpa_mask)
