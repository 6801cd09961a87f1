"""LSLM generation over a `SegmentCache` (modeling_lslm's module docstring, "Generation"): the parallel pass
fills the cache, then `step` advances it one input column. `SegmentCacheSteps` is a mixin of `LSLMModel`:
it uses the model's embeddings, stages, router and `config`."""

from __future__ import annotations

import torch

from .boundary_rules import crosses, rate_units, running_units
from .lslm_layout import ByteView, always_closing, document_causal_mask
from .pooling import pool_open_chunk
from .segment_cache import SegmentCache


class SegmentCacheSteps:
    """`LSLMModel`'s generation methods."""

    # Generation: the parallel pass fills a SegmentCache, then `step` advances it one input column.

    def fill_cache(self, cache: SegmentCache, view: ByteView, token_states, segmentation, segments) -> None:
        """Complete `cache` after a parallel pass over one document per row (its token-encoder K/V and
        segment-encoder K/V were stored during the pass): cross K/V, the open segment, decoder K/V."""
        closed = cache.segment_store.lengths  # the closed-segment count, set before the pass
        count = (segmentation.index.max(dim=1).values + 1).clamp(min=0)
        cache.token_valid, cache.byte_counts = view.mask, view.mask.sum(dim=1)
        special = always_closing(view.ids, self.config)
        cache.rate_units = running_units(segmentation.probs, view.mask & ~special, view.starts)
        table = torch.cat(
            [self.null_segment.to(segments.dtype).expand(segments.shape[0], 1, -1), segments], 1
        )
        cache.cross_store.fill(closed + 1)
        for layer in self.decoder_layers:
            cache.cross_store.update(*layer.cross_attn.project_segments(table), layer.layer_idx)
        # The open segment's bytes, left-aligned (the view's bytes sit at the right end of each row).
        in_open = view.mask & (segmentation.index == (count - 1)[:, None]) & (closed < count)[:, None]
        cache.open_counts = in_open.sum(dim=1)
        width = int(cache.open_counts.max()) if in_open.numel() else 0
        order = torch.sort((~in_open).long(), dim=1, stable=True).indices[:, :width]
        cache.open_states = torch.gather(
            token_states, 1, order[..., None].expand(-1, -1, token_states.shape[-1])
        )
        ids = torch.gather(view.ids, 1, order)
        ids = torch.cat([ids.new_full((ids.shape[0], 1), self.config.segment_start_token_id), ids], dim=1)
        lengths = cache.open_counts + 1
        self.run_decoder_slots(cache, ids, lengths)

    def run_decoder_slots(self, cache: SegmentCache, ids: torch.Tensor, lengths: torch.Tensor) -> None:
        """Fill the decoder store with (B, n) left-aligned slots [`<bos>`, open bytes] of `lengths` each."""
        store = cache.decoder_store
        store.fill(lengths)
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        valid = positions < lengths[:, None]
        self_allowed = document_causal_mask(valid, valid.long())
        states = self.decoder_embed_tokens(ids)
        rope = self.decoder_rotary_emb(states, positions)
        self.decoder_pass(cache, states, self_allowed, rope)

    def decoder_pass(self, cache: SegmentCache, states, self_allowed, rope) -> torch.Tensor:
        """Decoder layers over new slots, self K/V into the decoder store, cross K/V from the cross store."""
        cross = cache.cross_store
        cross_allowed = cross.allowed()[:, None, :].expand(-1, states.shape[1], -1)
        width = cross_allowed.shape[-1]
        for layer in self.decoder_layers:
            keys = cross.keys[layer.layer_idx][:, :, :width]
            values = cross.values[layer.layer_idx][:, :, :width]
            states, _ = layer(
                states,
                keys,
                values,
                cross_allowed,
                attention_mask=self_allowed,
                position_embeddings=rope,
                past_key_values=cache.decoder_store,
            )
        return self.decoder_norm(states)

    def step(self, input_ids: torch.Tensor, real: torch.Tensor, cache: SegmentCache) -> torch.Tensor:
        """One input column: (B,) ids and (B,) real flags -> (B, Dd) normed decoder state of its logits.

        A byte feeds the token encoder and the router; it closes its segment when the router (or `<BoS>`
        / `<eos>`) says so, a marker closes any open segment; after a close the decoder restarts at
        `<bos>` with one more segment to read. Pads (real = False) change nothing.
        """
        config = self.config
        is_marker = real & (
            (input_ids == config.segment_start_token_id) | (input_ids == config.segment_end_token_id)
        )
        is_byte = real & ~is_marker
        token_states = self.token_step(input_ids, is_byte, cache)  # (B, Dt)
        probs = torch.sigmoid(self.router(token_states[:, None]))[:, 0]
        special = always_closing(input_ids, config)
        content_ends = is_byte & (self.step_decisions(probs, is_byte & ~special, cache) | special)
        cache.push_open_states(token_states, is_byte)
        closing = content_ends | (is_marker & (cache.open_counts > 0))
        if bool(closing.any()):
            self.close_segments(cache, closing)
        restart = closing | is_marker
        store = cache.decoder_store
        store.reset(restart)
        ids = torch.where(restart, config.segment_start_token_id, input_ids)[:, None]
        states = self.decoder_embed_tokens(ids)
        rope = self.decoder_rotary_emb(states, store.lengths[:, None])
        store.begin(real)
        states = self.decoder_pass(cache, states, store.allowed()[:, None, None, :], rope)
        store.end()
        cache.items += 1
        return states[:, 0]

    def step_decisions(self, probs: torch.Tensor, counted: torch.Tensor, cache: SegmentCache) -> torch.Tensor:
        """(B,) the inference rule for one column, advancing the cache's running sum ("rate")."""
        if self.config.boundary_rule != "rate":
            return (probs >= self.config.boundary_threshold) & counted
        units = rate_units(probs, counted)
        previous = cache.rate_units
        cache.rate_units = previous + units
        return crosses(previous, cache.rate_units) & counted

    def token_step(self, input_ids: torch.Tensor, is_byte: torch.Tensor, cache: SegmentCache) -> torch.Tensor:
        """Token encoder over one column; non-byte rows leave an unattended hole. -> (B, Dt)."""
        valid = torch.cat([cache.token_valid, is_byte[:, None]], dim=1)
        allowed = valid.clone()
        allowed[:, -1] = True  # a non-byte row reads at least itself (unused, finite)
        states = self.embed_tokens(input_ids[:, None])
        rope = self.token_rotary_emb(states, cache.byte_counts[:, None])
        for layer in self.token_layers:
            states, _ = layer(
                states,
                attention_mask=allowed[:, None, None, :],
                position_embeddings=rope,
                past_key_values=cache,
            )
        cache.token_valid = valid
        cache.byte_counts = cache.byte_counts + is_byte.long()
        return self.token_norm(states)[:, 0]

    def close_segments(self, cache: SegmentCache, closing: torch.Tensor) -> None:
        """Pool the open segment of the `closing` (B,) rows, encode it, append its cross K/V."""
        # (B, 1, Dt); rows with nothing open pool to zeros, unused
        pooled = pool_open_chunk(cache.open_states, cache.open_counts, self.config.pooling)
        if self.segment_in_proj is not None:
            pooled = self.segment_in_proj(pooled)
        store = cache.segment_store
        rope = self.rotary_emb(pooled, store.lengths[:, None])
        store.begin(closing)
        allowed = store.allowed()[:, None, None, :]
        states = pooled
        for layer in self.segment_layers:
            states, _ = layer(states, attention_mask=allowed, position_embeddings=rope, past_key_values=store)
        store.end()
        states = self.segment_norm(states)
        cache.cross_store.begin(closing)
        for layer in self.decoder_layers:
            cache.cross_store.update(*layer.cross_attn.project_segments(states), layer.layer_idx)
        cache.cross_store.end()
        cache.open_counts = cache.open_counts.masked_fill(closing, 0)
