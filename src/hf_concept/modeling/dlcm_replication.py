"""DLCM's cross-attention from tokens to concepts by concept replication (DLCM §4.1), in two equal forms.

Legend: B batch, L tokens, N concept slots, H query heads, G key/value heads (H a multiple of G), K head dim.

Semantics. Each position s carries the key and value of concept slot `index[b, s]`; token t attends
causally over the positions s <= t of its own document (real tokens only) that carry a concept, so a
concept's weight is proportional to how many such positions carried it.

Slots. `concept_k` / `concept_v` are (B, G, N, K) and `index` (B, L) long in [-1, N). Index -1 means the
position carries nothing (pads, and tokens with no readable concept when the family wants nothing there).
A family with a learned null concept puts it at slot 0, concepts after it, and passes
`readable_concept_index(...) + 1`, so that tokens with no readable concept carry the null concept.
Causality is the caller's `index` (see pooling.readable_concept_index); both forms add no lookahead.
A query that sees no concept-carrying position gets zeros.

Forms.
- Replicated (training): `replicate_concept_kv` gathers K/V per position (repeat_interleave semantics),
  then `replicated_concept_attention` runs SDPA with a boolean mask (causal & same document & real).
- Counted (decoding): one K/V per slot plus counts c_n(t) = #{s <= t in t's document, real: index[s] = n};
  scores get + log c_n(t) (-inf where 0) and the softmax runs over slots. `concept_counts` builds all the
  counts of a sequence at once (cumulative one-hot); `update_concept_counts` adds one new token.
GQA: query head h reads key/value head h // (H / G), as in transformers' `repeat_kv`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .varlen import VARLEN_ATTENTION, attend_packed, kernel_for, layout_from_documents, warn_fallback


def _expand_heads(concept_states: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, H, N, K) from (B, G, N, K): each key/value head serves H / G consecutive query heads."""
    kv_heads = concept_states.shape[1]
    if num_heads % kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of key/value heads ({kv_heads})")
    if kv_heads == num_heads:
        return concept_states
    return concept_states.repeat_interleave(num_heads // kv_heads, dim=1)


def replicate_concept_kv(
    concept_k: torch.Tensor, concept_v: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, G, L, K) keys and values per position: slot `index[b, s]`, zeros where it is -1."""
    batch_size, kv_heads, num_slots, _ = concept_k.shape
    if concept_v.shape[:3] != concept_k.shape[:3]:
        raise ValueError(f"concept_v must match concept_k on (B, G, N), got {tuple(concept_v.shape)}")
    if index.dim() != 2 or index.shape[0] != batch_size:
        raise ValueError(f"index must be (B, L) with B = {batch_size}, got shape {tuple(index.shape)}")
    if index.numel() and (int(index.max()) >= num_slots or int(index.min()) < -1):
        raise ValueError(
            f"index must lie in [-1, {num_slots}), got values {int(index.min())}..{int(index.max())}"
        )
    carries = (index >= 0).view(batch_size, 1, -1, 1)
    slots = index.clamp(min=0).view(batch_size, 1, -1, 1)
    replicated = []
    for concept_states in (concept_k, concept_v):
        width = concept_states.shape[-1]
        # (B, G, L, K)
        gathered = torch.gather(concept_states, 2, slots.expand(-1, kv_heads, -1, width))
        replicated.append(torch.where(carries, gathered, 0.0))
    return replicated[0], replicated[1]


def _document_start_positions(starts: torch.Tensor) -> torch.Tensor:
    """Long (B, L): position of the latest document start at or before each token (-1 if none)."""
    positions = torch.arange(starts.shape[1], device=starts.device).expand_as(starts)
    return torch.cummax(torch.where(starts, positions, -1), dim=1).values


def replication_attention_mask(index: torch.Tensor, mask: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Bool (B, 1, L, L): query t sees key s iff s <= t, same document, both real, and s carries a concept."""
    length = mask.shape[1]
    document = _document_start_positions(starts & mask)
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    same_document = document.unsqueeze(2) == document.unsqueeze(1)
    key_carries = (mask & (index >= 0)).unsqueeze(1)
    allowed = causal & same_document & key_carries & mask.unsqueeze(2)
    # (B, 1, L, L)
    return allowed.unsqueeze(1)


def replicated_concept_attention(
    query_states: torch.Tensor,
    concept_k: torch.Tensor,
    concept_v: torch.Tensor,
    index: torch.Tensor,
    mask: torch.Tensor,
    starts: torch.Tensor,
    scale: float | None = None,
    plain_causal: bool = False,
) -> torch.Tensor:
    """(B, H, L, K): concept replication + causal SDPA. `query_states` (B, H, L, K), `starts` (B, L) bool.

    `plain_causal=True` is the caller's promise that the mask is exactly causal (every token real and
    carrying a concept, one document per row): SDPA then runs its causal kernel with no mask, which skips
    the masked half instead of reading an L x L boolean mask.
    """
    num_heads = query_states.shape[1]
    key_states, value_states = replicate_concept_kv(
        _expand_heads(concept_k, num_heads), _expand_heads(concept_v, num_heads), index
    )
    if plain_causal:
        return F.scaled_dot_product_attention(
            query_states, key_states, value_states, is_causal=True, scale=scale
        )
    allowed = replication_attention_mask(index, mask, starts)
    sees_something = allowed.any(dim=-1, keepdim=True)
    # A row that sees nothing would softmax over -inf only (NaN): let it see everything, then zero it.
    safe_mask = allowed | ~sees_something
    attended = F.scaled_dot_product_attention(
        query_states, key_states, value_states, attn_mask=safe_mask, scale=scale
    )
    return attended.masked_fill(~sees_something, 0.0)


def concept_counts(
    index: torch.Tensor,
    mask: torch.Tensor,
    starts: torch.Tensor,
    num_slots: int,
    initial_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Long (B, L, N): for each query t, how many positions s <= t of its document carry each slot.

    `initial_counts` (B, N) are the counts a continued row brings from its cache; they apply to the
    tokens before the row's first document start in this call. Pads get zero counts.
    """
    carries = mask & (index >= 0)
    one_hot = F.one_hot(index.clamp(min=0), num_slots) * carries.unsqueeze(-1)
    running = torch.cumsum(one_hot, dim=1)
    if initial_counts is not None:
        running = running + initial_counts.unsqueeze(1)
    document_start = _document_start_positions(starts & mask)
    # Counts up to just before the token's document start belong to earlier documents: take them off.
    before_start = (document_start - 1).clamp(min=0).unsqueeze(-1).expand(-1, -1, num_slots)
    earlier = torch.gather(running, 1, before_start)
    earlier = torch.where((document_start > 0).unsqueeze(-1), earlier, 0)
    if initial_counts is not None:
        # A start at position 0 drops what the cache brought; with no start yet, the cache's counts stay.
        earlier = earlier + torch.where((document_start == 0).unsqueeze(-1), initial_counts.unsqueeze(1), 0)
    return (running - earlier) * mask.unsqueeze(-1)


def log_count_bias(
    counts: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L, N) log(count) scores bias in `dtype` (−inf where a slot is not readable) and (B, L) bool: does
    the query see any slot. Rows that see nothing get a bias of 0 (their output is zeroed instead)."""
    sees = (counts > 0).any(dim=-1)  # (B, L)
    bias = torch.log(counts.to(dtype))
    if not bool(sees.all()):
        bias = bias.masked_fill(~sees.unsqueeze(-1), 0.0)
    return bias, sees


def run_count_bias(
    index: torch.Tensor,
    mask: torch.Tensor,
    starts: torch.Tensor,
    num_slots: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`log_count_bias(concept_counts(...))` for a fresh call, built from each slot's run of positions: no
    cumulative (B, L, N) one-hot and one log over N run lengths instead of over (B, L, N) counts.

    Precondition (what DLCM's reading gives without a cache): every slot n >= 1 is carried by one
    contiguous run of real tokens of one document; slot 0 (the null concept) by at most one run per
    document. With r(t) the rank of real token t among its row's real tokens, a slot whose run ended at
    or before t in t's document weighs log(run length); the slot t carries weighs log(r(t) − r(first) + 1);
    the null slot weighs log(its positions in t's document up to t); every other slot −inf.
    """
    batch_size, length = index.shape
    carries = mask & (index >= 0)
    rank = torch.cumsum(mask.long(), dim=1)  # (B, L)
    document = torch.cumsum((starts & mask).long(), dim=1)  # (B, L)
    # Non-carriers scatter into a spare slot; slots nobody carries keep first = last = L + 1 (never read).
    slot = torch.where(carries, index, num_slots)
    unseen = torch.full((batch_size, num_slots + 1), length + 1, device=index.device, dtype=torch.long)
    first = unseen.scatter_reduce(1, slot, rank, "amin", include_self=False)[:, :num_slots]
    last = unseen.scatter_reduce(1, slot, rank, "amax", include_self=False)[:, :num_slots]
    first[:, 0] = last[:, 0] = length + 1  # the null slot is filled in below, per document
    run_bias = torch.log((last - first + 1).clamp(min=1).to(dtype))  # (B, N)
    closed = rank.unsqueeze(2) >= last.unsqueeze(1)  # (B, L, N)
    if bool(((starts & mask).sum(dim=1) > 1).any()):
        # Packed rows: a slot of an earlier document is closed for t but not t's to read.
        owner = unseen.scatter_reduce(1, slot, document, "amax", include_self=False)[:, :num_slots]
        closed &= owner.unsqueeze(1) == document.unsqueeze(2)
    bias = torch.where(closed, run_bias.unsqueeze(1), float("-inf"))  # (B, L, N)
    # The null slot: its carriers in t's document up to t.
    nulls = carries & (index == 0)
    so_far = torch.cumsum(nulls.long(), dim=1)
    before = torch.cummax(torch.where(starts & mask, so_far - nulls.long(), 0), dim=1).values
    null_count = (so_far - before).to(dtype)
    bias[..., 0] = torch.where(null_count > 0, null_count.log(), float("-inf"))
    # The slot each token carries, its run so far.
    current = torch.gather(first, 1, index.clamp(min=0))  # (B, L)
    partial = torch.log((rank - current + 1).clamp(min=1).to(dtype))
    rows, positions = torch.nonzero(carries & (index > 0), as_tuple=True)
    bias[rows, positions, index[rows, positions]] = partial[rows, positions]
    sees = (bias > float("-inf")).any(dim=-1) & mask
    if not bool(sees.all()):
        bias = bias.masked_fill(~sees.unsqueeze(-1), 0.0)
    return bias, sees


def update_concept_counts(
    counts: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, starts: torch.Tensor
) -> torch.Tensor:
    """Long (B, N'): the counts after one new token per row (decoding).

    `counts` (B, N) before the token; `index`, `mask`, `starts` (B,) for the token. A document start resets
    the row; a real token carrying slot n adds one to it. N' = max(N, largest index + 1): slots that became
    readable grow the table with zeros.
    """
    num_slots = max(counts.shape[1], int(index.max()) + 1 if index.numel() else 0)
    counts = F.pad(counts, (0, num_slots - counts.shape[1]))
    counts = torch.where(starts.unsqueeze(-1), 0, counts)
    carries = (mask & (index >= 0)).unsqueeze(-1)
    return counts + F.one_hot(index.clamp(min=0), num_slots) * carries


def concept_attention_counted(
    query_states: torch.Tensor,
    concept_k: torch.Tensor,
    concept_v: torch.Tensor,
    counts: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """(B, H, L, K): softmax over slots of q·k_n·scale + log(count_n); `counts` (B, L, N), zeros give 0.

    Why + log(count) equals replication: the c_n positions carrying slot n hold the same key and value,
    so Σ_s e^{q·k_s} v_s / Σ_s e^{q·k_s} = Σ_n c_n e^{q·k_n} v_n / Σ_n c_n e^{q·k_n}, and c_n e^x =
    e^{x + log c_n} (c_n = 0 gives −inf: not readable). SDPA with log(count) as its float mask: the same
    function as the replicated form, N slots per query instead of L positions. `counts`: integer or float.
    """
    if counts.dim() != 3 or counts.shape[2] != concept_k.shape[2]:
        raise ValueError(f"counts must be (B, L, N) with N = {concept_k.shape[2]}, got {tuple(counts.shape)}")
    # The bias in at least float32: a half-precision log would round the weights of long runs.
    bias, sees = log_count_bias(counts, torch.promote_types(query_states.dtype, torch.float32))
    return concept_attention_biased(query_states, concept_k, concept_v, bias, sees, scale=scale)


def concept_attention_biased(
    query_states: torch.Tensor,
    concept_k: torch.Tensor,
    concept_v: torch.Tensor,
    bias: torch.Tensor,
    sees: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """(B, H, L, K): SDPA over the N slots with the (B, L, N) log(count) `bias` as float mask
    (`log_count_bias` or `run_count_bias`); queries that see nothing (`sees` (B, L) False) get zeros."""
    num_heads, head_dim = query_states.shape[1], query_states.shape[-1]
    scale = head_dim**-0.5 if scale is None else scale
    attended = F.scaled_dot_product_attention(
        query_states,
        _expand_heads(concept_k, num_heads),
        _expand_heads(concept_v, num_heads),
        attn_mask=bias.unsqueeze(1).to(query_states.dtype),
        scale=scale,
    )
    # (B, H, L, K)
    return attended.masked_fill(~sees[:, None, :, None], 0.0)


def concept_slot_weights(
    query_states: torch.Tensor,
    concept_k: torch.Tensor,
    bias: torch.Tensor,
    sees: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """(B, H, L, N) attention weights per slot, softmax(q·k·scale + log count) in at least fp32 and cast
    back: the weights of the counted form, and the replicated form's weights summed over the positions
    that carry each slot (c identical keys weigh c·e^{q·k}). `bias`, `sees` as for
    `concept_attention_biased`; rows that see nothing are zero."""
    num_heads, head_dim = query_states.shape[1], query_states.shape[-1]
    scale = head_dim**-0.5 if scale is None else scale
    keys = _expand_heads(concept_k, num_heads)
    dtype = torch.promote_types(query_states.dtype, torch.float32)
    scores = torch.matmul(query_states, keys.transpose(2, 3)).to(dtype) * scale + bias.unsqueeze(1).to(dtype)
    weights = torch.softmax(scores, dim=-1).masked_fill(~sees[:, None, :, None], 0.0)
    return weights.to(query_states.dtype)


# benchmarks/bench_dlcm.py part 1 on the 2-core CPU VM (BENCHMARKS.md, 2026-11-25; B = 1, 8 heads x 64,
# L = 1k-8k): the counted form takes 0.25-0.62x the replicated time at R = 4 and 8 at every length, forward
# and forward+backward; at R = 2 it wins forward+backward up to 4k tokens (0.72-0.98x) and the forward alone
# up to 1k (0.87x), and loses beyond (1.01-1.11x). R between 2 and 3 follows the R = 2 measurements.
CPU_COUNTED_ABOVE_RATIO = 3.0
CPU_COUNTED_MAX_TOKENS = {True: 4096, False: 1024}


# CUDA: the fastest form per (most tokens, fewest tokens per slot, training), first match wins, as
# `benchmarks/gpu_suite.py` measures it on one GPU (its "DLCM forms" table prints these rows). Empty until
# a GPU run fills it; until then CUDA keeps the replicated form, the paper's choice, unmeasured here.
CUDA_MEASURED_FORMS: tuple[tuple[int, float, bool, str], ...] = ()


def preferred_form(device: torch.device, num_tokens: int, num_slots: int, training: bool) -> str:
    """ "replicated" or "counted": the form measured faster for a fresh call of `num_tokens` tokens over
    `num_slots` concept slots on `device`, `training` meaning a backward pass follows. On CPU the measured
    crossover above; on CUDA the first row of `CUDA_MEASURED_FORMS` that covers the call, the replicated
    form (DLCM §4.1, on a varlen kernel where one runs) when none does."""
    if device.type == "cpu":
        if num_tokens >= CPU_COUNTED_ABOVE_RATIO * num_slots:
            return "counted"
        return "counted" if num_tokens <= CPU_COUNTED_MAX_TOKENS[training] else "replicated"
    if device.type == "cuda":
        for max_tokens, min_ratio, row_training, form in CUDA_MEASURED_FORMS:
            if row_training == training and num_tokens <= max_tokens and num_tokens >= min_ratio * num_slots:
                return form
    return "replicated"


def replicated_concept_attention_varlen(
    query_states: torch.Tensor,
    concept_k: torch.Tensor,
    concept_v: torch.Tensor,
    index: torch.Tensor,
    mask: torch.Tensor,
    starts: torch.Tensor,
    scale: float | None = None,
    varlen_kernel=None,
) -> torch.Tensor:
    """(B, H, L, K): the replicated form on a varlen causal kernel (DLCM §4.1): real tokens packed, one
    sequence per document, so padding and packing need no mask.

    Every real token must carry a concept (`index >= 0`, as DLCM's null concept ensures); pads get zeros.
    `varlen_kernel` follows `torch.nn.attention.varlen.varlen_attn`'s contract (`varlen.kernel_for`).
    """
    if bool(((index < 0) & mask).any()):
        raise ValueError("the varlen form needs every real token to carry a concept (index >= 0)")
    key_states, value_states = replicate_concept_kv(concept_k, concept_v, index)  # (B, G, L, K)
    layout = layout_from_documents(mask, starts)
    attended = attend_packed(varlen_kernel, query_states, key_states, value_states, layout, scale)
    return attended.transpose(1, 2)  # (B, H, L, K)


def _flash_attn_kernel(flash_attn_varlen_func):
    """flash-attn's `flash_attn_varlen_func` behind `varlen_attn`'s contract (causal layouts only)."""

    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, 0), **_):
        return flash_attn_varlen_func(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, softmax_scale=scale, causal=True
        )

    return kernel


def cross_varlen_kernel(query_states: torch.Tensor, implementation: str | None):
    """The varlen kernel for the replicated cross-attention, or None for the masked SDPA form: under
    `attn_implementation="hf_concept_varlen"` PyTorch's own (CUDA, fp16/bf16; elsewhere None with a
    one-time warning), otherwise flash-attn's where it can run (CUDA, fp16/bf16, the `gpu` extra)."""
    if implementation == VARLEN_ATTENTION:
        kernel = kernel_for(query_states)
        if kernel is None:
            warn_fallback(
                f"DLCM's replicated cross-attention runs the masked sdpa form on "
                f"{query_states.device.type} in {query_states.dtype}"
            )
        return kernel
    if not query_states.is_cuda or query_states.dtype not in (torch.float16, torch.bfloat16):
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return _flash_attn_kernel(flash_attn_varlen_func)
