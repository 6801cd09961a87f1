"""ConceptMoE's chunk module and the bookkeeping that turns one slice of tokens into new concepts.

Legend: B batch, L tokens (this call), C concepts (new in this call, left-aligned), D token width,
Dk router key width.

Contract:
- `Chunker` gives boundary probabilities (B, L): p_t reads tokens t − 1 and t only (the previous key
  comes from the cache for a continued row); starts have p = 1, pads p = 0. Its cosine projections are
  `boundary_query`/`boundary_key`, names that no LoRA target list for attention matches; checkpoints
  saved before that rename (`chunker.q_proj`/`k_proj`) load through `LEGACY_ROUTER_KEYS`.
- `fixed_boundaries`: every R-th token of each document opens a chunk, counted from the document's
  first token by its position id (p = 1 at openings, 0 elsewhere).
- `emit_concepts` lists the concepts that become *readable* in this slice, in the order they become
  readable, and for each token the new concept it reads (-1: none among the new ones). "first": a chunk
  is readable from its opening token, so each opening in the slice emits one concept. "sum"/"mean": a
  chunk is readable once closed, so each opening closes the chunk before it (possibly the chunk left
  open in the state) and emits it; a token reads the last closed chunk of its own document. The chunk
  still open at the end of the slice goes back into the state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .concept_cache import ConceptState
from .pooling import pool_concepts, readable_concept_index
from .routing import cosine_boundary_probs, linear_boundary_probs

# The router's projections were `q_proj`/`k_proj` until a LoRA for attention by module name
# (`target_modules=["q_proj", "v_proj"]`, PEFT matching a name or a ".name" suffix) turned out to adapt
# the segmentation too. Checkpoint key renames (transformers' `key_mapping` regex -> replacement; plain
# names, since the reverse renaming on save uses each side as the other's replacement).
LEGACY_ROUTER_KEYS = {
    "chunker.q_proj.": "chunker.boundary_query.",
    "chunker.k_proj.": "chunker.boundary_key.",
}


class LegacyRouterKeysMixin:
    """`from_pretrained` of a concept family: also loads checkpoints with the legacy router key names.

    transformers 5 matches checkpoint keys against the model's own (module hooks do not run there) and
    applies the conversion table of a custom class only once registered globally; a `key_mapping`
    added here reaches it from remote code too. A checkpoint loaded this way is saved again with the
    names it had (transformers reverts the renamings a load used), which old and new code both read.
    """

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any):
        key_mapping = {**LEGACY_ROUTER_KEYS, **(kwargs.pop("key_mapping", None) or {})}
        return super().from_pretrained(*args, key_mapping=key_mapping, **kwargs)


class IdentityInitLinear(nn.Linear):
    """A router projection initialised to the identity (`router_init="identity"`)."""


class Chunker(nn.Module):
    """Router: cosine (boundary_query, boundary_key: D -> D), linear (score: D -> 1) or rule (DLCM §8.1:
    the cosine of the token states themselves, no parameters)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.kind = config.router
        width = config.hidden_size
        if self.kind == "cosine":
            init_kind = getattr(config, "router_init", "random")
            linear_class = IdentityInitLinear if init_kind == "identity" else nn.Linear
            self.boundary_query = linear_class(width, width, bias=False)
            self.boundary_key = linear_class(width, width, bias=False)
        elif self.kind == "linear":
            self.score = nn.Linear(width, 1, bias=True)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        # torch's `load_state_dict` (Trainer's resume, PEFT's `modules_to_save` copies): legacy names too.
        for legacy, name in (("q_proj.", "boundary_query."), ("k_proj.", "boundary_key.")):
            for key in [key for key in state_dict if key.startswith(prefix + legacy)]:
                state_dict[prefix + name + key.removeprefix(prefix + legacy)] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(
        self,
        token_states: torch.Tensor,
        starts: torch.Tensor,
        mask: torch.Tensor,
        past_keys: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, L) float32 probabilities and the (B, L, Dk) router keys (None for the linear router)."""
        if self.kind == "rule":
            return cosine_boundary_probs(
                token_states, token_states, starts, mask, past_keys=past_keys
            ), token_states
        if self.kind == "cosine":
            queries, keys = self.boundary_query(token_states), self.boundary_key(token_states)
            return cosine_boundary_probs(queries, keys, starts, mask, past_keys=past_keys), keys
        logits = self.score(token_states).squeeze(-1)  # (B, L)
        return linear_boundary_probs(logits, starts, mask), None


def fixed_boundaries(
    position_ids: torch.Tensor, starts: torch.Tensor, mask: torch.Tensor, ratio: int
) -> torch.Tensor:
    """(B, L) bool: real tokens whose position in their document is a multiple of `ratio`, and starts."""
    opens = (position_ids.expand_as(mask) % ratio == 0) | starts
    return opens & mask


def gather_at_openings(
    opens: torch.Tensor, num_slots: int, *values: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Left-aligned (B, C) slot mask and, per (B, L, ...) tensor, its (B, C, ...) values at the openings."""
    # A stable sort puts each row's opening positions first, in order.
    order = torch.argsort((~opens).to(torch.int8), dim=1, stable=True)[:, :num_slots]  # (B, C)
    valid = torch.gather(opens, 1, order)
    gathered = []
    for tensor in values:
        index = order.view(*order.shape, *([1] * (tensor.dim() - 2))).expand(-1, -1, *tensor.shape[2:])
        picked = torch.gather(tensor, 1, index)
        slot_valid = valid.view(*valid.shape, *([1] * (tensor.dim() - 2)))
        gathered.append(torch.where(slot_valid, picked, torch.zeros((), dtype=picked.dtype)))
    return valid, gathered


@dataclass
class EmittedConcepts:
    """Concepts that become readable in one slice, left-aligned per row.

    states (B, C, D) pooled token states; valid (B, C); positions (B, C) RoPE position of the opening
    token; probs (B, C) opening probability (the EMA weight); documents (B, C); token_index (B, L) the
    new concept each token reads (-1: none of the new ones); state: the updated open-chunk fields.
    """

    states: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    probs: torch.Tensor
    documents: torch.Tensor
    token_index: torch.Tensor
    state: ConceptState


def emit_concepts(
    token_states: torch.Tensor,
    probs: torch.Tensor,
    boundaries: torch.Tensor,
    mask: torch.Tensor,
    starts: torch.Tensor,
    position_ids: torch.Tensor,
    documents: torch.Tensor,
    pooling: str,
    state: ConceptState,
) -> EmittedConcepts:
    """New readable concepts of a slice (module docstring); `documents` (B, L) are global document ids."""
    opens = boundaries & mask
    positions = position_ids.expand_as(mask)
    if pooling == "first":
        num_slots = int(opens.sum(dim=1).max()) if opens.numel() else 0
        valid, (states, slot_positions, slot_probs, slot_documents) = gather_at_openings(
            opens, num_slots, token_states, positions, probs, documents
        )
        token_index = readable_concept_index(opens, mask, starts, "first")
        return EmittedConcepts(states, valid, slot_positions, slot_probs, slot_documents, token_index, state)
    return _emit_closed_chunks(token_states, probs, opens, mask, starts, positions, documents, pooling, state)


def _emit_closed_chunks(
    token_states: torch.Tensor,
    probs: torch.Tensor,
    opens: torch.Tensor,
    mask: torch.Tensor,
    starts: torch.Tensor,
    positions: torch.Tensor,
    documents: torch.Tensor,
    pooling: str,
    state: ConceptState,
) -> EmittedConcepts:
    """ "sum"/"mean": the state's open chunk becomes a virtual first token of the slice (its sum, counted
    `open_count` times), so one pooling over (B, 1 + L) covers cached and new tokens alike."""
    has_open = state.has_open[:, None]  # (B, 1)
    ext_opens = torch.cat([has_open, opens], dim=1)  # (B, 1 + L)
    ext_mask = torch.cat([has_open, mask], dim=1)
    ext_states = torch.cat([state.open_sum[:, None], token_states.to(state.open_sum.dtype)], dim=1)
    # Counts stay in float32: bf16 would stop counting exactly past 256 tokens.
    ext_counts = torch.cat([state.open_count[:, None].float(), mask.float()], dim=1)
    sums, _ = pool_concepts(ext_states, ext_opens, ext_mask, "sum")  # (B, Ce, D)
    counts, _ = pool_concepts(ext_counts.unsqueeze(-1), ext_opens, ext_mask, "sum")  # (B, Ce, 1)
    chunk_count = ext_opens.sum(dim=1)  # (B,)
    num_chunks = sums.shape[1]
    ext_values = [
        torch.cat([state.open_position[:, None], positions], dim=1),
        torch.cat([state.open_prob[:, None].to(probs.dtype), probs], dim=1),
        torch.cat([state.open_document[:, None], documents], dim=1),
    ]
    _, (chunk_positions, chunk_probs, chunk_documents) = gather_at_openings(
        ext_opens, num_chunks, *ext_values
    )
    pooled = (sums / counts.clamp_min(1) if pooling == "mean" else sums).to(token_states.dtype)
    last = (chunk_count - 1).clamp_min(0)[:, None]  # (B, 1)
    is_open = torch.arange(num_chunks, device=mask.device)[None] == last
    new_state = _open_chunk_state(
        state, sums, counts, chunk_positions, chunk_probs, chunk_documents, chunk_count
    )
    closed = (torch.arange(num_chunks, device=mask.device)[None] < chunk_count[:, None]) & ~is_open
    num_closed = max(num_chunks - 1, 0)
    ext_starts = torch.cat([torch.zeros_like(has_open), starts & mask], dim=1)
    token_index = readable_concept_index(ext_opens, ext_mask, ext_starts, "sum")[:, 1:]
    return EmittedConcepts(
        pooled[:, :num_closed],
        closed[:, :num_closed],
        chunk_positions[:, :num_closed],
        chunk_probs[:, :num_closed],
        chunk_documents[:, :num_closed],
        token_index,
        new_state,
    )


def _open_chunk_state(
    state: ConceptState,
    sums: torch.Tensor,
    counts: torch.Tensor,
    positions: torch.Tensor,
    probs: torch.Tensor,
    documents: torch.Tensor,
    chunk_count: torch.Tensor,
) -> ConceptState:
    """A copy of `state` whose open chunk is each row's last chunk (unchanged when the row has none)."""
    new_state = ConceptState(*state.tensors())
    if sums.shape[1] == 0:
        return new_state
    has_chunk = chunk_count > 0  # (B,)
    last = (chunk_count - 1).clamp_min(0)  # (B,)
    rows = torch.arange(last.shape[0], device=last.device)

    def pick(table: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        value = table[rows, last].to(old.dtype)
        keep = has_chunk.view(-1, *([1] * (old.dim() - 1)))
        return torch.where(keep, value, old)

    new_state.open_sum = pick(sums, state.open_sum)
    new_state.open_count = pick(counts.squeeze(-1), state.open_count)
    new_state.open_position = pick(positions, state.open_position)
    new_state.open_prob = pick(probs, state.open_prob)
    new_state.open_document = pick(documents, state.open_document)
    new_state.has_open = state.has_open | has_chunk
    return new_state
