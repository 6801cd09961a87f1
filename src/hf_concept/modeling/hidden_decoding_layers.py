"""Hidden Decoding's layers: the attention kernels of its stream attention kinds and the decoder layer
that picks one (modeling_hidden_decoding.py runs them over the stream layout).

Legend: B batch, L tokens (this call), T cached plus new tokens, S streams, D width, H query heads,
G key/value heads, K head dim.

- `StreamAttention`: the shared `Attention` with `grouped_sdpa_attention` as its sdpa kernel (grouped
  key/value heads shared with their query groups on CPU instead of copied; same results).
- `SharedKVAttention`: the §5.2 "shared KV" control for intra layers (one key/value history, the final
  stream's).
- `final_query_mask` and `widen_token_mask`: the interleaved layers' masks for final-stream queries and
  for token-block attention.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .configuration_hidden_decoding import HiddenDecodingConfig
from .layers import Attention, DecoderLayer, apply_rotary, repeat_kv


def grouped_sdpa_attention(
    module: Attention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except that on CPU a masked call with grouped key/value heads lets the
    kernel share each (B, G, T, K) key/value head with its query group (`enable_gqa`) instead of copying
    them to (B, H, T, K) first. transformers copies whenever a mask is given, to keep CUDA off its math
    kernel; on CPU the copy is pure cost, and a cross-stream layer decodes the S queries of a new token
    under a mask over S times the source's entries. Same result (the copy only repeats heads); returns
    ((B, L, H, K) output, None) as transformers does."""
    groups = getattr(module, "num_key_value_groups", 1)
    if attention_mask is None or groups == 1 or query.device.type != "cpu":
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    output = nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return output.transpose(1, 2).contiguous(), None


class StreamAttention(Attention):
    """`Attention` whose sdpa kernel is `grouped_sdpa_attention` (same parameters, same results)."""

    def kernel(self):
        if self.config._attn_implementation == "sdpa":
            return grouped_sdpa_attention
        return super().kernel()


class SharedKVAttention(Attention):
    """Intra-stream attention with one shared key/value history (HD §5.2, the "shared KV" control).

    Stream k of token i attends to the final stream's keys/values of the earlier tokens of its document
    plus its own key/value at token i; the final stream therefore sees exactly what per-stream intra
    attention gives it. Only the final stream's keys/values are cached. Same parameters as `Attention`.
    Computed with explicit products (no fused kernel): an ablation path, O(S·L·(T + L)) scores. Recorded
    weights are (B·S, H, L, T + L) as for per-stream intra layers: column t < i is token t's final-stream
    key, the column of token i itself the stream's own key.
    """

    num_streams: int = 1

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor,
        past_key_values=None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """(B·S, L, D) folded states -> (B·S, L, D); `attention_mask` is boolean (B, 1, L, T + L)."""
        streams = self.num_streams
        query, key, value = self.project(hidden_states)
        query, key = apply_rotary(query, key, *position_embeddings)
        batch = query.shape[0] // streams
        length = query.shape[2]
        # (B, S, H, L, K) and (B, S, G, L, K)
        query = query.view(batch, streams, *query.shape[1:])
        key, value = key.view(batch, streams, *key.shape[1:]), value.view(batch, streams, *value.shape[1:])
        history_keys, history_values = key[:, -1], value[:, -1]
        if past_key_values is not None:
            # (B, G, T + L, K)
            history_keys, history_values = past_key_values.update(
                history_keys, history_values, self.layer_idx
            )
        groups = self.num_key_value_groups
        history_keys, history_values = repeat_kv(history_keys, groups), repeat_kv(history_values, groups)
        own_keys = key.repeat_interleave(groups, dim=2)
        own_values = value.repeat_interleave(groups, dim=2)
        # (B, S, H, L, T + L): earlier tokens only; the current token enters through its own key.
        scores = torch.einsum("bshlk,bhmk->bshlm", query, history_keys).float() * self.scaling
        past_length = history_keys.shape[2] - length
        current = torch.arange(length, device=query.device) + past_length
        earlier = attention_mask & (
            torch.arange(history_keys.shape[2], device=query.device) != current[:, None]
        )
        scores = scores.masked_fill(~earlier[:, None], torch.finfo(scores.dtype).min)
        own_scores = (query * own_keys).sum(-1, keepdim=True).float() * self.scaling  # (B, S, H, L, 1)
        weights = torch.softmax(torch.cat([scores, own_scores], dim=-1), dim=-1).to(query.dtype)
        weights = nn.functional.dropout(weights, p=self.attention_dropout, training=self.training)
        output = torch.einsum("bshlm,bhmk->bshlk", weights[..., :-1], history_values)
        output = output + weights[..., -1:] * own_values
        if self.attention_recorder is not None:
            self.attention_recorder.record(self, own_key_in_place(weights, current))
        # (B·S, L, H·K)
        output = output.transpose(2, 3).reshape(batch * streams, length, -1)
        return self.o_proj(output), None


def own_key_in_place(weights: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """Shared-KV weights (B, S, H, L, T + L + 1), the last column the own key's -> (B·S, H, L, T + L) with
    the own key's weight at the current token's column (`current` (L,) its key index), where the history
    holds the final stream's key, masked out for every stream."""
    history, own = weights[..., :-1], weights[..., -1:]
    index = current.view(1, 1, 1, -1, 1).expand(*own.shape)
    merged = history.scatter_add(-1, index, own)
    return merged.flatten(0, 1)


class StreamDecoderLayer(DecoderLayer):
    """`DecoderLayer` with its stream attention kind; shared-KV intra layers swap in `SharedKVAttention`."""

    def __init__(self, config: HiddenDecodingConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.stream_kind = config.stream_attention_layout[layer_idx]
        if self.stream_kind == "intra" and config.stream_kv == "shared":
            self.self_attn = SharedKVAttention(config, layer_idx)
            self.self_attn.num_streams = config.num_streams
        else:
            self.self_attn = StreamAttention(config, layer_idx)
            if self.stream_kind == "intra" and config.intra_window is not None:
                # Tokens of its own stream; the mask enforces it, kernels that take a window read it here.
                self.self_attn.sliding_window = config.intra_window


def final_query_mask(
    mask: torch.Tensor | None, length: int, streams: int, key_length: int, device: torch.device
) -> torch.Tensor | None:
    """The rows of an interleaved layer's mask that belong to final-stream queries, (B|1, 1, L, T').

    A None mask stood for "causal" over S·L queries ending at the last key; kept for one query (it sees
    every key), spelled out as a boolean mask for more (sdpa's `is_causal` would align L queries with the
    first L keys)."""
    if mask is not None:
        return mask[:, :, streams - 1 :: streams]
    if length == 1:
        return None
    past = key_length - length * streams
    # Query j sits at key index past + j·S + S - 1 and sees the keys up to it.
    last_seen = past + torch.arange(length, device=device) * streams + streams - 1
    return (torch.arange(key_length, device=device)[None, :] <= last_seen[:, None])[None, None]


def widen_token_mask(token_mask: torch.Tensor | None, streams: int) -> torch.Tensor:
    """(B, 1, L, T) per-token mask (boolean or additive) -> (B, 1, L·S, T·S): each entry repeated for the
    S query slots and the S key slots of its tokens."""
    if not torch.is_tensor(token_mask) or token_mask.dim() != 4:
        raise ValueError(
            "cross_stream_mask='token_block' needs a 4-D tensor mask per token (sdpa or eager attention); "
            f"masking_utils gave {type(token_mask).__name__}"
        )
    return token_mask.repeat_interleave(streams, dim=2).repeat_interleave(streams, dim=3)
