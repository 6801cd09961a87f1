"""Hidden Decoding written the slow, obvious way: one interleaved sequence and an explicit mask per layer.

Legend: B batch, L tokens, S streams, D width, H heads, K head dim; the expanded sequence has S·L
positions, position t holding token t // S, stream t % S.

`reference_logits(model, input_ids, attention_mask, position_ids)` recomputes a
`HiddenDecodingForCausalLM`'s logits with the model's own weights but none of its fast paths: no folding of
streams into the batch, no cache, no masking_utils. Each layer attends over all S·L positions through a
dense (S·L) x (S·L) boolean mask built from the definitions (HD eq. 4, §5.2; docs/ARCHITECTURE.md, §3.3):
- intra: same stream, earlier or equal token, fewer than `intra_window` tokens back when set; RoPE at
  p·S + k ("expanded") or p ("token");
- shared-KV intra: itself, plus the final stream of earlier tokens;
- local: earlier or equal expanded position, fewer than `sliding_window` positions back;
- full: earlier or equal expanded position;
- under `cross_stream_mask="token_block"`, local and full: any stream of an earlier or equal token, for
  local fewer than `sliding_window / S` tokens back; RoPE at p·S + k or p (`cross_stream_positions`);
always within the same document (position ids restart at 0) and over real tokens only. The head reads
each token's final stream, or the sum of its streams under `stream_supervision="sum"`.
"""

from __future__ import annotations

import torch

from hf_concept.modeling.layers import apply_rotary, repeat_kv


def _token_layout(attention_mask: torch.Tensor, position_ids: torch.Tensor):
    """(B, L) document ids (a new one wherever the position id does not continue) and real flags."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.long().cumsum(1), attention_mask.bool()


def stream_mask(
    kind: str,
    num_streams: int,
    documents,
    real,
    sliding_window=None,
    shared=False,
    intra_window=None,
    token_block=False,
):
    """(B, S·L, S·L) boolean: may expanded position t attend to t'?"""
    length = documents.shape[1]
    expanded = torch.arange(length * num_streams)
    token, stream = expanded // num_streams, expanded % num_streams
    causal = expanded[None, :] <= expanded[:, None]
    back = token[:, None] - token[None, :]
    if kind != "intra" and token_block:
        allowed = back >= 0
        if kind == "local":
            allowed = allowed & (back < sliding_window // num_streams)
    elif kind == "intra" and shared:
        final_earlier = (stream[None, :] == num_streams - 1) & (token[None, :] < token[:, None])
        allowed = (expanded[None, :] == expanded[:, None]) | final_earlier
    elif kind == "intra":
        allowed = causal & (stream[None, :] == stream[:, None])
        if intra_window is not None:
            allowed = allowed & (token[:, None] - token[None, :] < intra_window)
    elif kind == "local":
        allowed = causal & (expanded[:, None] - expanded[None, :] < sliding_window)
    else:
        allowed = causal
    same_document = documents[:, token][:, :, None] == documents[:, token][:, None, :]
    real_key = real[:, token][:, None, :]
    # The diagonal stays allowed so that pad queries (whose outputs are ignored) stay finite.
    diagonal = torch.eye(length * num_streams, dtype=torch.bool)[None]
    return (allowed[None] & same_document & real_key) | diagonal


def _attention(attn, states, cos, sin, mask):
    """Plain softmax attention of one `Attention` module over (B, N, D) states with a (B, N, N) mask."""
    query, key, value = attn.project(states)
    query, key = apply_rotary(query, key, cos, sin)
    key = repeat_kv(key, attn.num_key_value_groups)
    value = repeat_kv(value, attn.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)).float() * attn.scaling
    scores = scores.masked_fill(~mask[:, None], torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1).to(value.dtype)
    output = torch.matmul(weights, value).transpose(1, 2).reshape(*states.shape[:2], -1)
    return attn.o_proj(output)


@torch.no_grad()
def reference_logits(model, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
    """(B, L, V) logits of a `HiddenDecodingForCausalLM`, recomputed from the definitions."""
    config, backbone = model.config, model.model
    streams, width = config.num_streams, config.hidden_size
    batch, length = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
    position_ids = position_ids.expand(batch, -1)
    documents, real = _token_layout(attention_mask, position_ids)
    # (B, S·L, D): token i's stream k at i·S + k.
    states = backbone.embed_tokens(input_ids).view(batch, length * streams, width)
    stream = torch.arange(streams).repeat(length)
    expanded_positions = position_ids.repeat_interleave(streams, dim=1) * streams + stream
    token_positions = position_ids.repeat_interleave(streams, dim=1)
    for layer in backbone.layers:
        kind = layer.stream_kind
        field = config.intra_stream_positions if kind == "intra" else config.cross_stream_positions
        positions = token_positions if field == "token" else expanded_positions
        cos, sin = backbone.rotary_emb(states, positions)
        mask = stream_mask(
            kind,
            streams,
            documents,
            real,
            config.sliding_window,
            shared=config.stream_kv == "shared",
            intra_window=config.intra_window,
            token_block=config.cross_stream_mask == "token_block",
        )
        states = states + _attention(layer.self_attn, layer.input_layernorm(states), cos, sin, mask)
        mixed = layer.mlp(layer.post_attention_layernorm(states))
        states = states + (mixed[0] if isinstance(mixed, tuple) else mixed)
    # (B, L, S, D): the head reads the final stream, or under "sum" supervision the streams' sum (§5.1).
    per_stream = states.view(batch, length, streams, width)
    final = per_stream.sum(dim=2) if config.stream_supervision == "sum" else per_stream[:, :, -1]
    return model.lm_head(backbone.norm(final)).float()
