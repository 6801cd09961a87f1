"""LSLM's segment layout written with loops: one segment, one document at a time.

`reference_logits(model, input_ids, position_ids)` recomputes an `LSLMForCausalLM`'s per-token logits and
decoder loss for ONE row (no padding; packed documents allowed) with the model's own weights, token
encoder and boundary decisions (eval mode, so decisions are deterministic and the straight-through
factor is exactly 1), but none of its vectorised bookkeeping: segments are Python lists, each document's
segments run through the segment encoder alone, and each segment runs through the decoder alone as
[`<bos>`, its tokens] with cross-attention to [null] + the encoded segments before it in its document.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_concept.modeling.packing import document_starts


def _segments_of(ends: list[bool], starts: list[bool]) -> list[list[int]]:
    """Token positions of each segment, in order; a document start always opens one."""
    segments: list[list[int]] = []
    open_segment: list[int] = []
    for position, (ended, starting) in enumerate(zip(ends, starts, strict=True)):
        if starting and open_segment:
            segments.append(open_segment)
            open_segment = []
        open_segment.append(position)
        if ended:
            segments.append(open_segment)
            open_segment = []
    if open_segment:
        segments.append(open_segment)
    return segments


def _pool(token_states: torch.Tensor, positions: list[int], pooling: str) -> torch.Tensor:
    rows = token_states[positions]
    if pooling == "mean":
        return rows.mean(dim=0)
    hops = int(pooling.split(":")[1])
    return rows[-(hops + 1) :].sum(dim=0)


def _run(layers, states: torch.Tensor, rope_module, positions: torch.Tensor, extra=None) -> torch.Tensor:
    """Layers over one (1, n, ·) sequence with an explicit causal boolean mask."""
    length = states.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    if layers and layers[0].self_attn.config._attn_implementation == "eager":
        causal = torch.zeros(causal.shape, dtype=states.dtype).masked_fill(
            ~causal, torch.finfo(states.dtype).min
        )
    rope = rope_module(states, positions[None])
    for layer in layers:
        if extra is None:
            states, _ = layer(states, attention_mask=causal, position_embeddings=rope)
        else:
            states, _ = layer(states, *extra, attention_mask=causal, position_embeddings=rope)
    return states


@torch.no_grad()
def reference_logits(model, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None):
    """((T, V) per-token logits, decoder cross-entropy in nats per target) for a (1, T) row."""
    config, backbone = model.config, model.model
    length = input_ids.shape[1]
    mask = torch.ones_like(input_ids, dtype=torch.bool)
    if position_ids is None:
        position_ids = torch.arange(length)[None]
    starts = document_starts(mask, position_ids)
    token_states = backbone.encode_tokens(input_ids, None, position_ids)
    ends = backbone.segment(input_ids, token_states, mask, starts).ends[0].tolist()
    ids, starts_list = input_ids[0].tolist(), starts[0].tolist()
    segments = _segments_of(ends, starts_list)
    documents = torch.cumsum(starts[0].long(), 0).tolist()
    encoded: dict[int, torch.Tensor] = {}
    for document in sorted(set(documents)):
        members = [index for index, seg in enumerate(segments) if documents[seg[0]] == document]
        pooled = torch.stack([_pool(token_states[0], segments[index], config.pooling) for index in members])
        if backbone.segment_in_proj is not None:
            pooled = backbone.segment_in_proj(pooled)
        states = _run(backbone.segment_layers, pooled[None], backbone.rotary_emb, torch.arange(len(members)))
        for ordinal, index in enumerate(members):
            encoded[index] = backbone.segment_norm(states[0, ordinal])
    slot_logits: list[torch.Tensor] = []
    for index, seg in enumerate(segments):
        earlier = [encoded[k] for k in range(index) if documents[segments[k][0]] == documents[seg[0]]]
        table = torch.stack([backbone.null_segment, *earlier])[None]
        slot_ids = torch.tensor([[config.segment_start_token_id] + [ids[p] for p in seg]])
        states = backbone.decoder_embed_tokens(slot_ids)
        allowed = torch.ones(1, slot_ids.shape[1], table.shape[1], dtype=torch.bool)
        states = _run(
            backbone.decoder_layers,
            states,
            backbone.decoder_rotary_emb,
            torch.arange(slot_ids.shape[1]),
            extra=(table, allowed),
        )
        slot_logits.append(model.lm_head(backbone.decoder_norm(states))[0])
    return _token_logits(ids, ends, starts_list, segments, slot_logits), _loss(
        ids, ends, segments, slot_logits, config
    )


def _token_logits(ids, ends, starts, segments, slot_logits) -> torch.Tensor:
    """Token t: its own slot, or the next segment's `<bos>` slot after it closes a segment (same document)."""
    where = {}
    for index, seg in enumerate(segments):
        for offset, position in enumerate(seg):
            where[position] = (index, offset + 1)
    rows = []
    for position in range(len(ids)):
        index, slot = where[position]
        next_in_document = position + 1 < len(ids) and not starts[position + 1]
        if ends[position] and next_in_document:
            index, slot = index + 1, 0
        rows.append(slot_logits[index][slot])
    return torch.stack(rows)


def _loss(ids, ends, segments, slot_logits, config) -> torch.Tensor:
    """Mean cross-entropy over the decoder's targets (the module docstring of modeling_lslm)."""
    total, count = 0.0, 0
    for index, seg in enumerate(segments):
        if ids[seg[0]] == config.bos_token_id:
            continue
        targets = [ids[p] for p in seg]
        last = seg[-1]
        if ends[last] and ids[last] != config.eos_token_id:
            targets.append(config.segment_end_token_id)
        for slot, target in enumerate(targets):
            if slot > 0 and ids[seg[slot - 1]] == config.eos_token_id:
                continue
            total = total + F.cross_entropy(slot_logits[index][slot].float()[None], torch.tensor([target]))
            count += 1
    return total / max(count, 1)
