"""Chunks of tokens pooled into concepts, and concepts read back by tokens under the causality rule.

Legend: B batch, L tokens, C concepts (most chunks in any row), D width.

Conventions:
- `mask` (B, L) bool is True on real tokens; `boundaries` (B, L) bool is True where a token opens a chunk.
  Every document start is a boundary; boundaries on pads are ignored.
- Chunk m of a row spans its m-th opening token up to (not including) the next one; pads inside that span
  belong to no chunk. Real tokens before a row's first boundary (possible only when a row continues
  cached tokens) belong to no chunk here: the caller owns that open chunk.
- Concepts are left-aligned per row: `concept_states` (B, C, D) with `concept_mask` (B, C); slots past a
  row's chunk count are zeros.

Pooling methods (`method`):
- "first": the state of the chunk's opening token.
- "sum" / "mean": sum / mean over the chunk's real tokens.
- "hops:N" (LSLM eq. 3, N >= 0): the sum of the chunk's last N + 1 real tokens (all of them if the chunk is
  shorter). LSLM marks segment ends (z_t = 1) where we mark openings (b_{t+1} = z_t); unrolling eq. 3 at a
  segment end t gives H^N_t = h_t + h_{t-1} + ... + h_{t-N}, stopping at the segment's first token, so
  "hops:0" is the chunk's last token.

Causality rule: a token at position t may read a concept only if every token pooled into it sits at a
position <= t. With "first", concept m is readable from its opening token on, so a token reads the chunk it
is in. With "sum", "mean" and "hops:N" the concept depends on where the chunk ends, so it is readable only
once the chunk has closed: a token reads the previous chunk, and only if that chunk lies in the same
document; the first chunk of each document reads nothing (index -1: a null concept or zeros).

Slots attending to slots (`slot_attention_mask`: ConceptMoE's and DLCM's concept layers, LSLM's segment
encoder): a slot reads the earlier-or-equal valid slots of its row that hold its own document, and for a
sliding layer only those within the window by RoPE position.
"""

from __future__ import annotations

import torch

POOLING_METHODS = ("first", "sum", "mean", "hops:N")


def parse_pooling_method(method: str) -> tuple[str, int]:
    """Split a pooling method into (kind, hops); hops is 0 except for "hops:N"."""
    if method in ("first", "sum", "mean"):
        return method, 0
    if isinstance(method, str) and method.startswith("hops:"):
        hops_text = method[len("hops:") :]
        if hops_text.isdigit():
            return "hops", int(hops_text)
    raise ValueError(f"method must be one of {POOLING_METHODS} (N a non-negative integer), got {method!r}")


def _check_token_layout(boundaries: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Validate (B, L) boundaries and mask; return boundaries restricted to real tokens."""
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be a (B, L) bool tensor, got shape {tuple(mask.shape)} dtype {mask.dtype}"
        )
    if boundaries.shape != mask.shape:
        raise ValueError(
            f"boundaries must have the shape of mask {tuple(mask.shape)}, got {tuple(boundaries.shape)}"
        )
    return boundaries.bool() & mask


def chunk_index(boundaries: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Long (B, L): index of the chunk containing each token within its row; -1 on pads.

    Real tokens before the row's first boundary (a continued row) also get -1.
    """
    opens = _check_token_layout(boundaries, mask)
    index = torch.cumsum(opens.long(), dim=1) - 1
    return index.masked_fill(~mask, -1)


def concept_counts(boundaries: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Long (B,): number of chunks (concepts) in each row."""
    return _check_token_layout(boundaries, mask).sum(dim=1)


def concept_mask_from_counts(counts: torch.Tensor, num_concepts: int | None = None) -> torch.Tensor:
    """Bool (B, C): True on the first `counts[b]` slots of each row; C defaults to the largest count."""
    if num_concepts is None:
        num_concepts = int(counts.max()) if counts.numel() else 0
    slots = torch.arange(num_concepts, device=counts.device)
    return slots.unsqueeze(0) < counts.unsqueeze(1)


def chunk_lengths(boundaries: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Long (B, C): number of real tokens in each chunk (0 on empty slots)."""
    index = chunk_index(boundaries, mask)
    num_concepts = int(index.max()) + 1 if index.numel() else 0
    return _scatter_to_slots(index, num_concepts, mask.long().unsqueeze(-1)).squeeze(-1)


def _scatter_to_slots(index: torch.Tensor, num_concepts: int, values: torch.Tensor) -> torch.Tensor:
    """Sum (B, L, D) `values` into (B, C, D) slots by `index`; tokens with index -1 are dropped."""
    batch_size, length, width = values.shape
    # Each row gets one extra slot that swallows dropped tokens, discarded below.
    slots = torch.where(index >= 0, index, num_concepts)
    row_offset = torch.arange(batch_size, device=index.device).unsqueeze(1) * (num_concepts + 1)
    flat_slots = (slots + row_offset).reshape(-1)
    pooled = values.new_zeros(batch_size * (num_concepts + 1), width)
    pooled = pooled.index_add(0, flat_slots, values.reshape(batch_size * length, width))
    # (B, C, D)
    return pooled.view(batch_size, num_concepts + 1, width)[:, :num_concepts]


def _opening_positions(opens: torch.Tensor, num_concepts: int) -> torch.Tensor:
    """Long (B, C): position of each chunk's opening token (0 on empty slots)."""
    # A stable sort puts the opening positions first, in order.
    order = torch.argsort((~opens).to(torch.int8), dim=1, stable=True)[:, :num_concepts]
    slot_used = torch.gather(opens, 1, order)
    return order.masked_fill(~slot_used, 0)


def _hops_index(
    index: torch.Tensor, opens: torch.Tensor, mask: torch.Tensor, num_concepts: int, hops: int
) -> torch.Tensor:
    """Chunk index kept only on each chunk's last `hops + 1` real tokens (-1 elsewhere)."""
    real_so_far = torch.cumsum(mask.long(), dim=1)
    lengths = _scatter_to_slots(index, num_concepts, mask.long().unsqueeze(-1)).squeeze(-1)
    opening_count = torch.gather(real_so_far, 1, _opening_positions(opens, num_concepts))
    token_slot = index.clamp(min=0)
    # Rank of the token among its chunk's real tokens (0 at the opening), then counted from the end.
    rank = real_so_far - torch.gather(opening_count, 1, token_slot)
    from_end = torch.gather(lengths, 1, token_slot) - 1 - rank
    return index.masked_fill(from_end > hops, -1)


def pool_concepts(
    token_states: torch.Tensor,
    boundaries: torch.Tensor,
    mask: torch.Tensor,
    method: str,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool token states into left-aligned concepts.

    Args:
        token_states: (B, L, D).
        boundaries: (B, L) bool, True where a token opens a chunk.
        mask: (B, L) bool, real tokens.
        method: "first", "sum", "mean" or "hops:N".
        weights: optional (B, L) weight of each token in its chunk (default 1; "first" takes none):
            sums are weighted and "mean" divides by the chunk's total weight, as dynamic pooling's
            normalised matrix does (LSLM Figure 3; `lslm_estimators.straight_through_pool_weights`
            gives weights of value 1 whose gradient reaches the boundary decisions).

    Returns:
        concept_states (B, C, D), zeros on empty slots, and concept_mask (B, C) bool.
        Sums accumulate in float32 for half-precision inputs.
    """
    kind, hops = parse_pooling_method(method)
    if token_states.dim() != 3 or token_states.shape[:2] != mask.shape:
        raise ValueError(
            f"token_states must be (B, L, D) with (B, L) = {tuple(mask.shape)}, "
            f"got {tuple(token_states.shape)}"
        )
    index = chunk_index(boundaries, mask)
    counts = (index.max(dim=1).values + 1) if index.numel() else index.new_zeros(mask.shape[0])
    num_concepts = int(counts.max()) if counts.numel() else 0
    concept_mask = concept_mask_from_counts(counts, num_concepts)
    if kind == "first":
        if weights is not None:
            raise ValueError("pooling 'first' takes no token weights")
        opening = _opening_positions(boundaries.bool() & mask, num_concepts)
        width = token_states.shape[-1]
        concept_states = torch.gather(token_states, 1, opening.unsqueeze(-1).expand(-1, -1, width))
        # Empty slots point at position 0, which may be a pad: blank them without arithmetic.
        return torch.where(concept_mask.unsqueeze(-1), concept_states, 0.0), concept_mask
    if kind == "hops":
        index = _hops_index(index, boundaries.bool() & mask, mask, num_concepts, hops)
    accumulate = (
        torch.float32 if token_states.dtype in (torch.float16, torch.bfloat16) else token_states.dtype
    )
    counted = mask.to(accumulate) if weights is None else weights.to(accumulate) * mask
    values = token_states.to(accumulate)
    if weights is not None:
        values = values * counted.unsqueeze(-1)
    concept_states = _scatter_to_slots(index, num_concepts, values)
    if kind == "mean":
        lengths = _scatter_to_slots(index, num_concepts, counted.unsqueeze(-1))
        concept_states = concept_states / lengths.clamp(min=1)
    return concept_states.to(token_states.dtype), concept_mask


def pool_open_chunk(token_states: torch.Tensor, counts: torch.Tensor, method: str) -> torch.Tensor:
    """Pool one chunk per row held left-aligned: (B, W, D) states of which row b's first `counts[b]` are
    real -> (B, 1, D), as `pool_concepts` pools that chunk (zeros for an empty row; "first" is the
    opening state). Used when a decoding step closes a chunk: no chunk index to build, no scatter."""
    kind, hops = parse_pooling_method(method)
    if kind == "first":
        return token_states[:, :1] * (counts > 0)[:, None, None].to(token_states.dtype)
    order = torch.arange(token_states.shape[1], device=counts.device)
    keep = order[None, :] < counts[:, None]
    if kind == "hops":
        keep = keep & (order[None, :] >= (counts - hops - 1)[:, None])
    accumulate = (
        torch.float32 if token_states.dtype in (torch.float16, torch.bfloat16) else token_states.dtype
    )
    pooled = torch.where(keep[..., None], token_states.to(accumulate), 0.0).sum(dim=1, keepdim=True)
    if kind == "mean":
        pooled = pooled / counts.clamp(min=1)[:, None, None].to(accumulate)
    return pooled.to(token_states.dtype)


def readable_concept_index(
    boundaries: torch.Tensor, mask: torch.Tensor, starts: torch.Tensor, method: str
) -> torch.Tensor:
    """Long (B, L): the latest concept each token may read under the causality rule; -1 for none.

    "first" reads the chunk containing the token; "sum", "mean" and "hops:N" read the previous chunk when
    it lies in the token's document. Pads get -1. `starts` (B, L) bool marks document starts
    (`packing.document_starts`), each of which must be a boundary.
    """
    kind, _ = parse_pooling_method(method)
    index = chunk_index(boundaries, mask)
    if starts.shape != mask.shape:
        raise ValueError(f"starts must have the shape of mask {tuple(mask.shape)}, got {tuple(starts.shape)}")
    starts = starts.bool() & mask
    if bool((starts & ~boundaries.bool()).any()):
        raise ValueError("starts must all be boundaries: every document start opens a chunk")
    if kind == "first":
        return index
    # The first chunk of the token's document; -1 for a continued row that has not met a start yet.
    document_first_chunk = torch.cummax(torch.where(starts, index, -1), dim=1).values
    previous = index - 1
    readable = (previous >= 0) & (previous >= document_first_chunk)
    return torch.where(readable & mask, previous, -1)


def gather_concepts_to_tokens(
    concept_states: torch.Tensor, index: torch.Tensor, null_state: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, L, D): concept `index[b, t]` of row b for each token; `null_state` (D) or zeros where it is -1."""
    batch_size, num_concepts, width = concept_states.shape
    if index.dim() != 2 or index.shape[0] != batch_size:
        raise ValueError(f"index must be (B, L) with B = {batch_size}, got shape {tuple(index.shape)}")
    if index.numel() and (int(index.max()) >= num_concepts or int(index.min()) < -1):
        raise ValueError(
            f"index must lie in [-1, {num_concepts}), got values {int(index.min())}..{int(index.max())}"
        )
    if null_state is None:
        null_slot = concept_states.new_zeros(batch_size, 1, width)
    else:
        if null_state.shape != (width,):
            raise ValueError(f"null_state must have shape ({width},), got {tuple(null_state.shape)}")
        null_slot = null_state.to(concept_states.dtype).view(1, 1, width).expand(batch_size, 1, width)
    # (B, 1 + C, D): slot 0 holds the null concept, so index -1 lands there.
    table = torch.cat([null_slot, concept_states], dim=1)
    # (B, L, D)
    return torch.gather(table, 1, (index + 1).unsqueeze(-1).expand(-1, -1, width))


def slot_attention_mask(
    valid: torch.Tensor,
    documents: torch.Tensor,
    positions: torch.Tensor,
    num_queries: int,
    sliding_window: int | None,
) -> torch.Tensor:
    """Bool (B, 1, Cq, Ck) over all slots (B, Ck); the queries are the last `num_queries` slots.

    A slot attends to the earlier-or-equal slots of its row that are `valid` and hold its own document
    (and, when `sliding_window` is set, lie within it by `positions`). A query slot always sees itself,
    so no softmax row is empty (invalid slots produce unused values).
    """
    num_keys = valid.shape[1]
    key_slots = torch.arange(num_keys, device=valid.device)
    query_slots = key_slots[num_keys - num_queries :]
    query_documents = documents[:, num_keys - num_queries :]
    allowed = valid[:, None, :] & (documents[:, None, :] == query_documents[:, :, None])  # (B, Cq, Ck)
    allowed = allowed & (key_slots[None, None, :] <= query_slots[None, :, None])
    if sliding_window is not None:
        query_positions = positions[:, num_keys - num_queries :]
        allowed = allowed & (query_positions[:, :, None] - positions[:, None, :] < sliding_window)
    allowed = allowed | (key_slots[None, None, :] == query_slots[None, :, None])
    return allowed[:, None]
