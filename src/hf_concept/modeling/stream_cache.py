"""`StreamCache`: the decoding cache of the Hidden Decoding family (DESIGN §5, HD §2.2).

Legend: B batch, S streams (the paper's n), T cached tokens, G key/value heads, K head dim, W window.

One layer store per decoder layer, by the layer's stream attention kind:
- "intra", stream_kv "per_stream": a `DynamicLayer` over the streams folded into the batch,
  (B·S, G, T, K), row b·S + k holding stream k of row b;
- "intra", stream_kv "shared": a `DynamicLayer` (B, G, T, K) holding the final stream only;
- "full": a `DynamicLayer` over the interleaved sequence, (B, G, S·T, K);
- "local": a `DynamicSlidingWindowLayer` over the interleaved sequence (at most W - 1 slots kept).

Lengths: `get_seq_length()` counts tokens, as `generate` needs (HF_NOTES §2); `get_query_offset(i)` and
`get_mask_sizes(q, i)` speak the units of layer i (tokens for intra layers, expanded slots for the others),
so `transformers.masking_utils` sizes each mask from the layer it is built for.

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


class StreamCache(ForwardOnlyCache):
    """Per-layer key/value stores shaped by the stream attention layout.

    Args:
        stream_attention_layout: "intra" / "local" / "full" per decoder layer.
        num_streams: S.
        sliding_window: W of the local layers, in expanded positions (None when there are none).
        stream_kv: "per_stream" or "shared" (intra layers keep only the final stream).
    """

    rollback_reason = "local layers keep a rolling window"

    def __init__(
        self,
        stream_attention_layout: list[str],
        num_streams: int,
        sliding_window: int | None = None,
        stream_kv: str = "per_stream",
    ) -> None:
        unknown = sorted({kind for kind in stream_attention_layout if kind not in STREAM_LAYER_KINDS})
        if unknown:
            raise ValueError(f"stream_attention_layout has {unknown}; allowed: {STREAM_LAYER_KINDS}")
        if "local" in stream_attention_layout and sliding_window is None:
            raise ValueError("sliding_window=None but the layout has local layers")
        layers = [
            DynamicSlidingWindowLayer(sliding_window) if kind == "local" else DynamicLayer()
            for kind in stream_attention_layout
        ]
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
