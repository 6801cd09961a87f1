"""The LSLM family: byte encoder -> ffn-gumbel boundaries -> pooled segments -> segment encoder -> segment
decoder (LSLM §2, DESIGN §4). This module is the parallel (training and full-recompute) pass; the segment
cache for byte-by-byte generation is not written yet.

Legend: B batch, T input tokens, M segments, S decoder slots (T real tokens + one `<bos>` per segment),
Dt / D / Dd token-encoder / segment-encoder / decoder width, V vocabulary (261 bytes and markers).

Pass, per row (left padding and packed documents allowed):
1. token encoder over the input bytes (causal, at Dt);
2. boundaries z_t (byte t ends a segment): q_t = σ(sum FFN(h_t)); training samples σ(p̂ + g′ − g″) ≥ ½
   (a straight-through factor carries the gradient), inference thresholds q_t; `<BoS>`, `<eos>` and the
   last token of a packed document always end a segment, pads never do;
3. segments pooled (`mean` or `hops:N`, the segment's own tokens only), times the straight-through factor
   of their closing byte, projected to D;
4. segment encoder (causal over the segments of a document; RoPE at the segment's ordinal);
5. decoder over slots: segment m is written as [`<bos>`, its bytes] and predicts [its bytes, `<nxt>`];
   self-attention within the segment (causal), cross-attention to the encoded segments before m in its
   document plus a learned null segment (so the first segment has something to read);
6. the ELBO: cross-entropy over the decoder's targets (bytes and `<nxt>`; nothing is predicted for
   `<BoS>`'s segment or after `<eos>`) + `kl_weight` · KL(Bernoulli(q_t) ‖ Bernoulli(prior_mean)) over the
   bytes whose boundary is not forced. `bits_per_byte` = the cross-entropy of byte targets alone / ln 2.

Per-token logits (the causal-LM interface): token t's logits predict the input token after it: the
decoder slot of t while its segment is open, and the next segment's `<bos>` slot after t ends a segment
(within its document). Causality: every slot reads bytes of its own segment up to itself and segments
that closed before its segment began, so logits at t depend on tokens <= t only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import ModelOutput

from .chunking import concept_attention_mask
from .concept_stack import ConfigView
from .configuration_lslm import LSLMConfig
from .layers import DecoderLayer, RMSNorm, RotaryEmbedding
from .modeling_plain import default_position_ids, init_backbone_weights
from .packing import document_starts, token_mask
from .pooling import chunk_index, pool_concepts
from .routing import gumbel_sigmoid, sample_gumbel_noise, straight_through
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

    def forward(
        self, slot_states: torch.Tensor, segments: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """(B, S, Dd) slots, (B, 1 + M, D) null + segments, (B, S, 1 + M) bool -> (B, S, Dd)."""
        batch, slots, _ = slot_states.shape
        query = self.q_proj(slot_states).view(batch, slots, self.num_heads, -1).transpose(1, 2)
        key = self.k_proj(segments).view(batch, segments.shape[1], self.num_heads, -1).transpose(1, 2)
        value = self.v_proj(segments).view(batch, segments.shape[1], self.num_heads, -1).transpose(1, 2)
        attended = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed[:, None])
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
        segments: torch.Tensor,
        cross_allowed: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        attended, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
        )
        hidden_states = hidden_states + attended
        crossed = self.cross_attn(self.cross_attention_layernorm(hidden_states), segments, cross_allowed)
        hidden_states = hidden_states + crossed
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)), None


@dataclass
class Segmentation:
    """One pass's boundaries: `ends` (B, T) bool, `probs` q_t (B, T) float32, `forced` (B, T), the
    straight-through `factor` (B, T), `index` (B, T) segment of each token (-1 pads), `starts` (B, T)."""

    ends: torch.Tensor
    probs: torch.Tensor
    forced: torch.Tensor
    factor: torch.Tensor
    index: torch.Tensor
    starts: torch.Tensor


@dataclass
class DecoderSlots:
    """The decoder's view of a row: `ids`, `targets` (-100: none), `segment` (-1: empty), `position`
    (index within the segment) per slot, each (B, S), and `token_slot` (B, T) the slot of each token."""

    ids: torch.Tensor
    targets: torch.Tensor
    segment: torch.Tensor
    position: torch.Tensor
    token_slot: torch.Tensor


@dataclass
class LSLMCausalLMOutput(ModelOutput):
    """Per-token logits plus the ELBO's parts (detached metrics): `lm_loss` (decoder cross-entropy, nats
    per target), `kl_loss`, `boundary_rate` (segment ends per byte) and `bits_per_byte`."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    lm_loss: torch.Tensor | None = None
    kl_loss: torch.Tensor | None = None
    boundary_rate: torch.Tensor | None = None
    bits_per_byte: torch.Tensor | None = None
    compression_ratio: torch.Tensor | None = None


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
        self.post_init()

    def encode_tokens(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        """(B, T, Dt) causal token states (masks from masking_utils: padding and packed documents)."""
        states = self.embed_tokens(input_ids)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=states,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=position_ids,
        )
        rope = self.token_rotary_emb(states, position_ids)
        for layer in self.token_layers:
            states, _ = layer(states, attention_mask=mask, position_embeddings=rope)
        return self.token_norm(states)

    def segment(self, input_ids, token_states, mask, starts) -> Segmentation:
        """Boundaries (see the module docstring) and each token's segment."""
        config = self.config
        logits = self.router(token_states)  # (B, T)
        probs = torch.sigmoid(logits)
        if self.training:
            relaxed = gumbel_sigmoid(logits, *sample_gumbel_noise(tuple(logits.shape), device=logits.device))
        else:
            relaxed = probs
        # The last real token of a document that another document follows in the row ends a segment.
        next_starts = torch.zeros_like(starts)
        next_starts[:, :-1] = starts[:, 1:]
        special = (input_ids == config.bos_token_id) | (input_ids == _first_id(config.eos_token_id))
        forced = (special | next_starts) & mask
        ends = ((relaxed >= config.boundary_threshold) | forced) & mask
        factor = straight_through(relaxed, ends)
        previous_end = torch.zeros_like(ends)
        previous_end[:, 1:] = ends[:, :-1]
        opens = (previous_end | starts) & mask
        return Segmentation(ends, probs, forced, factor, chunk_index(opens, mask), starts)

    def encode_segments(self, token_states, segmentation: Segmentation, mask) -> tuple[torch.Tensor, ...]:
        """(B, M, D) encoded segments, their (B, M) validity and (B, M) document ids."""
        opens = segmentation.index >= 0
        opens = opens & (F.pad(segmentation.index, (1, 0), value=-1)[:, :-1] != segmentation.index)
        pooled, valid = pool_concepts(token_states, opens, mask, self.config.pooling)  # (B, M, Dt)
        num_segments = pooled.shape[1]
        # Each segment carries the straight-through factor of the byte that closed it (1 while open).
        closing = torch.where(segmentation.ends, segmentation.index, num_segments)
        factor = pooled.new_ones(pooled.shape[0], num_segments + 1)
        factor.scatter_(
            1, closing.clamp(min=0), torch.where(segmentation.ends, segmentation.factor, 1.0).to(factor.dtype)
        )
        pooled = pooled * factor[:, :num_segments, None]
        if self.segment_in_proj is not None:
            pooled = self.segment_in_proj(pooled)
        documents = torch.cumsum((segmentation.starts & mask).long(), dim=1)  # (B, T)
        segment_documents = torch.zeros_like(valid, dtype=torch.long)
        segment_documents.scatter_(1, segmentation.index.clamp(min=0), documents.masked_fill(~mask, 0))
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
            states, _ = layer(states, attention_mask=attention, position_embeddings=rope)
        return self.segment_norm(states), valid, segment_documents

    def decoder_slots(self, input_ids, segmentation: Segmentation, mask) -> DecoderSlots:
        """Lay each segment out as [`<bos>`, its tokens] and say what each slot predicts."""
        config = self.config
        batch, length = input_ids.shape
        index = segmentation.index
        rank = torch.cumsum(mask.long(), dim=1) - 1
        token_slot = (rank + index + 1).masked_fill(~mask, -1)  # (B, T)
        segment_open = mask & (F.pad(index, (1, 0), value=-1)[:, :-1] != index)
        num_slots = int((mask.sum(1) + (index.max(dim=1).values + 1)).max()) if mask.any() else 0
        ids = input_ids.new_full((batch, num_slots + 1), config.pad_token_id)
        segment = input_ids.new_full((batch, num_slots + 1), -1)
        position = input_ids.new_zeros((batch, num_slots + 1))
        targets = input_ids.new_full((batch, num_slots + 1), -100)
        sink = num_slots  # pads write here, then it is dropped
        slot = token_slot.masked_fill(~mask, sink)
        bos_slot = (slot - 1).masked_fill(~segment_open, sink)
        segment_first = torch.cummax(
            torch.where(segment_open, torch.arange(length, device=mask.device), 0), 1
        ).values
        ids.scatter_(1, slot, input_ids)
        ids.scatter_(1, bos_slot, torch.full_like(input_ids, config.segment_start_token_id))
        segment.scatter_(1, slot, index)
        segment.scatter_(1, bos_slot, index)
        position.scatter_(1, slot, torch.arange(length, device=mask.device) - segment_first + 1)
        # Targets: the next token of the segment, `<nxt>` after a closing byte, nothing after `<eos>`,
        # nothing in `<BoS>`'s segment, nothing after the last byte of a row's still-open segment.
        next_ids = F.pad(input_ids, (0, 1), value=config.pad_token_id)[:, 1:]
        token_targets = torch.where(segmentation.ends, config.segment_end_token_id, next_ids)
        last_real = mask & ~F.pad(mask, (0, 1), value=False)[:, 1:]
        token_targets = token_targets.masked_fill((last_real & ~segmentation.ends) | ~mask, -100)
        token_targets = token_targets.masked_fill(input_ids == _first_id(config.eos_token_id), -100)
        in_bos_segment = torch.gather(input_ids, 1, segment_first) == config.bos_token_id
        targets.scatter_(1, slot, token_targets.masked_fill(in_bos_segment, -100))
        targets.scatter_(1, bos_slot, input_ids.masked_fill(in_bos_segment, -100))
        return DecoderSlots(
            ids[:, :num_slots],
            targets[:, :num_slots],
            segment[:, :num_slots],
            position[:, :num_slots],
            token_slot,
        )

    def decode(self, slots: DecoderSlots, segments, segment_valid, segment_documents) -> torch.Tensor:
        """(B, S, Dd) normed decoder states of every slot."""
        states = self.decoder_embed_tokens(slots.ids)
        valid = slots.segment >= 0
        same_segment = slots.segment[:, :, None] == slots.segment[:, None, :]
        order = torch.arange(slots.ids.shape[1], device=valid.device)
        self_allowed = same_segment & valid[:, None, :] & (order[None, :] <= order[:, None])[None]
        self_allowed = self_allowed | torch.eye(len(order), dtype=torch.bool, device=valid.device)[None]
        slot_documents = torch.gather(segment_documents, 1, slots.segment.clamp(min=0))
        earlier = (
            torch.arange(segments.shape[1], device=valid.device)[None, None, :] < slots.segment[:, :, None]
        )
        same_document = segment_documents[:, None, :] == slot_documents[:, :, None]
        cross_allowed = earlier & same_document & segment_valid[:, None, :]
        null = self.null_segment.to(segments.dtype).expand(segments.shape[0], 1, -1)
        segments = torch.cat([null, segments], dim=1)
        cross_allowed = F.pad(cross_allowed, (1, 0), value=True)
        rope = self.decoder_rotary_emb(states, slots.position)
        self_mask = self_allowed[:, None]
        if self.config._attn_implementation == "eager":
            self_mask = torch.zeros(self_mask.shape, dtype=states.dtype, device=valid.device).masked_fill(
                ~self_mask, torch.finfo(states.dtype).min
            )
        for layer in self.decoder_layers:
            states, _ = layer(
                states, segments, cross_allowed, attention_mask=self_mask, position_embeddings=rope
            )
        return self.decoder_norm(states)


def _segment_starts(segment_documents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, M) bool: the first segment of each document."""
    previous = F.pad(segment_documents, (1, 0), value=-1)[:, :-1]
    return valid & (segment_documents != previous)


def _first_id(token_id: int | list[int] | None) -> int:
    return token_id[0] if isinstance(token_id, list) else (-1 if token_id is None else token_id)


class LSLMForCausalLM(LSLMPreTrainedModel, GenerationMixin):
    """Byte-level LSLM: (B, T) ids (the `ByteTokenizer`'s) -> (B, T, V) logits of the next input token.

    With `labels` (any tensor; the targets come from `input_ids`, see the module docstring), loss = the
    ELBO's negative: decoder cross-entropy + `kl_weight` · KL.
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
        labels: torch.LongTensor | None = None,
        **kwargs: Any,
    ) -> LSLMCausalLMOutput | tuple:
        return_dict = kwargs.pop("return_dict", None)
        model = self.model
        batch, length = input_ids.shape
        mask = token_mask(attention_mask, (batch, length), input_ids.device)
        if position_ids is None:
            position_ids = default_position_ids(attention_mask, length, 0, input_ids.device)
        position_ids = position_ids.expand(batch, -1)
        starts = document_starts(mask, position_ids)
        token_states = model.encode_tokens(input_ids, attention_mask, position_ids)
        segmentation = model.segment(input_ids, token_states, mask, starts)
        segments, segment_valid, segment_documents = model.encode_segments(token_states, segmentation, mask)
        slots = model.decoder_slots(input_ids, segmentation, mask)
        slot_logits = self.lm_head(
            model.decode(slots, segments, segment_valid, segment_documents)
        )  # (B, S, V)
        # After a closing byte the next input token is the next segment's first: read its `<bos>` slot.
        next_real = F.pad(mask, (0, 1), value=False)[:, 1:] & ~F.pad(starts, (0, 1), value=False)[:, 1:]
        flat_slot = slots.token_slot + (segmentation.ends & next_real).long()
        logits = torch.gather(
            slot_logits, 1, flat_slot.clamp(min=0)[..., None].expand(-1, -1, slot_logits.shape[-1])
        )
        output = LSLMCausalLMOutput(
            logits=logits, **self.elbo(slot_logits, slots, segmentation, mask, labels)
        )
        return output.to_tuple() if return_dict is False else output

    def elbo(self, slot_logits, slots: DecoderSlots, segmentation: Segmentation, mask, labels) -> dict:
        """The loss (when `labels` is given) and the metrics."""
        config = self.config
        free = mask & ~segmentation.forced
        rate = segmentation.ends[free].float().mean() if free.any() else None
        fields = dict(boundary_rate=None if rate is None else rate.detach())
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
        probs = segmentation.probs.clamp(1e-6, 1 - 1e-6)
        prior = config.prior_mean
        kl = probs * torch.log(probs / prior) + (1 - probs) * torch.log((1 - probs) / (1 - prior))
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
