"""LSLM generation over a `SegmentCache` (modeling_lslm's module docstring, "Generation"): the parallel pass
fills the cache, then `step` advances it one input column. `SegmentCacheSteps` is a mixin of `LSLMModel`:
it uses the model's embeddings, stages, router and `config`.

`SegmentMarkerGeneration` (a mixin of `LSLMForCausalLM`): transformers' loop feeds each generated id back,
and the `<nxt>`/`<bos>` markers the model writes must go back in (they close segments, and a full
recomputation reads them), so `generate` returns them as the special tokens they are, and only what a
streamer receives is filtered to bytes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.generation.streamers import BaseStreamer

from .lslm_boundary_rules import crosses, rate_units, running_units, source_ends
from .lslm_layout import ByteView, always_closing, document_causal_mask
from .lslm_segment_cache import SegmentCache
from .pooling import pool_open_chunk
from .transformers_compat import cache_kwarg


def stack_step_attentions(steps: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """Per-column `attentions` of Q cached steps -> one tuple of (B, H, Q, K') entries: row q is column q's
    own (B, H, 1, K_q) weights, zero-padded on the right to the widest K' (each column attends over
    the keys stored by then; what a one-column call returns for it is row q up to K_q)."""
    stacked = []
    for per_column in zip(*steps, strict=True):
        width = max(weights.shape[-1] for weights in per_column)
        padded = [F.pad(weights, (0, width - weights.shape[-1])) for weights in per_column]
        stacked.append(torch.cat(padded, dim=-2))
    return tuple(stacked)


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
        if self.segment_to_decoder is not None:
            # The latest closed segment (table row `closed`; row 0, the null segment, when none).
            latest = torch.gather(table, 1, closed[:, None, None].expand(-1, 1, table.shape[-1]))
            cache.latest_segment = self.segment_to_decoder(latest)[:, 0]  # (B, Dd)
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
        states = self.with_latest_segment(cache, self.decoder_embed_tokens(ids))
        rope = self.decoder_rotary_emb(states, positions)
        self.decoder_pass(cache, states, self_allowed, rope)

    def with_latest_segment(self, cache: SegmentCache, states: torch.Tensor) -> torch.Tensor:
        """(B, n, Dd) decoder inputs plus each row's latest segment (`decoder_latest_segment`)."""
        if self.segment_to_decoder is None:
            return states
        return states + cache.latest_segment[:, None].to(states.dtype)

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
                **cache_kwarg(cache.decoder_store),
            )
        return self.decoder_norm(states)

    def step(
        self,
        input_ids: torch.Tensor,
        real: torch.Tensor,
        cache: SegmentCache,
        layer_states: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One input column: (B,) ids and (B,) real flags -> (B, Dd) normed decoder state of its logits.

        A byte feeds the token encoder and the router; it closes its segment when the router (or `<BoS>`
        / `<eos>`) says so, a marker closes any open segment; after a close the decoder restarts at
        `<bos>` with one more segment to read. Pads (real = False) change nothing. `layer_states` (when
        given) receives the column's hidden states (`token_step`).
        """
        config = self.config
        is_marker = real & (
            (input_ids == config.segment_start_token_id) | (input_ids == config.segment_end_token_id)
        )
        is_byte = real & ~is_marker
        token_states = self.token_step(input_ids, is_byte, cache, layer_states)  # (B, Dt)
        probs = torch.sigmoid(self.router(token_states[:, None]))[:, 0]
        special = always_closing(input_ids, config)
        content_ends = is_byte & (self.step_decisions(probs, is_byte & ~special, cache) | special)
        cache.push_open_states(token_states, is_byte)
        closing = content_ends | (is_marker & (cache.open_counts > 0))
        if bool(closing.any()):
            self.close_segments(cache, closing)
        else:
            self.record_no_segment(cache, token_states)
        restart = closing | is_marker
        store = cache.decoder_store
        store.reset(restart)
        ids = torch.where(restart, config.segment_start_token_id, input_ids)[:, None]
        states = self.with_latest_segment(cache, self.decoder_embed_tokens(ids))
        rope = self.decoder_rotary_emb(states, store.lengths[:, None])
        store.begin(real)
        states = self.decoder_pass(cache, states, store.allowed()[:, None, None, :], rope)
        store.end()
        cache.items += 1
        return states[:, 0]

    def step_rows(
        self,
        entries: tuple[torch.Tensor, ...],
        input_ids: torch.Tensor,
        real: torch.Tensor,
        closes: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """One step's (B, ·, 1, K) attention entries with the rows the parallel pass leaves at zero
        (`lslm_attention_layout`) zeroed too: token-encoder rows of non-bytes, segment-encoder
        rows that close nothing (`closes` (B,)), decoder rows of pads."""
        config = self.config
        is_marker = (input_ids == config.segment_start_token_id) | (input_ids == config.segment_end_token_id)
        token, segment = len(self.token_layers), len(self.segment_layers)
        kept = []
        for number, weights in enumerate(entries):
            rows = real & ~is_marker if number < token else (closes if number < token + segment else real)
            kept.append(weights * rows[:, None, None, None].to(weights.dtype))
        return tuple(kept)

    def step_decisions(self, probs: torch.Tensor, counted: torch.Tensor, cache: SegmentCache) -> torch.Tensor:
        """(B,) the inference rule for one column, advancing the cache's running sum ("rate")."""
        if self.config.boundary_source != "router":
            # `token_step` has counted this byte: its rank in the row's document is one less.
            return source_ends(self.config, cache.byte_counts - 1) & counted
        if self.config.boundary_rule != "rate":
            return (probs >= self.config.boundary_threshold) & counted
        units = rate_units(probs, counted)
        previous = cache.rate_units
        cache.rate_units = previous + units
        return crosses(previous, cache.rate_units) & counted

    def token_step(
        self,
        input_ids: torch.Tensor,
        is_byte: torch.Tensor,
        cache: SegmentCache,
        layer_states: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Token encoder over one column; non-byte rows leave an unattended hole. -> (B, Dt).

        `layer_states` (when given) receives the input of each layer and the normed output, (B, Dt)
        each, zero in non-byte rows: the parallel pass's `hidden_states` at this column."""
        valid = torch.cat([cache.token_valid, is_byte[:, None]], dim=1)
        allowed = valid.clone()
        allowed[:, -1] = True  # a non-byte row reads at least itself (unused, finite)
        states = self.embed_tokens(input_ids[:, None])
        rope = self.token_rotary_emb(states, cache.byte_counts[:, None])
        keep = is_byte[:, None].to(states.dtype)  # (B, 1)
        for layer in self.token_layers:
            if layer_states is not None:
                layer_states.append(states[:, 0] * keep)
            states, _ = layer(
                states,
                attention_mask=allowed[:, None, None, :],
                position_embeddings=rope,
                **cache_kwarg(cache),
            )
        cache.token_valid = valid
        cache.byte_counts = cache.byte_counts + is_byte.long()
        states = self.token_norm(states)[:, 0]
        if layer_states is not None:
            layer_states.append(states * keep)
        return states

    def record_no_segment(self, cache: SegmentCache, like: torch.Tensor) -> None:
        """While attentions are recorded, a step that closes no segment still gives each segment-encoder
        layer its entry: zero weights (B, H, 1, M') over the stored segments (no row reads them), so
        every step's `attentions` holds tensors only (assisted decoding slices each entry)."""
        width = cache.segment_store.width()
        for layer in self.segment_layers:
            recorder = layer.self_attn.attention_recorder
            if recorder is not None:
                heads = self.config.num_attention_heads
                recorder.record(layer.self_attn, like.new_zeros(like.shape[0], heads, 1, width))

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
            states, _ = layer(states, attention_mask=allowed, position_embeddings=rope, **cache_kwarg(store))
        store.end()
        states = self.segment_norm(states)
        cache.cross_store.begin(closing)
        for layer in self.decoder_layers:
            cache.cross_store.update(*layer.cross_attn.project_segments(states), layer.layer_idx)
        cache.cross_store.end()
        if self.segment_to_decoder is not None:
            # A new tensor, never written in place: a rollback snapshot may hold the old one.
            cache.latest_segment = torch.where(
                closing[:, None], self.segment_to_decoder(states[:, 0]), cache.latest_segment
            )
        cache.open_counts = cache.open_counts.masked_fill(closing, 0)


class SegmentMarkerFilter(BaseStreamer):
    """Passes a streamer the prompt (the first `put`, unchanged), then the generated ids without markers:
    one row's markers are dropped (a `put` of markers only is skipped); in a batch, where every row gets
    one id per `put`, a marker becomes `pad_token_id`, as transformers streams a finished row."""

    def __init__(self, streamer: BaseStreamer, markers: torch.Tensor, pad_token_id: int) -> None:
        self.streamer, self.markers, self.pad_token_id = streamer, markers.cpu(), pad_token_id
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            self.streamer.put(value)
            return
        tokens = value if value.dim() > 1 else value[:, None]  # (B, n)
        is_marker = torch.isin(tokens, self.markers)
        if tokens.shape[0] == 1:
            kept = tokens[:, ~is_marker[0]]
        else:
            kept = tokens.masked_fill(is_marker, self.pad_token_id)[:, ~is_marker.all(dim=0)]
        if kept.shape[1]:
            self.streamer.put(kept if value.dim() > 1 else kept[:, 0])

    def end(self) -> None:
        self.streamer.end()


class SegmentMarkerGeneration:
    """`LSLMForCausalLM.generate`: transformers' `generate`, with a streamer that receives bytes only.

    The returned `sequences` keep the `<nxt>`/`<bos>` markers the model wrote, as the special tokens they
    are: one id per decoding step, so `scores`, `logits`, `attentions` and `hidden_states` line up with
    the returned tokens and `model(sequences)` recomputes them. `decode(skip_special_tokens=True)` and
    the text-generation pipeline drop the markers from text; a streamer gets them filtered out
    (`SegmentMarkerFilter`), since `TextStreamer` prints special tokens unless told otherwise."""

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: Any = None,
        *,
        streamer: BaseStreamer | None = None,
        **kwargs: Any,
    ) -> Any:
        """`GenerationMixin.generate`; a `streamer` receives the prompt, then the generated bytes."""
        settings = generation_config if generation_config is not None else self.generation_config
        if streamer is not None:
            pad = kwargs.get("pad_token_id", getattr(settings, "pad_token_id", None))
            pad = self.config.pad_token_id if pad is None else pad
            markers = torch.tensor([self.config.segment_start_token_id, self.config.segment_end_token_id])
            streamer = SegmentMarkerFilter(streamer, markers, pad)
        return super().generate(inputs, generation_config, streamer=streamer, **kwargs)
