"""`StreamCache`: the decoding cache of the Hidden Decoding family (DESIGN §5, HD §2.2).

Legend: B batch, S streams (the paper's n), T cached tokens, G key/value heads, K head dim, W window.

One layer store per decoder layer, by the layer's stream attention kind:
- "intra", stream_kv "per_stream": a growing layer over the streams folded into the batch,
  (B·S, G, T, K), row b·S + k holding stream k of row b (a `DynamicSlidingWindowLayer` keeping
  intra_window - 1 tokens when the intra layers have a window);
- "intra", stream_kv "shared": a `DynamicLayer` (B, G, T, K) holding the final stream only;
- "full": a `DynamicLayer` over the interleaved sequence, (B, G, S·T, K);
- "local": a `DynamicSlidingWindowLayer` over the interleaved sequence (at most W - 1 slots kept).

Lengths: `get_seq_length()` counts tokens, as `generate` needs (HF_NOTES §2); `get_query_offset(i)` and
`get_mask_sizes(q, i)` speak the units of layer i (tokens for intra layers, expanded slots for the others),
so `transformers.masking_utils` sizes each mask from the layer it is built for.

Storage: intra and full layers append into `BlockGrowthLayer` buffers that grow by whole blocks of
`GROWTH_BLOCK_TOKENS` tokens, so a decode step writes its n new entries in place instead of copying the
layer's whole history (a `DynamicLayer` concatenates, which at n times the source's entries was the largest
avoidable cost of a decode step, issue 18). `keys`/`values` are views of the filled part.

Contract: a forward over tokens [0, n) followed by one over [n, m) with this cache gives the same outputs
as one forward over [0, m). Batch operations (`reorder_cache`, `batch_repeat_interleave`,
`batch_select_indices`) act on rows of B and move the S folded rows of each together. Rolling back is not
supported: `is_croppable` is False and `crop(n)` raises for n != 0.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .forward_only_cache import ForwardOnlyCache

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


class StreamCache(ForwardOnlyCache):
    """Per-layer key/value stores shaped by the stream attention layout.

    Args:
        stream_attention_layout: "intra" / "local" / "full" per decoder layer.
        num_streams: S.
        sliding_window: W of the local layers, in expanded positions (None when there are none).
        stream_kv: "per_stream" or "shared" (intra layers keep only the final stream).
        intra_window: window of the intra layers in tokens (None: unbounded).
    """

    rollback_reason = "local and windowed intra layers keep a rolling window"

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
                layers.append(DynamicSlidingWindowLayer(sliding_window))
            elif kind == "intra" and intra_window is not None:
                layers.append(DynamicSlidingWindowLayer(intra_window))
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

    def _rows(self, index: torch.Tensor, fold: int) -> torch.Tensor:
        """Row indices of a folded store for (B',) row indices of the batch."""
        if fold == 1:
            return index
        streams = torch.arange(fold, device=index.device)
        return (index[:, None] * fold + streams).reshape(-1)

    def _apply(self, index: torch.Tensor) -> None:
        for layer, fold in zip(self.layers, self.folds, strict=True):
            if layer.is_initialized and layer.keys.numel() > 0:
                rows = self._rows(index.to(layer.keys.device), fold)
                layer.keys = layer.keys.index_select(0, rows)
                layer.values = layer.values.index_select(0, rows)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        index = indices
        if index.dtype == torch.bool:
            index = torch.nonzero(index).flatten()
        self._apply(index)

    def batch_repeat_interleave(self, repeats: int) -> None:
        for layer, fold in zip(self.layers, self.folds, strict=True):
            if layer.is_initialized and layer.keys.numel() > 0:
                batch = layer.keys.shape[0] // fold
                index = torch.arange(batch, device=layer.keys.device).repeat_interleave(repeats)
                rows = self._rows(index, fold)
                layer.keys = layer.keys.index_select(0, rows)
                layer.values = layer.values.index_select(0, rows)

    def num_bytes(self) -> int:
        """Bytes held by the stored keys and values of every layer."""
        return self.layer_bytes()
