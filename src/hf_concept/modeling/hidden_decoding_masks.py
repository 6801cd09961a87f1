"""Hidden Decoding's attention masks: one pure function per layer kind, built by transformers'
`masking_utils` (so every attention kernel gets the form it wants) in the view that kind attends in.

- "full" / "local" layers, `cross_stream_mask="causal"` (the paper's form): the interleaved view of
  (B, L·S) slots, token-major (slot p·S + k is stream k of token p); causal over slots, and for local
  layers a sliding window of `config.sliding_window` slots (`interleaved_masks`).
- the same layers, `cross_stream_mask="token_block"`: a causal (or windowed, in whole tokens) mask per
  token, widened to S slots on both sides, so every stream of token i sees every stream of tokens <= i
  (`token_block_masks`).
- "intra" layers: each stream over its own tokens in the folded view (B·S, L), causal, windowed by
  `intra_window` tokens when set (`intra_mask`); with `stream_kv="shared"` one boolean (B, 1, L, T + L)
  mask over tokens that the shared-KV attention applies itself.

Each function reads the mask inputs as `masking_utils` does: `like` only for its dtype and device, the
2-D `attention_mask` (or None), the (B, L) `position_ids` (packed documents restart them) and the cache
sizing the keys (`cache` None: no past). `stream_masks` picks the functions a config's layout needs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from .hidden_decoding_cache import TokenUnits
from .hidden_decoding_layers import widen_token_mask
from .hidden_decoding_streams import expand_attention_mask, expand_position_ids
from .transformers_compat import cache_kwarg


@dataclass
class StreamMasks:
    """One attention mask per stream attention kind, in the form the current kernel wants."""

    intra: Any = None
    local: Any = None
    full: Any = None


def _probe(like: torch.Tensor, rows: int, positions: int) -> torch.Tensor:
    """What masking_utils reads of `inputs_embeds`: the batch size, query length, dtype and device."""
    return like.new_empty(rows, positions, 0)


def interleaved_masks(config, like: torch.Tensor, attention_mask, position_ids, cache) -> tuple[Any, Any]:
    """(full, local) masks over the interleaved (B, L·S) slots: causal over slots; local layers a sliding
    window of `config.sliding_window` slots. None for a kind the layout does not have."""
    layout, streams = config.stream_attention_layout, config.num_streams
    batch, length = position_ids.shape
    common = dict(
        config=config,
        inputs_embeds=_probe(like, batch, length * streams),
        attention_mask=None if attention_mask is None else expand_attention_mask(attention_mask, streams),
        position_ids=expand_position_ids(position_ids, streams),
        **cache_kwarg(cache),
    )
    full = create_causal_mask(**common, layer_idx=layout.index("full")) if "full" in layout else None
    local = None
    if "local" in layout:
        local = create_sliding_window_causal_mask(**common, layer_idx=layout.index("local"))
    return full, local


def token_block_masks(config, like: torch.Tensor, attention_mask, position_ids, cache) -> tuple[Any, Any]:
    """(full, local) token-block masks: per token (causal; local: `local_window` whole tokens), sized by
    the cache in tokens, then widened to S slots per token on both sides (`widen_token_mask`)."""
    layout, streams = config.stream_attention_layout, config.num_streams
    batch, length = position_ids.shape
    common = dict(
        inputs_embeds=_probe(like, batch, length),
        attention_mask=attention_mask,
        position_ids=position_ids,
        **cache_kwarg(None if cache is None else TokenUnits(cache)),
        # A skipped mask would mean "causal over slots", which the token blocks are not.
        allow_is_causal_skip=False,
    )
    full = local = None
    if "full" in layout:
        full = widen_token_mask(
            create_causal_mask(config=config, layer_idx=layout.index("full"), **common), streams
        )
    if "local" in layout:
        window_config = copy.copy(config)
        window_config.sliding_window = config.local_window_tokens
        token_mask = create_sliding_window_causal_mask(
            config=window_config, layer_idx=layout.index("local"), **common
        )
        local = widen_token_mask(token_mask, streams)
    return full, local


def intra_mask(config, like: torch.Tensor, attention_mask, position_ids, cache) -> Any:
    """The intra layers' mask: per stream over its own tokens, (B·S, L) rows folded stream-major, causal,
    windowed by `intra_window` tokens when set; with `stream_kv="shared"` a boolean (B, 1, L, T + L)
    mask over tokens, which `SharedKVAttention` applies to the scores it computes itself."""
    layout, streams = config.stream_attention_layout, config.num_streams
    batch, length = position_ids.shape
    common = dict(layer_idx=layout.index("intra"), **cache_kwarg(cache))
    if config.stream_kv == "shared":
        return create_causal_mask(
            config=SimpleNamespace(_attn_implementation="sdpa"),
            inputs_embeds=_probe(like, batch, length),
            attention_mask=attention_mask,
            position_ids=position_ids,
            allow_is_causal_skip=False,
            **common,
        )
    windowed = config.intra_window is not None
    mask_config = config
    if windowed:
        # masking_utils reads the window from config.sliding_window: give it the intra one (tokens).
        mask_config = copy.copy(config)
        mask_config.sliding_window = config.intra_window
    build = create_sliding_window_causal_mask if windowed else create_causal_mask
    return build(
        config=mask_config,
        inputs_embeds=_probe(like, batch * streams, length),
        attention_mask=None if attention_mask is None else attention_mask.repeat_interleave(streams, 0),
        position_ids=position_ids.repeat_interleave(streams, 0),
        **common,
    )


def stream_masks(config, like: torch.Tensor, attention_mask, position_ids, cache) -> StreamMasks:
    """The masks a config's `stream_attention_layout` needs, built before the cache is updated."""
    if attention_mask is None and cache is not None and cache.get_seq_length() == 0:
        # An empty cache sizes the mask like no cache, but its presence would stop masking_utils from
        # detecting packed documents in `position_ids`.
        cache = None
    layout = config.stream_attention_layout
    masks = StreamMasks()
    if config.cross_stream_mask == "token_block":
        masks.full, masks.local = token_block_masks(config, like, attention_mask, position_ids, cache)
    elif "full" in layout or "local" in layout:
        masks.full, masks.local = interleaved_masks(config, like, attention_mask, position_ids, cache)
    if "intra" in layout:
        masks.intra = intra_mask(config, like, attention_mask, position_ids, cache)
    return masks
