"""`StreamCache`: the decoding cache of the Hidden Decoding family (HD §2.2; docs/ARCHITECTURE.md, §5).

Legend: B batch, S streams (the paper's n), T cached tokens, G key/value heads, K head dim, W window.

One layer store per decoder layer, by the layer's stream attention kind:
- "intra", stream_kv "per_stream": a growing layer over the streams folded into the batch,
  (B·S, G, T, K), row b·S + k holding stream k of row b (a `RollbackWindowLayer` keeping
  intra_window - 1 tokens when the intra layers have a window);
- "intra", stream_kv "shared": a `DynamicLayer` (B, G, T, K) holding the final stream only;
- "full": a `DynamicLayer` over the interleaved sequence, (B, G, S·T, K);
- "local": a `RollbackWindowLayer` over the interleaved sequence (at most W - 1 slots kept). Under
  token-block cross-stream masks the model passes W = (w - 1)·S + 1 for a window of w whole tokens, so
  the layer keeps the w - 1 earlier tokens' S slots each and its mask sizes stay whole tokens.

Lengths: `get_seq_length()` counts tokens, as `generate` needs (it compares that length with the input ids
and the attention mask, which count tokens, to choose what to feed next); `get_query_offset(i)` and
`get_mask_sizes(q, i)` speak the units of layer i (tokens for intra layers, expanded slots for the others),
so `transformers.masking_utils` sizes each mask from the layer it is built for. `TokenUnits(cache)` speaks
tokens in every layer, for masks built per token and then widened to the S slots of each token.

Storage: intra and full layers append into `BlockGrowthLayer` buffers that grow by whole blocks of
`GROWTH_BLOCK_TOKENS` tokens, so a decode step writes its n new entries in place instead of copying the
layer's whole history (a `DynamicLayer` concatenates, which at n times the source's entries was the largest
avoidable cost of a decode step: BENCHMARKS.md, Hidden Decoding's decode profile). `keys`/`values` are
views of the filled part.

Contract: a forward over tokens [0, n) followed by one over [n, m) with this cache gives the same outputs
as one forward over [0, m). Batch operations (`reorder_cache`, `batch_repeat_interleave`,
`batch_select_indices`) act on rows of B and move the S folded rows of each together.

Rolling back (`crop(-n)`, assisted decoding): every layer loses n tokens' slots (n·S in local and full
layers, n in intra ones). Growing layers just slice. A window cannot give back what it dropped, so window
layers are `RollbackWindowLayer`s: their window is a view of their latest update's concatenation (as in
transformers' layer, so no extra memory) and they keep a handle on that concatenation; removing tokens
of the latest call, what a verification pass of assisted decoding needs, is then a slice. A crop that
reaches further back (a draft model's cache gives back tokens of several one-token calls) returns to the
last crop and replays the kept tokens (`family_cache`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .family_cache import FamilyCache

STREAM_LAYER_KINDS = ("intra", "local", "full")
# Tokens of room a growing buffer gains at a time: a reallocation (one copy of the history) per this many
# decode steps, and at most this many tokens' entries held beyond what is stored.
GROWTH_BLOCK_TOKENS = 256


class BlockGrowthLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values live in buffers that grow by `block` positions at a time.

    `update` writes the new entries into the free room (one reallocation and copy when it runs out), and
    `keys`/`values` are views of the first `get_seq_length()` positions, so every `DynamicLayer` method that
    reads or replaces them (crop, batch selection, byte counts) keeps working; a replaced tensor simply
    moves to a fresh buffer at the next update. While autograd records (entries that require grad), it
    appends by concatenation as `DynamicLayer` does: an in-place write would invalidate the graph of
    earlier steps.
    """

    def __init__(self, block: int) -> None:
        super().__init__()
        self.block = block
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, G, L, K) entries; return the (B, G, T + L, K) stored ones (views of the buffers)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.requires_grad or value_states.requires_grad:
            self.key_buffer = self.value_buffer = None
            return super().update(key_states, value_states)
        length, new = self.get_seq_length(), key_states.shape[-2]
        if not self._has_room(key_states, length + new):
            self._reallocate(key_states, value_states, length, length + new)
        self.key_buffer[:, :, length : length + new] = key_states
        self.value_buffer[:, :, length : length + new] = value_states
        self.keys = self.key_buffer[:, :, : length + new]
        self.values = self.value_buffer[:, :, : length + new]
        return self.keys, self.values

    def _has_room(self, key_states: torch.Tensor, needed: int) -> bool:
        """The buffers still back `keys` (nothing replaced them), fit the new rows and have `needed` room."""
        buffer = self.key_buffer
        if buffer is None or buffer.shape[-2] < needed or buffer.shape[:2] != key_states.shape[:2]:
            return False
        keys_backed = self.keys.numel() == 0 or self.keys.data_ptr() == buffer.data_ptr()
        values_backed = self.values.numel() == 0 or self.values.data_ptr() == self.value_buffer.data_ptr()
        return keys_backed and values_backed

    def _reallocate(
        self, key_states: torch.Tensor, value_states: torch.Tensor, length: int, needed: int
    ) -> None:
        capacity = -(-(needed + self.block) // self.block) * self.block
        batch, heads, _, _ = key_states.shape
        self.key_buffer = key_states.new_empty(batch, heads, capacity, key_states.shape[-1])
        self.value_buffer = value_states.new_empty(batch, heads, capacity, value_states.shape[-1])
        if length:
            self.key_buffer[:, :, :length] = self.keys
            self.value_buffer[:, :, :length] = self.values

    def reset(self) -> None:
        self.key_buffer = self.value_buffer = None
        super().reset()


class RollbackWindowLayer(DynamicSlidingWindowLayer):
    """A `DynamicSlidingWindowLayer` that can give back the entries of its latest update.

    As in transformers' layer, `keys`/`values` hold the window (the last `sliding_window - 1` entries) as
    a view of the latest concatenation, which that view keeps alive anyway; `latest` keeps a handle on that
    concatenation, so `crop` can remove the latest update's entries and still have the window before them,
    at no extra memory. While `record_past` is on (`activate_past_recording`) the layer keeps every entry
    since the last `crop` in `keys`, as transformers' does.
    """

    def __init__(self, sliding_window: int) -> None:
        super().__init__(sliding_window)
        self.latest: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, G, L, K) entries; return (B, G, min(T, W - 1) + L, K), what the new queries may read."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        if self.record_past:
            self.keys, self.values, self.latest = keys, values, None
        else:
            self.keys, self.values = self._window(keys), self._window(values)
            self.latest = keys, values
        visible = self.sliding_window - 1 + key_states.shape[-2]
        return keys[:, :, -visible:], values[:, :, -visible:]

    def _window(self, tensor: torch.Tensor) -> torch.Tensor:
        """The last `sliding_window - 1` entries of (B, G, T, K) `tensor` (a view)."""
        return tensor[:, :, tensor.shape[-2] - min(tensor.shape[-2], self.sliding_window - 1) :]

    def _held(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.latest if self.latest is not None else (self.keys, self.values)

    def can_remove(self, count: int) -> bool:
        """Whether the window that `count` fewer entries leave is still held."""
        held = self._held()[0].shape[-2] if self.is_initialized else 0
        remaining = self.cumulative_length - count
        return remaining >= 0 and held - count >= min(remaining, self.sliding_window - 1)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` entries and keep the window before them (`crop(0)` only
        drops what was kept for a rollback)."""
        if tokens_to_remove > 0:
            raise ValueError(f"tokens_to_remove={tokens_to_remove}: crop takes a negative count")
        if not self.is_initialized:
            return
        count = -tokens_to_remove
        if not self.can_remove(count):
            raise ValueError(
                f"tokens_to_remove={tokens_to_remove}: this window layer no longer holds the "
                f"{self.sliding_window - 1} entries before them"
            )
        keys, values = self._held()
        end = keys.shape[-2] - count
        self.keys, self.values = self._window(keys[:, :, :end]), self._window(values[:, :, :end])
        self.cumulative_length -= count
        self.latest = None

    def reset(self) -> None:
        super().reset()
        self.latest = None


class TokenUnits:
    """A read-only view of a `StreamCache` that gives every layer's mask sizes in tokens.

    `masking_utils` sizes a mask by `get_query_offset` and `get_mask_sizes`; a token-block mask is built
    per token and then widened to S slots a token, so its sizes are the layer's slot counts over S. That
    needs whole tokens in every layer, which `StreamCache` keeps: each call adds whole tokens, and a local
    layer built for token-block masks keeps whole tokens (see the module docstring)."""

    is_compileable = False

    def __init__(self, cache: StreamCache) -> None:
        self.cache = cache

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.cache.get_query_offset(layer_idx) // self.cache.slots_per_token[layer_idx]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        slots = self.cache.slots_per_token[layer_idx]
        length, offset = self.cache.get_mask_sizes(query_length * slots, layer_idx)
        if length % slots or offset % slots:
            raise ValueError(
                f"layer {layer_idx} holds {length} slots from slot {offset}: not whole tokens of {slots} "
                "slots"
            )
        return length // slots, offset // slots


class StreamCache(FamilyCache):
    """Per-layer key/value stores shaped by the stream attention layout.

    Args:
        stream_attention_layout: "intra" / "local" / "full" per decoder layer.
        num_streams: S.
        sliding_window: W of the local layers, in expanded positions (None when there are none).
        stream_kv: "per_stream" or "shared" (intra layers keep only the final stream).
        intra_window: window of the intra layers in tokens (None: unbounded).
    """

    def __init__(
        self,
        stream_attention_layout: list[str],
        num_streams: int,
        sliding_window: int | None = None,
        stream_kv: str = "per_stream",
        intra_window: int | None = None,
    ) -> None:
        unknown = sorted({kind for kind in stream_attention_layout if kind not in STREAM_LAYER_KINDS})
        if unknown:
            raise ValueError(f"stream_attention_layout has {unknown}; allowed: {STREAM_LAYER_KINDS}")
        if "local" in stream_attention_layout and sliding_window is None:
            raise ValueError("sliding_window=None but the layout has local layers")
        layers = []
        for kind in stream_attention_layout:
            if kind == "local":
                layers.append(RollbackWindowLayer(sliding_window))
            elif kind == "intra" and intra_window is not None:
                layers.append(RollbackWindowLayer(intra_window))
            else:
                layers.append(BlockGrowthLayer(GROWTH_BLOCK_TOKENS * (1 if kind == "intra" else num_streams)))
        super().__init__(layers=layers)
        self.layout = list(stream_attention_layout)
        self.num_streams = num_streams
        self.stream_kv = stream_kv
        # Batch rows per row of B in each layer store (S where the streams are folded into the batch).
        self.folds = [
            num_streams if kind == "intra" and stream_kv == "per_stream" else 1 for kind in self.layout
        ]
        # Positions per token in each layer store (S where the layer sees the interleaved sequence).
        self.slots_per_token = [1 if kind == "intra" else num_streams for kind in self.layout]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far (never expanded slots)."""
        return self.layers[layer_idx].get_seq_length() // self.slots_per_token[layer_idx]

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Position of the first new query in layer `layer_idx`'s own units (tokens or slots)."""
        return self.layers[layer_idx].get_seq_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def _crop_in_place(self, tokens: int) -> bool:
        """Slice every layer when every window still holds what the kept tokens need."""
        counts = [tokens * slots for slots in self.slots_per_token]
        windows = [
            (layer, count)
            for layer, count in zip(self.layers, counts, strict=True)
            if isinstance(layer, RollbackWindowLayer)
        ]
        if not all(layer.can_remove(count) for layer, count in windows):
            return False
        for layer, count in zip(self.layers, counts, strict=True):
            layer.crop(-count)
        return True

    def _snapshot(self) -> list[Any] | None:
        """Per layer: a window's (keys, values, cumulative length) or None, a growing layer's length."""
        if self.get_seq_length() == 0:
            return None
        snapshot = []
        for layer in self.layers:
            if not isinstance(layer, RollbackWindowLayer):
                snapshot.append(layer.get_seq_length())
            elif layer.is_initialized:
                snapshot.append((layer.keys, layer.values, layer.cumulative_length))
            else:
                snapshot.append(None)
        return snapshot

    def _restore(self, snapshot: list[Any] | None) -> None:
        if snapshot is None:
            for layer in self.layers:
                layer.reset()
            return
        for layer, kept in zip(self.layers, snapshot, strict=True):
            if not isinstance(layer, RollbackWindowLayer):
                # Growing layers only ever append after the snapshot: slicing gives it back.
                layer.crop(kept - layer.get_seq_length())
            elif kept is None:
                layer.reset()
            else:
                layer.keys, layer.values, layer.cumulative_length = kept
                layer.latest = None

    def _rows(self, index: torch.Tensor, fold: int) -> torch.Tensor:
        """Row indices of a folded store for (B',) row indices of the batch."""
        if fold == 1:
            return index
        streams = torch.arange(fold, device=index.device)
        return (index[:, None] * fold + streams).reshape(-1)

    def _apply(self, index: torch.Tensor) -> None:
        """Keep rows `index` (B',) of the batch in every layer, the rollback point and the journal."""
        snapshot = self._rollback
        for position, (layer, fold) in enumerate(zip(self.layers, self.folds, strict=True)):
            if layer.is_initialized and layer.keys.numel() > 0:
                rows = self._rows(index.to(layer.keys.device), fold)
                layer.keys = layer.keys.index_select(0, rows)
                layer.values = layer.values.index_select(0, rows)
            if isinstance(layer, RollbackWindowLayer):
                # Rows moved: a later crop replays instead of slicing the latest update.
                layer.latest = None
            if snapshot is not None and isinstance(snapshot[position], tuple):
                keys, values, length = snapshot[position]
                rows = self._rows(index.to(keys.device), fold)
                snapshot[position] = (keys.index_select(0, rows), values.index_select(0, rows), length)
        self._apply_to_rows(lambda tensor: tensor.index_select(0, index.to(tensor.device)))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        index = indices
        if index.dtype == torch.bool:
            index = torch.nonzero(index).flatten()
        self._apply(index)

    def batch_repeat_interleave(self, repeats: int) -> None:
        batch = self._batch_size()
        if batch:
            device = next(layer.keys.device for layer in self.layers if layer.is_initialized)
            self._apply(torch.arange(batch, device=device).repeat_interleave(repeats))

    def _batch_size(self) -> int:
        """B, read from the first stored layer (0 when nothing is stored)."""
        for layer, fold in zip(self.layers, self.folds, strict=True):
            if layer.is_initialized and layer.keys.numel() > 0:
                return layer.keys.shape[0] // fold
        return 0

    def num_bytes(self) -> int:
        """Bytes held by the stored keys and values of every layer."""
        return self.layer_bytes()
