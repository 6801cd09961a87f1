"""The LSLM family: byte encoder -> ffn-gumbel boundaries -> pooled segments -> segment encoder -> segment
decoder (LSLM §2; docs/ARCHITECTURE.md §4.4), in one parallel pass (training, full recomputation,
generation's prefill) and one input column at a time over a `SegmentCache` (generation).

Legend: B batch, T input tokens, M segments, S decoder slots (the bytes, one `<bos>` per segment and one
pending `<bos>` per document), Dt / D / Dd token-encoder / segment-encoder / decoder width, V vocabulary
(256 bytes and five specials, see tokenization_lslm).

Markers. `<nxt>` (the decoder's "segment ends here") and `<bos>` in the input are boundary signals, not
bytes: the token encoder never reads them (positions count bytes only), and a marker closes the open
segment, if any. So the `<nxt>` that generation writes into the sequence makes a full recomputation
segment exactly as the cached steps did.

Pass, per row (left padding and packed documents allowed):
1. token encoder over the row's bytes (causal within a document, at Dt);
2. boundaries z_t (byte t ends a segment): q_t = σ(sum FFN(h_t)); training samples σ(p̂ + g′ − g″) ≥ ½,
   a Bernoulli(q_t) draw; inference decides by `boundary_rule` ("rate": where the document's running
   sum of q passes a half-integer, `lslm_boundary_rules`; "threshold": q_t ≥ `boundary_threshold`);
   `<BoS>`, `<eos>`, a byte before a marker and the last byte of a packed document always end a
   segment, pads never do;
3. segments pooled (`mean` or `hops:N`, the segment's own bytes only), projected to D. In training the
   LM loss reaches the router by `boundary_estimator`: "straight_through" (default, LSLM §2.6) passes
   each hard decision's gradient to its Gumbel-sigmoid sample and on into dynamic pooling's matrix
   (`lslm_estimators`: each byte's weight in its segment is 1 in value, with a gradient to every end
   decision before it); "straight_through_targets" also through the decoder target of the byte's slot;
   "confidence" scales each byte's pooled state and decoder slot by its decision's straight-through
   confidence (`routing.decision_confidence`); "segmental" pools the hard segments and gives the router
   the expected objective's gradient from every free decision flipped against the sample
   (`lslm_segmental`);
4. segment encoder (causal over the segments of a document; RoPE at the segment's ordinal);
5. decoder over slots: segment m is written as [`<bos>`, its bytes] and predicts [its bytes, `<nxt>`];
   self-attention within the segment (causal), cross-attention to the encoded segments before m in its
   document plus a learned null segment (so the first segment has something to read), and, with
   `decoder_latest_segment`, the latest of those segments (projected) added to every slot's input: the
   cross-attention carries no order, so without it a `<bos>` slot cannot tell which segment it continues;
6. the ELBO: cross-entropy over the decoder's targets (bytes, and `<nxt>` with `segment_end_loss`;
   nothing is predicted for `<BoS>`'s segment or after `<eos>`) + `kl_weight` · the boundary prior's term
   over the bytes whose boundary is not forced (`prior_loss`: the Beta prior's Beta-Binomial count term
   by default, the per-byte KL expected under the Beta, the per-byte Bernoulli KL, or DTP's binomial
   count prior; `lslm_loss`), summed and divided by the step's
   predicted bytes (see `LSLMForCausalLM`). `bits_per_byte` = the cross-entropy of byte targets alone /
   ln 2.

Per-token logits (the causal-LM interface) predict the input token after each column: the slot of the
column's byte while its segment is open; once the segment has closed (by the byte: router, `<BoS>`,
`<eos>`; or by a marker) the `<bos>` slot of the document's next segment. A document's last byte closes
its segment for the loss only, so a packed row gives its documents' logits. Causality: a slot reads bytes
of its own segment up to itself and segments that closed before its segment began, so logits at t depend
on tokens <= t only.

Attention weights (`output_attentions=True`, eager attention): token encoder, segment encoder, then each
decoder layer's self- and cross-attention, one query row per input column (what that column's cached
step computes), shapes in `LSLMModelOutput`.

Generation (`step`): a byte feeds the token encoder (one K/V column) and the router; when its segment
closes (router, `<BoS>`/`<eos>`, or a marker), the open segment is pooled, run through the segment
encoder once (its K/V cached) and its cross-attention K/V are stored; the decoder's self-attention cache
then restarts at `<bos>`. The decoder therefore attends over one segment, never over the context.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin

from .configuration_lslm import LSLMConfig
from .forward_only_cache import adopt_cache
from .layers import (
    AttentionRecorder,
    DecoderLayer,
    RMSNorm,
    RotaryEmbedding,
    attention_recorder,
    default_position_ids,
    init_backbone_weights,
    recording_attentions,
)
from .loss_terms import prior_loss_terms, warn_loss_terms_dropped
from .lslm_attention_layout import decoder_layouts, segment_layout, token_layout
from .lslm_boundary_rules import rate_matched_ends, source_ends
from .lslm_estimators import (
    straight_through_ends,
    straight_through_pool_weights,
)
from .lslm_generation import SegmentCacheSteps, SegmentMarkerGeneration, stack_step_attentions
from .lslm_layers import BoundaryRouter, SegmentDecoderLayer, stage_config
from .lslm_layout import (
    ByteView,
    DecoderSlots,
    Segmentation,
    _first_id,
    _previous,
    _segment_starts,
    _with_pending_slots,
    always_closing,
    byte_view,
    closed_segments,
    document_causal_mask,
    opening_probs,
    slot_confidence,
    token_slots,
)
from .lslm_loss import elbo_fields, label_targets, labels_from_shift_labels
from .lslm_outputs import LSLMCausalLMOutput, LSLMModelOutput, LSLMPass, at_input_columns
from .lslm_segment_cache import RaggedStore, SegmentCache
from .lslm_segmental import segmental_surrogate
from .packing import document_starts, token_mask
from .pooling import chunk_index, pool_concepts, slot_attention_mask
from .routing import (
    decision_confidence,
    gumbel_sigmoid,
    sample_gumbel_noise,
)
from .transformers_compat import CACHE_KEYS, cache_kwarg, take_cache

INPUTS_EMBEDS_MESSAGE = "LSLM reads byte ids: inputs_embeds is not supported, pass input_ids"


class LSLMPreTrainedModel(PreTrainedModel):
    """Shared class attributes and weight initialisation of the LSLM family."""

    config_class = LSLMConfig
    config: LSLMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules: ClassVar[list[str]] = ["DecoderLayer", "SegmentDecoderLayer"]
    _skip_keys_device_placement: ClassVar[list[str]] = list(CACHE_KEYS)
    _supports_flash_attn = False
    _supports_sdpa = True
    _supports_attention_backend = False
    # ConceptTrainer: none of the logged metrics is a num_items_in_batch share (only `loss` is normalised
    # by the step's predicted bytes; lm_loss, kl_loss, ... are this batch's means).
    metric_share_fields: ClassVar[tuple[str, ...]] = ()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, LSLMModel):
            module.null_segment.normal_(0.0, self.config.initializer_range)
        else:
            init_backbone_weights(module, self.config.initializer_range)


class LSLMModel(SegmentCacheSteps, LSLMPreTrainedModel):
    """Encoders, router and decoder of an LSLM; `forward` returns the byte-level decoder states
    (`LSLMModelOutput`), `parallel_pass` everything a head reads."""

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
        # The latest segment, added to the decoder's input (`LSLMConfig.decoder_latest_segment`).
        self.segment_to_decoder = (
            nn.Linear(width, decoder_width, bias=False) if config.decoder_latest_segment else None
        )
        first += config.segment_encoder_layers
        self.decoder_layers = nn.ModuleList(
            SegmentDecoderLayer(config, first + i) for i in range(config.decoder_layers)
        )
        self.decoder_norm = RMSNorm(decoder_width, eps=config.rms_norm_eps)
        self.token_rotary_emb = RotaryEmbedding.from_config(token_config)
        self.rotary_emb = RotaryEmbedding.from_config(config)
        self.decoder_rotary_emb = RotaryEmbedding.from_config(decoder_config)
        self.gradient_checkpointing = False
        self.post_init()

    def new_cache(self) -> SegmentCache:
        """An empty `SegmentCache` for this model."""
        return SegmentCache(self.config.token_encoder_layers)

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs: Any,
    ) -> LSLMModelOutput | tuple:
        """(B, T) ids -> `LSLMModelOutput`: the byte-level states `LSLMForCausalLM.lm_head` reads."""
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError(INPUTS_EMBEDS_MESSAGE)
        # The causal LM runs `parallel_pass`: a training forward here has no ELBO (loss_terms.py).
        warn_loss_terms_dropped(self, "LSLM", prior_loss_terms(self.config))
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        layout = self.parallel_pass(
            input_ids,
            attention_mask,
            position_ids,
            output_hidden_states=output_hidden_states,
            recorder=attention_recorder(self.config, output_attentions),
        )
        output = LSLMModelOutput(
            last_hidden_state=layout.column_states(),
            hidden_states=layout.hidden_states,
            attentions=layout.attentions,
            boundaries=layout.boundaries,
            boundary_probs=layout.boundary_probs,
        )
        return_dict = self.config.return_dict if return_dict is None else return_dict
        return output if return_dict else output.to_tuple()

    def parallel_pass(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: SegmentCache | None = None,
        output_hidden_states: bool = False,
        cache_required: bool = True,
        recorder: AttentionRecorder | None = None,
    ) -> LSLMPass:
        """Every segment at once (training, full recomputation, the prefill of generation); fills `cache`
        when given. A cache continues one document per row: with packed rows it is refused, or dropped
        (not filled, `LSLMPass.cache` None) when not `cache_required` (the config's default cache).
        `recorder` records the pass's attention weights (not those of filling the cache)."""
        length = input_ids.shape[1]
        mask, view = self.input_view(input_ids, attention_mask, position_ids)
        if cache is not None and bool((view.input_documents.amax(dim=1) > 1).any()):
            if cache_required:
                raise ValueError("use_cache with packed documents: generation continues one document per row")
            cache = None
        layer_states = [] if output_hidden_states else None
        lay_out = self.attention_layouts(recorder)
        with recording_attentions(self, recorder):
            lay_out("token", token_layout(view))
            token_states = self.encode_tokens(view, cache, layer_states)
            segmentation = self.segment(view, token_states)
            segment_store = None
            if cache is not None:
                segment_store = cache.segment_store
                segment_store.fill(closed_segments(segmentation, view))
            lay_out("segment", segment_layout(view, segmentation))
            segments, segment_valid, segment_documents = self.encode_segments(
                token_states, segmentation, view, segment_store
            )
            slots = self.decoder_slots(view, segmentation)
            column_slots = token_slots(view, segmentation, slots)  # (B, T)
            lay_out("decoder", *decoder_layouts(view, slots, column_slots))
            slot_states = self.decode(slots, segments, segment_valid, segment_documents)  # (B, S, Dd)
        if cache is not None:
            self.fill_cache(cache, view, token_states, segmentation, segments)
            cache.items = length
        hidden_states = None if layer_states is None else tuple(layer_states)
        return LSLMPass(
            mask=mask,
            view=view,
            segmentation=segmentation,
            slots=slots,
            slot_states=slot_states,
            column_slots=column_slots,
            boundaries=torch.zeros_like(mask).scatter_(1, view.order, segmentation.opens),
            boundary_probs=torch.zeros(mask.shape, device=mask.device).scatter_(
                1, view.order, opening_probs(segmentation, view)
            ),
            hidden_states=hidden_states,
            cache=cache,
            attentions=self.attention_entries(recorder),
            token_states=token_states,
        )

    def input_view(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, ByteView]:
        """(B, T) ids -> their (B, T) bool token mask and `ByteView` (documents from `position_ids`)."""
        batch, length = input_ids.shape
        mask = token_mask(attention_mask, (batch, length), input_ids.device)
        if position_ids is None:
            position_ids = default_position_ids(attention_mask, length, 0, input_ids.device)
        starts = document_starts(mask, position_ids.expand(batch, -1))
        return mask, byte_view(input_ids, mask, starts, self.config)

    def attention_layouts(self, recorder: AttentionRecorder | None) -> Callable[..., None]:
        """-> lay_out(stage, *layouts), one layout per attention kind of the "token", "segment" or
        "decoder" stage: record its attention as token-aligned rows (`lslm_attention_layout`), inside the
        graph unless the layers are recomputed in backward (gradient checkpointing runs them unrecorded) or
        no gradient is taken."""
        if recorder is None or not recorder.enabled:
            return lambda stage, *layouts: None
        # Each checkpointed layer carries the flag (`GradientCheckpointingLayer`), in every release.
        checkpointed = any(getattr(module, "gradient_checkpointing", False) for module in self.modules())
        in_graph = torch.is_grad_enabled() and not (self.training and checkpointed)
        stages = {
            "token": [[layer.self_attn for layer in self.token_layers]],
            "segment": [[layer.self_attn for layer in self.segment_layers]],
            "decoder": [
                [layer.self_attn for layer in self.decoder_layers],
                [layer.cross_attn for layer in self.decoder_layers],
            ],
        }

        def lay_out(stage: str, *layouts: Any) -> None:
            for modules, layout in zip(stages[stage], layouts, strict=True):
                recorder.lay_out(modules, layout, in_graph)

        return lay_out

    def attention_entries(self, recorder: AttentionRecorder | None) -> tuple[torch.Tensor, ...] | None:
        """The pass's recorded entries, token-aligned (`lslm_attention_layout`), in `attention_modules`
        order; None when attentions were not asked for, () under a kernel that computes no weights."""
        if recorder is None:
            return None
        return recorder.entries(self.attention_modules())

    def attention_modules(self) -> list[nn.Module]:
        """The module behind each entry of `attentions` (`LSLMModelOutput`): token-encoder and
        segment-encoder self-attention, then each decoder layer's self- and cross-attention."""
        token = [layer.self_attn for layer in self.token_layers]
        segment = [layer.self_attn for layer in self.segment_layers]
        decoder = [module for layer in self.decoder_layers for module in (layer.self_attn, layer.cross_attn)]
        return token + segment + decoder

    def encode_tokens(
        self,
        view: ByteView,
        cache: SegmentCache | None = None,
        layer_states: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """(B, T, Dt) causal token states of the view's bytes (packed documents kept apart); appends each
        layer's input and the normed output, at the input columns, to `layer_states` when given
        (`output_hidden_states`).

        The appended tensors are the ones the computation goes on from (each is gathered back into the
        view), so a loss reaches them. The gather zeroes the view's pad and marker columns, whose states
        no byte reads (masked keys), so asking for them changes no output."""

        def through_input_columns(states: torch.Tensor) -> torch.Tensor:
            if layer_states is None:
                return states
            at_columns = at_input_columns(states, view)  # (B, T, Dt)
            layer_states.append(at_columns)
            return torch.gather(at_columns, 1, view.order[..., None].expand_as(states))

        states = self.embed_tokens(view.ids)
        mask = document_causal_mask(view.mask, view.documents)
        rope = self.token_rotary_emb(states, view.position_ids)
        for layer in self.token_layers:
            states = through_input_columns(states)
            states, _ = layer(states, attention_mask=mask, position_embeddings=rope, **cache_kwarg(cache))
        return through_input_columns(self.token_norm(states))

    def segment(self, view: ByteView, token_states: torch.Tensor) -> Segmentation:
        """Boundaries (see the module docstring) and each byte's segment."""
        config, mask = self.config, view.mask
        logits = self.router(token_states)  # (B, T)
        probs = torch.sigmoid(logits)
        # The last byte of a document that another document follows in the row ends a segment.
        next_starts = F.pad(view.starts, (0, 1), value=False)[:, 1:]
        special = always_closing(view.ids, config)
        forced = (special | next_starts | view.marker_ends) & mask
        # What inference decides (also in training, for the logged inference rate).
        inferred = self.inference_decisions(probs, mask & ~special, view)
        if self.training and config.boundary_source != "router":
            # The ends are given: nothing to sample, and no path from the LM loss into the router.
            relaxed, decided = inferred.to(probs.dtype), inferred
        elif self.training:
            # LSLM eq. 5-6: the Gumbel-sigmoid sample at ½ is a Bernoulli(q_t) draw.
            relaxed = gumbel_sigmoid(logits, *sample_gumbel_noise(tuple(logits.shape), device=logits.device))
            decided = relaxed >= 0.5
        else:
            relaxed, decided = probs, inferred
        content_ends = (decided | special) & mask
        ends = content_ends | forced
        opens = (_previous(ends, False) | view.starts) & mask
        # Training only: the eval forward (and so generation's exactness) never sees the estimator.
        confidence, straight = None, None
        if self.training and config.boundary_estimator == "confidence":
            confidence = decision_confidence(relaxed, ends, mask & ~forced)
        elif self.training and config.boundary_estimator != "segmental":
            straight = straight_through_ends(relaxed, ends, mask & ~forced)
        index = chunk_index(opens, mask)
        return Segmentation(
            ends,
            logits,
            probs,
            forced,
            content_ends,
            index,
            opens,
            confidence,
            relaxed,
            inferred & mask,
            straight,
        )

    def inference_decisions(self, probs: torch.Tensor, counted: torch.Tensor, view: ByteView):
        """(B, T) bool: the closes at inference among the `counted` bytes: the `boundary_source`'s when it is
        not the router; else under `boundary_rule` ("rate": `lslm_boundary_rules`, over each document;
        "threshold": q_t >= `boundary_threshold`)."""
        if self.config.boundary_source != "router":
            return source_ends(self.config, view.position_ids) & counted
        if self.config.boundary_rule == "rate":
            return rate_matched_ends(probs, counted, view.starts)
        return (probs >= self.config.boundary_threshold) & counted

    def encode_segments(
        self, token_states, segmentation: Segmentation, view: ByteView, store: RaggedStore | None = None
    ) -> tuple[torch.Tensor, ...]:
        """(B, M, D) encoded segments, their (B, M) validity and (B, M) document numbers."""
        if segmentation.confidence is not None:
            # Each byte enters its segment scaled by its decision's confidence (value 1): the LM loss
            # reaches the router at every byte, closing or not (`routing.decision_confidence`).
            token_states = token_states * segmentation.confidence[..., None].to(token_states.dtype)
        weights = None
        if segmentation.straight_ends is not None:
            # LSLM §2.6: the hard ends pass their gradient straight through into the pooling matrix
            # (weights of value exactly 1, so the pooled values are the hard ones).
            weights = straight_through_pool_weights(segmentation.straight_ends, view.mask)
        pooled, valid = pool_concepts(
            token_states, segmentation.opens, view.mask, self.config.pooling, weights
        )
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
        attention = slot_attention_mask(valid, segment_documents, ordinal, num_segments, None)
        rope = self.rotary_emb(pooled, ordinal)
        states = pooled
        for layer in self.segment_layers:
            states, _ = layer(
                states, attention_mask=attention, position_embeddings=rope, **cache_kwarg(store)
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
        table = torch.cat(
            [self.null_segment.to(segments.dtype).expand(segments.shape[0], 1, -1), segments], 1
        )  # (B, 1 + M, D): the null segment, then the encoded ones
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
        readable = earlier & same_document & segment_valid[:, None, :]  # (B, S, M)
        if self.segment_to_decoder is not None:
            states = states + self.latest_segment_inputs(table, readable)
        cross_allowed = F.pad(readable, (1, 0), value=True)
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

    def latest_segment_inputs(self, table: torch.Tensor, readable: torch.Tensor) -> torch.Tensor:
        """(B, S, Dd) what each slot adds to its input: the projection of the latest segment it may read
        (`readable` (B, S, M): its document's segments closed before its own segment began), or of the
        null segment when there is none (a document's first segment, empty slots)."""
        projected = self.segment_to_decoder(table)  # (B, 1 + M, Dd)
        numbers = torch.arange(1, readable.shape[-1] + 1, device=readable.device)
        rows = (
            (readable * numbers).amax(dim=-1)
            if readable.shape[-1]
            else readable.new_zeros(readable.shape[:2])
        )
        return torch.gather(projected, 1, rows.long()[..., None].expand(-1, -1, projected.shape[-1]))


class LSLMForCausalLM(LSLMPreTrainedModel, SegmentMarkerGeneration, GenerationMixin):
    """Byte-level LSLM: (B, T) ids (the `ByteTokenizer`'s) -> (B, T, V) logits of the next input token.

    `labels` (B, T) follow the causal-LM convention (shifted inside, -100 ignored; `label_targets` says
    which decoder targets each label governs). The loss is the negative ELBO per predicted byte:

        loss = (Σ decoder cross-entropy over the kept targets + `kl_weight` · Σ KL over the free bytes) / N

    with N = `num_items_in_batch` when given (Trainer: the count of `labels[..., 1:] != -100` over every
    micro-batch of the optimizer step and, with `average_tokens_across_devices`, every process), else
    this batch's count of it. A batch's loss is therefore its share of the step's: gradient accumulation
    and DDP add up to the loss of the joint batch. The metrics `lm_loss` (cross-entropy per target),
    `kl_loss` (mean KL per free byte) and `bits_per_byte` are this batch's own, detached.

    `shift_labels` (B, T) (transformers' pre-shifted labels: `shift_labels[:, c]` labels the token after
    column c) replace `labels` when given: the same loss as the `labels` they shift. The last column must
    hold -100 (a label past the input: rows cannot be cut for sequence parallelism).

    `use_cache` (default: the config's; never by default in training) makes the first call run the
    parallel pass and fill a `SegmentCache`; later calls advance it one input column at a time.

    What the outputs hold (L: the call's input columns; levels: byte = the token encoder, segment =
    the segment encoder, decoder = the decoder's slots; `LSLMModelOutput` has the details):

    - `hidden_states`: token-encoder layers + 1 byte-level tensors (B, L, Dt): each token-encoder
      layer's input (the first: the byte embeddings) and the encoder's normed output, at the input
      columns, zero at pads and markers; the tensors the computation uses. Every call returns them, a
      cached one for its new columns (the full forward's rows there).
    - `attentions` (eager attention): token-encoder layers (byte level, (B, Ht, L, T')) +
      segment-encoder layers (segment level, (B, H, L, M')) + 2 per decoder layer (decoder level: self
      (B, Hd, L, W) and cross (B, Hd, L, 1 + M')), in run order, never None. Token-aligned: row t is
      column t's byte, the segment it closes (zero when none) and the decoder slot whose logits it
      reports, equal to what the cached step of column t returns.

    `generate` returns every id the loop ran on: the bytes and the `<nxt>`/`<bos>` markers the model
    wrote (they close segments, and a full recomputation reads them). Markers are special tokens: one
    id per decoding step, so `max_new_tokens` counts markers too, per-step `scores`, `logits`,
    `attentions` and `hidden_states` match the returned tokens (`compute_transition_scores` works), and
    `model(sequences)` recomputes the step logits. `tokenizer.decode(..., skip_special_tokens=True)`
    and the text-generation pipeline give the text without markers; a streamer receives the bytes
    only (`SegmentMarkerFilter`).
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
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        output_attentions: bool | None = None,
        **kwargs: Any,
    ) -> LSLMCausalLMOutput | tuple:
        if inputs_embeds is not None:
            raise ValueError(INPUTS_EMBEDS_MESSAGE)
        given_cache = take_cache(cache, kwargs)
        # A keyword argument, as in transformers' models: Trainer takes every forward parameter named
        # "*label*" for a label column, and would then skip the loss of batches without it.
        shift_labels = kwargs.get("shift_labels")
        if shift_labels is not None:
            # transformers' precedence: pre-shifted labels replace `labels`.
            labels = labels_from_shift_labels(shift_labels, input_ids)
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(
                f"labels of shape {tuple(labels.shape)} do not match input_ids of shape "
                f"{tuple(input_ids.shape)}: LSLM shifts the labels itself, pass them aligned with input_ids"
            )
        if labels is None:
            warn_loss_terms_dropped(self, "LSLM", prior_loss_terms(self.config))
        # The config's default asks for a cache only outside training: nothing generates from a
        # training pass, and filling the cache costs a decoder pass.
        implicit = use_cache is None
        create = (self.config.use_cache and not self.training) if implicit else use_cache
        cache = adopt_cache(given_cache, SegmentCache, self.model.new_cache, bool(create), "LSLM")
        if cache is not None:
            # What `crop` needs to feed these columns again (family_cache).
            cache.record_call(self, input_ids, None, attention_mask, position_ids)
        recorder = attention_recorder(self.config, output_attentions)
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if cache is not None and cache.get_seq_length() > 0:
            output = self.cached_steps(input_ids, attention_mask, cache, recorder, output_hidden_states)
        else:
            layout = self.model.parallel_pass(
                input_ids,
                attention_mask,
                position_ids,
                cache,
                output_hidden_states=output_hidden_states,
                cache_required=not (implicit and given_cache is None),
                recorder=recorder,
            )
            output = self.heads(layout, labels, num_items_in_batch)
        return_dict = self.config.return_dict if return_dict is None else return_dict
        return output if return_dict else output.to_tuple()

    def cached_steps(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: SegmentCache,
        recorder: AttentionRecorder | None,
        output_hidden_states: bool = False,
    ) -> LSLMCausalLMOutput:
        """Logits of the input columns advanced one at a time over a filled cache (no loss), with the
        columns' hidden states and attentions (`LSLMModelOutput`) when asked for."""
        mask = token_mask(attention_mask, tuple(input_ids.shape), input_ids.device)
        recording = recorder is not None and recorder.enabled
        modules = self.model.attention_modules()
        states, step_attentions, step_hidden = [], [], []
        for column in range(mask.shape[1]):
            # One recorder per column: each column's step attends over its own keys.
            column_recorder = AttentionRecorder() if recording else None
            layer_states = [] if output_hidden_states else None
            closed_before = cache.segment_store.lengths
            with recording_attentions(self.model, column_recorder):
                states.append(self.model.step(input_ids[:, column], mask[:, column], cache, layer_states))
            if recording:
                closes = cache.segment_store.lengths > closed_before
                entries = column_recorder.entries(modules)
                step_attentions.append(
                    self.model.step_rows(entries, input_ids[:, column], mask[:, column], closes)
                )
            if output_hidden_states:
                step_hidden.append(layer_states)
        attentions = None
        if recorder is not None:
            attentions = stack_step_attentions(step_attentions) if recording else ()
        hidden_states = None
        if output_hidden_states:
            hidden_states = tuple(torch.stack(layer, dim=1) for layer in zip(*step_hidden, strict=True))
        return LSLMCausalLMOutput(
            logits=self.lm_head(torch.stack(states, dim=1)),
            cache=cache,
            attentions=attentions,
            hidden_states=hidden_states,
        )

    def heads(
        self, layout: LSLMPass, labels: torch.Tensor | None, num_items_in_batch: torch.Tensor | int | None
    ) -> LSLMCausalLMOutput:
        """Logits, loss and metrics of a parallel pass."""
        slot_logits = self.lm_head(layout.slot_states)  # (B, S, V)
        index = layout.column_slots[..., None].expand(-1, -1, slot_logits.shape[-1])
        logits = torch.gather(slot_logits, 1, index)  # (B, T, V)
        targets, predicted = None, None
        if labels is not None:
            targets = label_targets(layout, labels, self.config.segment_end_token_id)
            if num_items_in_batch is None:
                predicted = (labels[:, 1:] != -100).sum().clamp(min=1)
            else:
                predicted = torch.as_tensor(num_items_in_batch, device=logits.device)
        fields = elbo_fields(
            self.config, slot_logits, layout.slots, layout.segmentation, layout.view, targets, predicted
        )
        if targets is not None and self.training and self.config.boundary_estimator == "segmental":
            # Value exactly 0: only the gradient through the router's logits changes (`lslm_segmental`).
            fields["loss"] = fields["loss"] + segmental_surrogate(self, layout, labels, predicted)
        return LSLMCausalLMOutput(
            logits=logits,
            cache=layout.cache,
            boundaries=layout.boundaries,
            hidden_states=layout.hidden_states,
            attentions=layout.attentions,
            boundary_probs=layout.boundary_probs,
            **fields,
        )


LSLMModel.register_for_auto_class("AutoModel")
LSLMForCausalLM.register_for_auto_class("AutoModelForCausalLM")
