"""The LSLM family: byte encoder -> ffn-gumbel boundaries -> pooled segments -> segment encoder -> segment
decoder (LSLM §2, DESIGN §4), in one parallel pass (training, full recomputation, generation's prefill)
and one input column at a time over a `SegmentCache` (generation).

Legend: B batch, T input tokens, M segments, S decoder slots (the bytes, one `<bos>` per segment and one
pending `<bos>` per document), Dt / D / Dd token-encoder / segment-encoder / decoder width, V vocabulary
(256 bytes and five specials, see tokenization_lslm).

Markers. `<nxt>` (the decoder's "segment ends here") and `<bos>` in the input are boundary signals, not
bytes: the token encoder never reads them (positions count bytes only), and a marker closes the open
segment, if any. So the `<nxt>` that generation writes into the sequence makes a full recomputation
segment exactly as the cached steps did.

Pass, per row (left padding and packed documents allowed):
1. token encoder over the row's bytes (causal within a document, at Dt);
2. boundaries z_t (byte t ends a segment): q_t = σ(sum FFN(h_t)); training samples σ(p̂ + g′ − g″) ≥ ½
   (a straight-through factor carries the gradient), inference thresholds q_t at `boundary_threshold`;
   `<BoS>`, `<eos>`, a byte before a marker and the last byte of a packed document always end a
   segment, pads never do;
3. segments pooled (`mean` or `hops:N`, the segment's own bytes only), times the straight-through factor
   of their closing byte, projected to D;
4. segment encoder (causal over the segments of a document; RoPE at the segment's ordinal);
5. decoder over slots: segment m is written as [`<bos>`, its bytes] and predicts [its bytes, `<nxt>`];
   self-attention within the segment (causal), cross-attention to the encoded segments before m in its
   document plus a learned null segment (so the first segment has something to read);
6. the ELBO: cross-entropy over the decoder's targets (bytes and `<nxt>`; nothing is predicted for
   `<BoS>`'s segment or after `<eos>`) + `kl_weight` · KL(Bernoulli(q_t) ‖ Bernoulli(prior_mean)) over the
   bytes whose boundary is not forced. `bits_per_byte` = the cross-entropy of byte targets alone / ln 2.

Per-token logits (the causal-LM interface) predict the input token after each column: the slot of the
column's byte while its segment is open; once the segment has closed (by the byte: router, `<BoS>`,
`<eos>`; or by a marker) the `<bos>` slot of the document's next segment. A document's last byte closes
its segment for the loss only, so a packed row gives its documents' logits. Causality: a slot reads bytes
of its own segment up to itself and segments that closed before its segment began, so logits at t depend
on tokens <= t only.

Generation (`step`): a byte feeds the token encoder (one K/V column) and the router; when its segment
closes (router, `<BoS>`/`<eos>`, or a marker), the open segment is pooled, run through the segment
encoder once (its K/V cached) and its cross-attention K/V are stored; the decoder's self-attention cache
then restarts at `<bos>`. The decoder therefore attends over one segment, never over the context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import ModelOutput

from .boundary_calibration import BoundaryCalibration
from .chunking import concept_attention_mask
from .concept_stack import ConfigView
from .configuration_lslm import LSLMConfig
from .forward_only_cache import adopt_cache
from .layers import DecoderLayer, RMSNorm, RotaryEmbedding, residual_body
from .lslm_layout import (
    ByteView,
    DecoderSlots,
    Segmentation,
    _first_id,
    _previous,
    _segment_starts,
    _with_pending_slots,
    byte_view,
    closed_segments,
    document_causal_mask,
    token_slots,
)
from .modeling_plain import default_position_ids, init_backbone_weights
from .packing import document_starts, token_mask
from .pooling import chunk_index, pool_concepts, pool_open_chunk
from .routing import bernoulli_kl_from_logits, decision_confidence, gumbel_sigmoid, sample_gumbel_noise
from .segment_cache import RaggedStore, SegmentCache
from .tokenization_lslm import BYTE_OFFSET


def stage_config(config: LSLMConfig, stage: str) -> ConfigView:
    """The config seen by the "token" encoder or the "decoder": its own width, heads and MLP width."""
    heads = getattr(config, f"{stage}_num_attention_heads")
    return ConfigView(
        config,
        hidden_size=getattr(config, f"{stage}_hidden_size"),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=config.stage_head_dim(stage),
        intermediate_size=getattr(config, f"{stage}_intermediate_size"),
    )


class BoundaryRouter(nn.Module):
    """The inference network q(z_t | x_<=t): p̂_t = sum of FFN(h_t) (ReLU FFN), LSLM eq. 2."""

    def __init__(self, width: int, intermediate: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(width, intermediate)
        self.fc_out = nn.Linear(intermediate, width)

    def forward(self, token_states: torch.Tensor) -> torch.Tensor:
        """(B, T, Dt) -> (B, T) float32 logits p̂_t."""
        return self.fc_out(F.relu(self.fc_in(token_states))).float().sum(dim=-1)


class SegmentCrossAttention(nn.Module):
    """Decoder slots (Dd) attend to encoded segments (D) and a null segment, under a boolean mask."""

    def __init__(self, config: LSLMConfig) -> None:
        super().__init__()
        self.num_heads = config.decoder_num_attention_heads
        self.head_dim = config.stage_head_dim("decoder")
        width, segment_width = config.decoder_hidden_size, config.hidden_size
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(segment_width, self.num_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(segment_width, self.num_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, width, bias=False)

    def project_segments(self, segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, M, D) segments -> keys and values (B, H, M, K), computed once per segment."""
        shape = (*segments.shape[:2], self.num_heads, -1)
        key = self.k_proj(segments).view(shape).transpose(1, 2)
        return key, self.v_proj(segments).view(shape).transpose(1, 2)

    def forward(
        self, slot_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """(B, S, Dd) slots, (B, H, M, K) keys/values of null + segments, (B, S, M) bool -> (B, S, Dd)."""
        batch, slots, _ = slot_states.shape
        query = self.q_proj(slot_states).view(batch, slots, self.num_heads, -1).transpose(1, 2)
        attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed[:, None])
        return self.o_proj(attended.transpose(1, 2).reshape(batch, slots, -1))


class SegmentDecoderLayer(DecoderLayer):
    """`DecoderLayer` at the decoder's width plus cross-attention to the segments before the slot's own."""

    def __init__(self, config: LSLMConfig, layer_idx: int) -> None:
        super().__init__(stage_config(config, "decoder"), layer_idx)
        width = config.decoder_hidden_size
        self.cross_attention_layernorm = RMSNorm(width, eps=config.rms_norm_eps)
        self.cross_attn = SegmentCrossAttention(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cross_keys: torch.Tensor,
        cross_values: torch.Tensor,
        cross_allowed: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values=None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        def cross(states: torch.Tensor) -> torch.Tensor:
            normed = self.cross_attention_layernorm(states)
            return self.cross_attn(normed, cross_keys, cross_values, cross_allowed)

        return residual_body(
            self,
            hidden_states,
            cross,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
        )


@dataclass
class LSLMCausalLMOutput(ModelOutput):
    """Per-token logits plus the ELBO's parts (detached metrics): `lm_loss` (decoder cross-entropy, nats
    per target), `kl_loss`, `boundary_rate` (segment ends per free byte: sampled in training,
    thresholded in eval), `expected_boundary_rate` (mean q_t), `threshold_boundary_rate` (share of q_t at
    or above `boundary_threshold`: inference's rate on the same bytes), `bits_per_byte`,
    `compression_ratio` (bytes per segment) and `boundaries` (B, T) bool, True where an input token opens
    a segment (DESIGN §3: b_t = 1; markers never open one)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    past_key_values: Cache | None = None
    lm_loss: torch.Tensor | None = None
    kl_loss: torch.Tensor | None = None
    boundary_rate: torch.Tensor | None = None
    expected_boundary_rate: torch.Tensor | None = None
    threshold_boundary_rate: torch.Tensor | None = None
    bits_per_byte: torch.Tensor | None = None
    compression_ratio: torch.Tensor | None = None
    boundaries: torch.Tensor | None = None


class LSLMPreTrainedModel(PreTrainedModel):
    """Shared class attributes and weight initialisation of the LSLM family."""

    config_class = LSLMConfig
    config: LSLMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules: ClassVar[list[str]] = ["DecoderLayer", "SegmentDecoderLayer"]
    _supports_flash_attn = False
    _supports_sdpa = True
    _supports_attention_backend = False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, LSLMModel):
            module.null_segment.normal_(0.0, self.config.initializer_range)
        else:
            init_backbone_weights(module, self.config.initializer_range)


class LSLMModel(LSLMPreTrainedModel):
    """Encoders, router and decoder of an LSLM; `forward` returns the decoder's slot states."""

    def __init__(self, config: LSLMConfig) -> None:
        super().__init__(config)
        config.check_fields()
        token_config, decoder_config = stage_config(config, "token"), stage_config(config, "decoder")
        token_width, width, decoder_width = (
            config.token_hidden_size,
            config.hidden_size,
            config.decoder_hidden_size,
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, token_width, config.pad_token_id)
        self.token_layers = nn.ModuleList(
            DecoderLayer(token_config, i) for i in range(config.token_encoder_layers)
        )
        self.token_norm = RMSNorm(token_width, eps=config.rms_norm_eps)
        self.router = BoundaryRouter(token_width, config.router_intermediate_size)
        self.segment_in_proj = nn.Linear(token_width, width, bias=False) if token_width != width else None
        first = config.token_encoder_layers
        self.segment_layers = nn.ModuleList(
            DecoderLayer(config, first + i) for i in range(config.segment_encoder_layers)
        )
        self.segment_norm = RMSNorm(width, eps=config.rms_norm_eps)
        self.null_segment = nn.Parameter(torch.zeros(width))
        self.decoder_embed_tokens = nn.Embedding(config.vocab_size, decoder_width, config.pad_token_id)
        first += config.segment_encoder_layers
        self.decoder_layers = nn.ModuleList(
            SegmentDecoderLayer(config, first + i) for i in range(config.decoder_layers)
        )
        self.decoder_norm = RMSNorm(decoder_width, eps=config.rms_norm_eps)
        self.token_rotary_emb = RotaryEmbedding.from_config(token_config)
        self.rotary_emb = RotaryEmbedding.from_config(config)
        self.decoder_rotary_emb = RotaryEmbedding.from_config(decoder_config)
        self.gradient_checkpointing = False
        # Not a buffer: a window of training posteriors, not weights (its result lives in the config).
        self.boundary_calibration = BoundaryCalibration()
        self.post_init()

    def new_cache(self) -> SegmentCache:
        """An empty `SegmentCache` for this model."""
        return SegmentCache(self.config.token_encoder_layers)

    def encode_tokens(self, view: ByteView, cache: SegmentCache | None = None) -> torch.Tensor:
        """(B, T, Dt) causal token states of the view's bytes (packed documents kept apart)."""
        states = self.embed_tokens(view.ids)
        mask = document_causal_mask(view.mask, view.documents)
        rope = self.token_rotary_emb(states, view.position_ids)
        for layer in self.token_layers:
            states, _ = layer(states, attention_mask=mask, position_embeddings=rope, past_key_values=cache)
        return self.token_norm(states)

    def segment(self, view: ByteView, token_states: torch.Tensor) -> Segmentation:
        """Boundaries (see the module docstring) and each byte's segment."""
        config, mask = self.config, view.mask
        logits = self.router(token_states)  # (B, T)
        probs = torch.sigmoid(logits)
        # The last byte of a document that another document follows in the row ends a segment.
        next_starts = F.pad(view.starts, (0, 1), value=False)[:, 1:]
        special = (view.ids == config.bos_token_id) | (view.ids == _first_id(config.eos_token_id))
        forced = (special | next_starts | view.marker_ends) & mask
        if self.training:
            # LSLM eq. 5-6: the Gumbel-sigmoid sample at ½ is a Bernoulli(q_t) draw.
            relaxed = gumbel_sigmoid(logits, *sample_gumbel_noise(tuple(logits.shape), device=logits.device))
            decided = relaxed >= 0.5
            self.calibrate(probs, mask & ~forced)
        else:
            relaxed = probs
            decided = probs >= config.boundary_threshold
        content_ends = (decided | special) & mask
        ends = content_ends | forced
        opens = (_previous(ends, False) | view.starts) & mask
        # Training only: the eval forward (and so generation's exactness) never sees the estimator.
        confidence = decision_confidence(relaxed, ends, mask & ~forced) if self.training else None
        index = chunk_index(opens, mask)
        return Segmentation(ends, logits, probs, forced, content_ends, index, opens, confidence)

    def calibrate(self, probs: torch.Tensor, free: torch.Tensor) -> None:
        """Training: move `boundary_threshold` to the rate-matching threshold of the recent posteriors
        (`boundary_calibration`), when `calibrate_boundary_threshold`."""
        if not self.config.calibrate_boundary_threshold:
            return
        self.boundary_calibration.observe(probs.detach()[free])
        threshold = self.boundary_calibration.threshold()
        if threshold is not None:
            self.config.boundary_threshold = threshold

    def encode_segments(
        self, token_states, segmentation: Segmentation, view: ByteView, store: RaggedStore | None = None
    ) -> tuple[torch.Tensor, ...]:
        """(B, M, D) encoded segments, their (B, M) validity and (B, M) document numbers."""
        if segmentation.confidence is not None:
            # Each byte enters its segment scaled by its decision's confidence (value 1): the LM loss
            # reaches the router at every byte, closing or not (`routing.decision_confidence`).
            token_states = token_states * segmentation.confidence[..., None].to(token_states.dtype)
        pooled, valid = pool_concepts(token_states, segmentation.opens, view.mask, self.config.pooling)
        num_segments = pooled.shape[1]
        if self.segment_in_proj is not None:
            pooled = self.segment_in_proj(pooled)
        segment_documents = torch.zeros_like(valid, dtype=torch.long)
        segment_documents.scatter_(1, segmentation.index.clamp(min=0), view.documents)
        first_of_document = torch.cummax(
            torch.where(
                _segment_starts(segment_documents, valid), torch.arange(num_segments, device=valid.device), 0
            ),
            dim=1,
        ).values
        ordinal = torch.arange(num_segments, device=valid.device) - first_of_document  # (B, M)
        attention = concept_attention_mask(valid, segment_documents, ordinal, num_segments, None)
        rope = self.rotary_emb(pooled, ordinal)
        states = pooled
        for layer in self.segment_layers:
            states, _ = layer(
                states, attention_mask=attention, position_embeddings=rope, past_key_values=store
            )
        return self.segment_norm(states), valid, segment_documents

    def decoder_slots(self, view: ByteView, segmentation: Segmentation) -> DecoderSlots:
        """Lay each segment out as [`<bos>`, its bytes], say what each slot predicts, and add one pending
        `<bos>` slot per document."""
        config, mask, input_ids = self.config, view.mask, view.ids
        batch, length = input_ids.shape
        index = segmentation.index
        num_segments = int(index.max()) + 1 if index.numel() else 0
        token_slot = (torch.cumsum(mask.long(), dim=1) - 1 + index + 1).masked_fill(~mask, -1)  # (B, T)
        num_slots = int(token_slot.max()) + 1 if mask.any() else 0
        fields = {
            name: input_ids.new_full((batch, num_slots + 1), fill)
            for name, fill in (
                ("ids", config.pad_token_id),
                ("group", -1),
                ("document", -1),
                ("targets", -100),
            )
        }
        fields["position"] = input_ids.new_zeros((batch, num_slots + 1))
        sink = num_slots  # bytes of no slot write here, then it is dropped
        slot = token_slot.masked_fill(~mask, sink)
        bos_slot = (slot - 1).masked_fill(~segmentation.opens, sink)
        columns = torch.arange(length, device=mask.device)
        segment_first = torch.cummax(torch.where(segmentation.opens, columns, 0), 1).values
        for target, values in (
            (slot, input_ids),
            (bos_slot, torch.full_like(input_ids, config.segment_start_token_id)),
        ):
            fields["ids"].scatter_(1, target, values)
            fields["group"].scatter_(1, target, index)
            fields["document"].scatter_(1, target, view.documents)
        fields["position"].scatter_(1, slot, columns - segment_first + 1)
        # Targets: the next byte of the segment, `<nxt>` after a closing byte, nothing after `<eos>`, nothing
        # in `<BoS>`'s segment, nothing after the last byte of a row's still-open segment.
        next_ids = F.pad(input_ids, (0, 1), value=config.pad_token_id)[:, 1:]
        token_targets = torch.where(segmentation.ends, config.segment_end_token_id, next_ids)
        last_real = mask & ~F.pad(mask, (0, 1), value=False)[:, 1:]
        token_targets = token_targets.masked_fill((last_real & ~segmentation.ends) | ~mask, -100)
        token_targets = token_targets.masked_fill(input_ids == _first_id(config.eos_token_id), -100)
        in_bos_segment = torch.gather(input_ids, 1, segment_first) == config.bos_token_id
        fields["targets"].scatter_(1, slot, token_targets.masked_fill(in_bos_segment, -100))
        fields["targets"].scatter_(1, bos_slot, input_ids.masked_fill(in_bos_segment, -100))
        fields = {name: tensor[:, :num_slots] for name, tensor in fields.items()}
        fields["reads"] = fields["group"].clamp(min=0)
        slots = _with_pending_slots(
            fields, view, config.segment_start_token_id, num_segments, token_slot, num_slots
        )
        if segmentation.confidence is not None:
            slots.confidence = slot_confidence(segmentation, slot, bos_slot, num_slots, slots.ids.shape[1])
        return slots

    def decode(self, slots: DecoderSlots, segments, segment_valid, segment_documents) -> torch.Tensor:
        """(B, S, Dd) normed decoder states of every slot."""
        states = self.decoder_embed_tokens(slots.ids)
        if slots.confidence is not None:
            # The decoder's conditioning on each decision: a byte's slot (z_t = 0: the segment goes on)
            # and the `<bos>` slot a close opened (z_t = 1), scaled by that decision's confidence.
            states = states * slots.confidence[..., None].to(states.dtype)
        valid = slots.group >= 0
        order = torch.arange(slots.ids.shape[1], device=valid.device)
        self_allowed = (slots.group[:, :, None] == slots.group[:, None, :]) & valid[:, None, :]
        self_allowed = self_allowed & (order[None, :] <= order[:, None])[None]
        self_allowed = self_allowed | torch.eye(len(order), dtype=torch.bool, device=valid.device)[None]
        earlier = (
            torch.arange(segments.shape[1], device=valid.device)[None, None, :] < slots.reads[:, :, None]
        )
        same_document = segment_documents[:, None, :] == slots.document[:, :, None]
        cross_allowed = F.pad(earlier & same_document & segment_valid[:, None, :], (1, 0), value=True)
        table = torch.cat(
            [self.null_segment.to(segments.dtype).expand(segments.shape[0], 1, -1), segments], 1
        )
        rope = self.decoder_rotary_emb(states, slots.position)
        for layer in self.decoder_layers:
            keys, values = layer.cross_attn.project_segments(table)
            states, _ = layer(
                states,
                keys,
                values,
                cross_allowed,
                attention_mask=self_allowed[:, None],
                position_embeddings=rope,
            )
        return self.decoder_norm(states)

    # Generation: the parallel pass fills a SegmentCache, then `step` advances it one input column.

    def fill_cache(self, cache: SegmentCache, view: ByteView, token_states, segmentation, segments) -> None:
        """Complete `cache` after a parallel pass over one document per row (its token-encoder K/V and
        segment-encoder K/V were stored during the pass): cross K/V, the open segment, decoder K/V."""
        closed = cache.segment_store.lengths  # the closed-segment count, set before the pass
        count = (segmentation.index.max(dim=1).values + 1).clamp(min=0)
        cache.token_valid, cache.byte_counts = view.mask, view.mask.sum(dim=1)
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
        special = (input_ids == config.bos_token_id) | (input_ids == _first_id(config.eos_token_id))
        content_ends = is_byte & ((probs >= config.boundary_threshold) | special)
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


def boundary_metrics(segmentation: Segmentation, free: torch.Tensor, threshold: float) -> dict:
    """Detached boundary rates over the `free` bytes (no forced end): `boundary_rate`, the ends this pass
    used (sampled in training, thresholded in eval); `expected_boundary_rate`, the mean q_t (the rate
    training samples at); `threshold_boundary_rate`, the share with q_t >= `threshold` (what inference
    would close on the same bytes). None when no byte is free."""
    if not bool(free.any()):
        return dict(boundary_rate=None, expected_boundary_rate=None, threshold_boundary_rate=None)
    probs = segmentation.probs.detach()[free]
    return dict(
        boundary_rate=segmentation.ends[free].float().mean(),
        expected_boundary_rate=probs.mean(),
        threshold_boundary_rate=(probs >= threshold).float().mean(),
    )


def slot_confidence(
    segmentation: Segmentation, slot: torch.Tensor, bos_slot: torch.Tensor, sink: int, total: int
) -> torch.Tensor:
    """(B, total) confidence of the decision each decoder slot stands for: a byte's slot, that of its own
    decision; a segment's `<bos>` slot, that of the close before it (1 at a document's first segment,
    whose opening no router decided; 1 at the pending slots). `slot`/`bos_slot` (B, T) map view bytes to
    the `sink` segment slots (`sink` itself: no slot)."""
    confidence = segmentation.confidence
    table = confidence.new_ones(confidence.shape[0], total + 1)
    table[:, : sink + 1].scatter_(1, slot, confidence)
    table[:, : sink + 1].scatter_(1, bos_slot, _previous(confidence, 1.0))
    # The sink column received what belongs to no slot; the pending slots after it keep 1.
    table[:, sink] = 1.0
    return torch.cat([table[:, :sink], table[:, sink + 1 :]], dim=1)[:, :total]


class LSLMForCausalLM(LSLMPreTrainedModel, GenerationMixin):
    """Byte-level LSLM: (B, T) ids (the `ByteTokenizer`'s) -> (B, T, V) logits of the next input token.

    With `labels` (any tensor; the targets come from `input_ids`, see the module docstring), loss = the
    ELBO's negative: decoder cross-entropy + `kl_weight` · KL. With `use_cache` (what `generate` asks
    for) the first call runs the parallel pass and fills a `SegmentCache`; later calls advance it one
    input column at a time.
    """

    def __init__(self, config: LSLMConfig) -> None:
        super().__init__(config)
        self.model = LSLMModel(config)
        self.lm_head = nn.Linear(config.decoder_hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs: Any,
    ) -> LSLMCausalLMOutput | tuple:
        return_dict = kwargs.pop("return_dict", None)
        cache = adopt_cache(past_key_values, SegmentCache, self.model.new_cache, bool(use_cache), "LSLM")
        if cache is not None and cache.get_seq_length() > 0:
            mask = token_mask(attention_mask, tuple(input_ids.shape), input_ids.device)
            steps = [
                self.model.step(input_ids[:, column], mask[:, column], cache)
                for column in range(mask.shape[1])
            ]
            output = LSLMCausalLMOutput(logits=self.lm_head(torch.stack(steps, dim=1)), past_key_values=cache)
        else:
            output = self.parallel_pass(input_ids, attention_mask, position_ids, labels, cache)
        return output.to_tuple() if return_dict is False else output

    def parallel_pass(self, input_ids, attention_mask, position_ids, labels, cache) -> LSLMCausalLMOutput:
        """Every segment at once (training, full recomputation, the prefill of generation)."""
        model = self.model
        batch, length = input_ids.shape
        mask = token_mask(attention_mask, (batch, length), input_ids.device)
        if position_ids is None:
            position_ids = default_position_ids(attention_mask, length, 0, input_ids.device)
        starts = document_starts(mask, position_ids.expand(batch, -1))
        view = byte_view(input_ids, mask, starts, self.config)
        if cache is not None and bool((view.input_documents.amax(dim=1) > 1).any()):
            raise ValueError("use_cache with packed documents: generation continues one document per row")
        token_states = model.encode_tokens(view, cache)
        segmentation = model.segment(view, token_states)
        segment_store = None
        if cache is not None:
            segment_store = cache.segment_store
            segment_store.fill(closed_segments(segmentation, view))
        segments, segment_valid, segment_documents = model.encode_segments(
            token_states, segmentation, view, segment_store
        )
        slots = model.decoder_slots(view, segmentation)
        slot_logits = self.lm_head(
            model.decode(slots, segments, segment_valid, segment_documents)
        )  # (B, S, V)
        flat_slot = token_slots(view, segmentation, slots)
        logits = torch.gather(slot_logits, 1, flat_slot[..., None].expand(-1, -1, slot_logits.shape[-1]))
        boundaries = torch.zeros_like(mask).scatter_(1, view.order, segmentation.opens)
        if cache is not None:
            model.fill_cache(cache, view, token_states, segmentation, segments)
            cache.items = length
        fields = self.elbo(slot_logits, slots, segmentation, view.mask, labels)
        return LSLMCausalLMOutput(logits=logits, past_key_values=cache, boundaries=boundaries, **fields)

    def elbo(self, slot_logits, slots: DecoderSlots, segmentation: Segmentation, mask, labels) -> dict:
        """The loss (when `labels` is given) and the metrics."""
        config = self.config
        free = mask & ~segmentation.forced
        fields = boundary_metrics(segmentation, free, config.boundary_threshold)
        segments = int((segmentation.index.max(dim=1).values + 1).clamp(min=0).sum())
        fields["compression_ratio"] = (mask.sum() / max(segments, 1)).detach().float()
        if labels is None:
            return fields
        targets = slots.targets
        counted = targets != -100
        losses = F.cross_entropy(
            slot_logits.float().reshape(-1, slot_logits.shape[-1]), targets.reshape(-1), reduction="none"
        ).view(targets.shape)
        lm_loss = losses[counted].sum() / counted.sum().clamp(min=1)
        byte_targets = targets >= BYTE_OFFSET
        bits = losses[byte_targets].sum() / byte_targets.sum().clamp(min=1) / torch.log(torch.tensor(2.0))
        kl = bernoulli_kl_from_logits(segmentation.logits, config.prior_mean)
        kl_loss = kl[free].mean() if free.any() else kl.new_zeros(())
        fields.update(
            loss=lm_loss + config.kl_weight * kl_loss,
            lm_loss=lm_loss.detach(),
            kl_loss=kl_loss.detach(),
            bits_per_byte=bits.detach(),
        )
        return fields


LSLMModel.register_for_auto_class("AutoModel")
LSLMForCausalLM.register_for_auto_class("AutoModelForCausalLM")
