"""`ConceptCache`: the exact decoding cache of the concept-level families (docs/ARCHITECTURE.md, §5).

Legend: B batch, L tokens, C concept slots, D token width, H heads, K head dim.

What it holds:
- token-level K/V for the encoder and decoder layers: one `DynamicLayer` per layer index of the flat
  layer numbering (concept-layer indices stay empty), so `transformers.masking_utils` sizes token masks
  from it unchanged and `get_seq_length()` counts tokens;
- concept-level K/V, one (B, H, C, K) pair per *virtual* concept layer (loops unrolled), plus per slot
  whether it holds a concept (`concept_valid`), its document id and its RoPE position. A slot is
  appended only when some row gets a new readable concept; rows without one get an invalid slot, so
  rows may hold different numbers of concepts;
- the per-row `ConceptState` (router's previous key, open chunk, last EMA value, last readable concept,
  current document, concept counts) that the model threads from one call to the next.

Contract: a forward over tokens [0, n) followed by one over [n, m) with this cache gives the same
outputs as one forward over [0, m) (the model's forward *is* the incremental step; a no-cache forward is
the step from an empty state). Every batch operation (`reorder_cache`, `batch_repeat_interleave`,
`batch_select_indices`) and `reset` covers every tensor here.

Rolling back (`crop`, assisted decoding): the per-row state after a token inside a call is never
materialised, so a crop returns to the last crop (token K/V cut to its length, concept slots and K/V cut
to its slot count — both only ever grow — and its `ConceptState`, kept by reference since every call
builds a new one) and feeds the kept tokens again (`family_cache`). A verification pass that rejects
draft tokens therefore costs a second, shorter forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from transformers.cache_utils import DynamicLayer

from .family_cache import FamilyCache


@dataclass
class ConceptState:
    """Per-row state between two calls (all tensors have the batch first).

    previous_key (B, Dk): the router key of each row's last real token (zeros before any token).
    document (B,): id of the document of the row's last real token (-1 before any token).
    open_sum (B, D), open_count (B,), open_position (B,), open_prob (B,), open_document (B,),
    has_open (B,): the chunk that is still open (used by "sum"/"mean"; its sum, real-token count,
    opening position, opening probability and document).
    last_ema (B, D), has_ema (B,): the EMA value of the row's latest concept.
    last_readable (B, D), has_readable (B,): the concept the row's last real token read.
    concept_count (B,): concepts emitted so far (for logging).
    read_slot (B,), read_counts (B, N): DLCM's cross-attention — the slot the row's last real token
    carried (-1: none yet; 0 is the null concept, slot j of the cache is j + 1) and, per slot, how many
    positions of the row's current document carried it.
    last_concept (B, Dc), last_concept_document (B,): DLCM's smoothing — the row's latest concept (after
    smoothing under "ema", before it under "linear") and its document (-1: none).
    recent_probs (B, W − 1), recent_documents (B, W − 1): the router probabilities of the row's last
    W − 1 positions and their documents (-1: not a free token), for `boundary_rank_window` = W
    (`concept_ranking`); no columns without it.
    """

    previous_key: torch.Tensor
    document: torch.Tensor
    open_sum: torch.Tensor
    open_count: torch.Tensor
    open_position: torch.Tensor
    open_prob: torch.Tensor
    open_document: torch.Tensor
    has_open: torch.Tensor
    last_ema: torch.Tensor
    has_ema: torch.Tensor
    last_readable: torch.Tensor
    has_readable: torch.Tensor
    concept_count: torch.Tensor
    read_slot: torch.Tensor
    read_counts: torch.Tensor
    last_concept: torch.Tensor
    last_concept_document: torch.Tensor
    recent_probs: torch.Tensor
    recent_documents: torch.Tensor

    @classmethod
    def empty(
        cls,
        batch_size: int,
        width: int,
        key_width: int,
        device: torch.device,
        dtype: torch.dtype,
        concept_width: int | None = None,
        rank_window: int | None = None,
    ) -> ConceptState:
        def zeros(*shape: int, kind: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(*shape, device=device, dtype=kind)

        def flags() -> torch.Tensor:
            return torch.zeros(batch_size, device=device, dtype=torch.bool)

        history = max((rank_window or 1) - 1, 0)

        return cls(
            previous_key=zeros(batch_size, key_width),
            document=torch.full((batch_size,), -1, device=device, dtype=torch.long),
            # Sums accumulate in at least float32, as `pool_concepts` does over a whole chunk.
            open_sum=zeros(batch_size, width, kind=torch.promote_types(dtype, torch.float32)),
            open_count=zeros(batch_size, kind=torch.float32),
            open_position=zeros(batch_size, kind=torch.long),
            open_prob=zeros(batch_size, kind=torch.float32),
            open_document=zeros(batch_size, kind=torch.long),
            has_open=flags(),
            last_ema=zeros(batch_size, width),
            has_ema=flags(),
            last_readable=zeros(batch_size, width),
            has_readable=flags(),
            concept_count=zeros(batch_size, kind=torch.long),
            read_slot=torch.full((batch_size,), -1, device=device, dtype=torch.long),
            read_counts=zeros(batch_size, 0, kind=torch.long),
            last_concept=zeros(batch_size, width if concept_width is None else concept_width),
            last_concept_document=torch.full((batch_size,), -1, device=device, dtype=torch.long),
            # Probabilities are compared in the router's dtype (float32 at least), as they are computed.
            recent_probs=zeros(batch_size, history, kind=torch.promote_types(dtype, torch.float32)),
            recent_documents=torch.full((batch_size, history), -1, device=device, dtype=torch.long),
        )

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, item.name) for item in fields(self)]

    def map(self, function: Callable[[torch.Tensor], torch.Tensor]) -> ConceptState:
        return ConceptState(*(function(tensor) for tensor in self.tensors()))


class ConceptCache(FamilyCache):
    """Token K/V for encoder/decoder layers, concept K/V for concept layers, and the per-row state.

    Args:
        num_hidden_layers: layers of the flat numbering (encoder + concept + decoder).
        token_layer_ids: indices of the encoder and decoder layers (the ones with token K/V).
        num_concept_passes: concept layers run per call, loops unrolled (one K/V pair each).
    """

    def __init__(self, num_hidden_layers: int, token_layer_ids: list[int], num_concept_passes: int) -> None:
        super().__init__(layers=[DynamicLayer() for _ in range(num_hidden_layers)])
        if not token_layer_ids:
            raise ValueError(f"token_layer_ids={token_layer_ids!r} must name at least one layer")
        self.token_layer_ids = list(token_layer_ids)
        self.num_concept_passes = num_concept_passes
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.state: ConceptState | None = None
        self.concept_keys: list[torch.Tensor | None] = [None] * self.num_concept_passes
        self.concept_values: list[torch.Tensor | None] = [None] * self.num_concept_passes
        # (B, C) per slot: holds a concept, its document id, its RoPE position.
        self.concept_valid: torch.Tensor | None = None
        self.concept_documents: torch.Tensor | None = None
        self.concept_positions: torch.Tensor | None = None

    # Token-level sizes: concept-layer indices are redirected to the first token layer.
    def _token_layer(self, layer_idx: int) -> int:
        return layer_idx if layer_idx in self.token_layer_ids else self.token_layer_ids[0]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far (never concepts)."""
        return self.layers[self._token_layer(layer_idx)].get_seq_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[self._token_layer(layer_idx)].get_mask_sizes(query_length)

    @property
    def num_concept_slots(self) -> int:
        return 0 if self.concept_valid is None else self.concept_valid.shape[1]

    def concept_slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(valid, documents, positions), each (B, C), or None before the first concept."""
        if self.concept_valid is None:
            return None
        return self.concept_valid, self.concept_documents, self.concept_positions

    def append_concept_slots(
        self, valid: torch.Tensor, documents: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Append (B, C_new) slot descriptions; the concept K/V of these slots follow per pass."""
        if self.concept_valid is None:
            self.concept_valid, self.concept_documents, self.concept_positions = valid, documents, positions
            return
        self.concept_valid = torch.cat([self.concept_valid, valid], dim=1)
        self.concept_documents = torch.cat([self.concept_documents, documents], dim=1)
        self.concept_positions = torch.cat([self.concept_positions, positions], dim=1)

    def update_concepts(
        self, keys: torch.Tensor, values: torch.Tensor, pass_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, H, C_new, K) keys/values of one concept pass; return all of that pass's slots."""
        if self.concept_keys[pass_idx] is not None:
            keys = torch.cat([self.concept_keys[pass_idx], keys], dim=2)
            values = torch.cat([self.concept_values[pass_idx], values], dim=2)
        self.concept_keys[pass_idx], self.concept_values[pass_idx] = keys, values
        return keys, values

    def _snapshot(self) -> tuple[int, int, ConceptState | None] | None:
        """(tokens, concept slots, state): the K/V only grow, so lengths give them back."""
        if self.get_seq_length() == 0:
            return None
        state = None if self.state is None else self.state.map(lambda tensor: tensor)
        return self.get_seq_length(), self.num_concept_slots, state

    def _restore(self, snapshot: tuple[int, int, ConceptState | None] | None) -> None:
        if snapshot is None:
            self.reset()
            return
        tokens, slots, state = snapshot
        for layer_idx in self.token_layer_ids:
            self.layers[layer_idx].crop(tokens - self.layers[layer_idx].get_seq_length())
        self.state = state
        if slots == 0:
            self.concept_valid = self.concept_documents = self.concept_positions = None
            self.concept_keys = [None] * self.num_concept_passes
            self.concept_values = [None] * self.num_concept_passes
            return
        for name in ("concept_valid", "concept_documents", "concept_positions"):
            setattr(self, name, getattr(self, name)[:, :slots])
        for store in (self.concept_keys, self.concept_values):
            for index, tensor in enumerate(store):
                if tensor is not None:
                    store[index] = tensor[:, :, :slots]

    def _apply_to_rows(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super()._apply_to_rows(function)
        if self._rollback is not None and self._rollback[2] is not None:
            tokens, slots, state = self._rollback
            self._rollback = (tokens, slots, state.map(function))
        if self.state is not None:
            self.state = self.state.map(function)
        for name in ("concept_valid", "concept_documents", "concept_positions"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, function(tensor))
        for store in (self.concept_keys, self.concept_values):
            for index, tensor in enumerate(store):
                if tensor is not None:
                    store[index] = function(tensor)

    def num_bytes(self) -> int:
        """Bytes held by every tensor of the cache (token K/V, concept K/V, slots, per-row state)."""
        tensors = [tensor for tensor in self.concept_keys + self.concept_values if tensor is not None]
        slots = self.concept_slots()
        if slots is not None:
            tensors += list(slots)
        if self.state is not None:
            tensors += self.state.tensors()
        return self.layer_bytes() + sum(tensor.numel() * tensor.element_size() for tensor in tensors)
