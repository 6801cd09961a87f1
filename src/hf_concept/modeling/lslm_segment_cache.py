"""`SegmentCache`: the decoding cache of the LSLM family (LSLM §2.3; docs/ARCHITECTURE.md §5).

Legend: B batch, G key/value heads, K head dim, T bytes fed to the token encoder, W the longest stored
row of a ragged store, Dt token-encoder width.

What one generation step needs, and where it is kept:
- token encoder: K/V of every byte (`self.layers`, one `DynamicLayer` per token-encoder layer; every step
  appends one column to every row, `token_valid` (B, T) says which columns hold bytes, so a marker or a
  pad step leaves an unattended hole);
- the open segment: the token states of its bytes (`open_states` (B, W, Dt), `open_counts` (B,)), pooled
  once when the segment closes;
- segment encoder: K/V of each closed segment (`segment_store`, ragged: rows close segments at different
  steps);
- the latest closed segment, projected for the decoder's input (`latest_segment` (B, Dd), when the
  config adds it);
- cross-attention: each decoder layer's K/V of the null segment and of every encoded segment
  (`cross_store`, ragged), computed once per segment;
- decoder self-attention: K/V of the current segment's slots, `<bos>` first (`decoder_store`, ragged),
  emptied whenever a segment closes, so the decoder attends over one segment, never the context.

`get_seq_length()` counts the input columns seen (bytes, markers and pads alike), as `generate` needs.
Batch operations (`reorder_cache`, `batch_repeat_interleave`, `batch_select_indices`) act on every
per-row tensor.

Rolling back (`crop`, assisted decoding): a closed segment is pooled and encoded once, and the decoder
and open-segment stores are overwritten when the next segment starts, so no column's state can be sliced
out. A crop returns to the last crop and replays the kept columns (`family_cache`): the token-encoder K/V,
`token_valid` and the segment and cross stores only grow after it, so their lengths give them back; the
decoder store and the open segment's states, written in place, are copied at each crop (one segment's
worth). A crop into the prompt's parallel pass replays that pass over the kept columns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from .family_cache import FamilyCache


class RaggedStore:
    """Per-layer keys/values kept left-aligned per row: row b holds `lengths[b]` entries.

    Two ways in: a parallel fill (`fill(lengths)`, then one `update` per layer storing whole (B, G, n, K)
    tensors), or a step (`begin(writing)`, one `update` per layer writing one entry at each writing row's
    length, `end()`). `allowed()` is the (B, W) mask of stored entries a query may read.
    """

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.lengths: torch.Tensor | None = None
        self.writing: torch.Tensor | None = None

    def fill(self, lengths: torch.Tensor) -> None:
        """The next `update` per layer stores its whole tensors; rows keep `lengths` (B,) entries."""
        self.keys, self.values, self.lengths, self.writing = {}, {}, lengths.clone(), None

    def begin(self, writing: torch.Tensor) -> None:
        """Each `update` until `end()` appends one entry to the rows where `writing` (B,) is True."""
        self.writing = writing
        # Where the step writes, found once for all layers (each host sync costs more than the write).
        self._rows = torch.nonzero(writing).flatten()
        self._positions = self.lengths[self._rows]
        self._width = self._max_length(self.lengths + writing.long())

    def end(self) -> None:
        self.lengths = self.lengths + self.writing.long()
        self.writing = None

    @staticmethod
    def _max_length(lengths: torch.Tensor) -> int:
        return max(int(lengths.max()), 1) if lengths.numel() else 1

    def width(self) -> int:
        return self._max_length(self.lengths) if self.writing is None else self._width

    def allowed(self) -> torch.Tensor:
        """(B, W) bool: the entries a query of this step reads (at least entry 0, so that a row that
        holds nothing yet gets a finite, unused output rather than NaN)."""
        lengths = self.lengths if self.writing is None else self.lengths + self.writing.long()
        order = torch.arange(self.width(), device=lengths.device)
        return order[None, :] < lengths.clamp(min=1)[:, None]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, ...]:
        """Store (B, G, n, K) keys/values of layer `layer_idx`; return (B, G, W, K) of every entry."""
        if self.writing is None:
            self.keys[layer_idx], self.values[layer_idx] = key, value
            return key, value
        rows, positions, needed = self._rows, self._positions, self._width
        for store in (self.keys, self.values):
            stored = store.get(layer_idx)
            if stored is None:
                stored = key.new_zeros(key.shape[0], key.shape[1], 0, key.shape[3])
            if stored.shape[2] < needed:
                # Grow geometrically: a step writes one entry, so amortised growth stays linear.
                extra = max(needed - stored.shape[2], stored.shape[2], 4)
                stored = torch.cat([stored, stored.new_zeros(*stored.shape[:2], extra, stored.shape[3])], 2)
            elif torch.is_grad_enabled():
                stored = stored.clone()  # writing in place would break a graph that still needs it
            new = key if store is self.keys else value
            stored[rows, :, positions] = new[rows, :, 0]
            store[layer_idx] = stored
        width = self.width()
        return self.keys[layer_idx][:, :, :width], self.values[layer_idx][:, :, :width]

    def reset(self, rows: torch.Tensor) -> None:
        """Empty the rows where `rows` (B,) is True."""
        self.lengths = self.lengths.masked_fill(rows, 0)

    def apply(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for store in (self.keys, self.values):
            for layer_idx, tensor in store.items():
                store[layer_idx] = function(tensor)
        if self.lengths is not None:
            self.lengths = function(self.lengths)

    def num_bytes(self) -> int:
        tensors = [*self.keys.values(), *self.values.values()]
        if self.lengths is not None:
            tensors.append(self.lengths)
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


class SegmentCache(FamilyCache):
    """Everything an LSLM needs to write the next byte (see the module docstring).

    Args:
        token_encoder_layers: layers of the token encoder (their K/V live in `self.layers`).
    """

    def __init__(self, token_encoder_layers: int) -> None:
        super().__init__(layers=[DynamicLayer() for _ in range(max(token_encoder_layers, 1))])
        self.token_encoder_layers = token_encoder_layers
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.items = 0
        self.token_valid: torch.Tensor | None = None  # (B, T) bool
        self.byte_counts: torch.Tensor | None = None  # (B,) next token-encoder position
        self.open_states: torch.Tensor | None = None  # (B, W, Dt)
        self.open_counts: torch.Tensor | None = None  # (B,)
        # (B,) int64: the running sum of q in 2^-16 units of boundary_rule "rate" (boundary_rules).
        self.rate_units: torch.Tensor | None = None
        # (B, Dd) the latest closed segment projected for the decoder's input (`decoder_latest_segment`).
        self.latest_segment: torch.Tensor | None = None
        self.segment_store = RaggedStore()
        self.cross_store = RaggedStore()
        self.decoder_store = RaggedStore()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Input columns seen so far (bytes, markers and pads)."""
        return self.items

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def push_open_states(self, token_states: torch.Tensor, rows: torch.Tensor) -> None:
        """Append (B, Dt) states to the open segment of the rows where `rows` (B,) is True."""
        width = int((self.open_counts + rows.long()).max())
        if self.open_states.shape[1] < width:
            pad = self.open_states.new_zeros(
                self.open_states.shape[0], width - self.open_states.shape[1], self.open_states.shape[2]
            )
            self.open_states = torch.cat([self.open_states, pad], dim=1)
        elif torch.is_grad_enabled():
            self.open_states = self.open_states.clone()  # a graph may still need the old values
        index = torch.nonzero(rows).flatten()
        self.open_states[index, self.open_counts[index]] = token_states[index]
        self.open_counts = self.open_counts + rows.long()

    def _per_row(self) -> list[str]:
        return ["token_valid", "byte_counts", "open_states", "open_counts", "rate_units", "latest_segment"]

    def _stores(self) -> dict[str, RaggedStore]:
        return {"segment": self.segment_store, "cross": self.cross_store, "decoder": self.decoder_store}

    def _snapshot(self) -> dict[str, Any] | None:
        """Lengths of what only grows; copies of the decoder store and the open segment (overwritten)."""
        if self.items == 0:
            return None
        fields = {name: getattr(self, name) for name in self._per_row()}
        fields["open_states"] = self.open_states.clone()
        decoder = self.decoder_store
        return {
            "items": self.items,
            "tokens": self.layers[0].get_seq_length(),
            "fields": fields,
            "lengths": {name: store.lengths for name, store in self._stores().items()},
            "decoder": [
                {key: tensor.clone() for key, tensor in part.items()}
                for part in (decoder.keys, decoder.values)
            ],
        }

    def _restore(self, snapshot: dict[str, Any] | None) -> None:
        if snapshot is None:
            self.reset()
            return
        for layer in self.layers:
            layer.crop(snapshot["tokens"] - layer.get_seq_length())
        self.items = snapshot["items"]
        for name, tensor in snapshot["fields"].items():
            setattr(self, name, tensor)
        for name, store in self._stores().items():
            store.lengths, store.writing = snapshot["lengths"][name], None
        # Handed over: the crop that restores takes a new snapshot right after.
        self.decoder_store.keys, self.decoder_store.values = snapshot["decoder"]

    def _apply_to_rows(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super()._apply_to_rows(function)
        for name in self._per_row():
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, function(tensor))
        for store in self._stores().values():
            store.apply(function)
        snapshot = self._rollback
        if snapshot is not None:
            snapshot["fields"] = {
                name: None if tensor is None else function(tensor)
                for name, tensor in snapshot["fields"].items()
            }
            snapshot["lengths"] = {name: function(tensor) for name, tensor in snapshot["lengths"].items()}
            snapshot["decoder"] = [
                {key: function(tensor) for key, tensor in part.items()} for part in snapshot["decoder"]
            ]

    def num_bytes(self) -> int:
        """Bytes held by every tensor of the cache (K/V of all stores and the per-row state)."""
        total = self.layer_bytes()
        for name in self._per_row():
            tensor = getattr(self, name)
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
        return total + sum(
            store.num_bytes() for store in (self.segment_store, self.cross_store, self.decoder_store)
        )
