"""The ConceptMoE family: token encoder -> chunk -> concept model (dense or MoE) -> dechunk -> decoder.

Legend: B batch, L tokens (this call), C concepts (new in this call), D token width, Dc concept width,
V vocabulary.

Pipeline (ConceptMoE §3, DESIGN §3), per call:
1. embed; encoder `DecoderLayer`s at token level (token K/V in the cache);
2. boundaries: cosine or linear router (`chunking="dynamic"`; Bernoulli/Gaussian noise only in
   training; starts forced) or every R-th token of each document (`"fixed"`, p = 1 at openings, 0
   elsewhere, so the ratio loss has nothing to steer and is 0);
3. the concepts that become readable in this call (`chunking.emit_concepts`): pooled "first", "sum" or
   "mean", optional `concept_in_proj`, concept `DecoderLayer`s over the concept sequence (RoPE position
   = the opening token's position id; attention causal over concepts of the same document; cached
   concept K/V; `concept_loop` runs layers [start, end) `extra` more times), optional `concept_out_proj`,
   then the dechunk residual: `output` keeps ĉ, `delta` uses ĉ − c;
4. EMA over concepts, continuing from the cached value, weighted by each concept's opening p (a
   document's first concept has p = 1, so the EMA never crosses documents);
5. each token adds its readable concept ĉᵉ_{a(t)} times the straight-through factor of (p_t, b_t);
   decoder layers, the last J with joint decoding (q, k, v += W^c ĉᵉ_{a(t)}, before q/k norm and RoPE);
   final norm and LM head.

The forward *is* the incremental step over a `ConceptCache`; without a cache it is the step from an empty
state, so cached decoding equals a full forward by construction.

Causality: a token at position t reads only real tokens <= t of its own document: token layers through
`masking_utils` masks; the router through tokens t − 1 and t; concepts through the availability rule
("first": the chunk it is in; "sum"/"mean": the last *closed* chunk of its document, nothing in a
document's first chunk); concept attention through the concept mask. Left padding through
`attention_mask`, packed documents through `position_ids` restarting at 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import ModelOutput

from .chunking import (
    Chunker,
    EmittedConcepts,
    IdentityInitLinear,
    concept_attention_mask,
    emit_concepts,
    fixed_boundaries,
)
from .concept_cache import ConceptCache, ConceptState
from .configuration_conceptmoe import ConceptMoEConfig
from .forward_only_cache import adopt_cache
from .layers import Attention, DecoderLayer, RMSNorm, RotaryEmbedding
from .modeling_plain import PlainDecoderModel, default_position_ids, init_backbone_weights, project_logits
from .packing import document_starts, token_mask
from .pooling import gather_concepts_to_tokens
from .routing import boundary_decisions, ratio_loss, scale_aux_loss, straight_through
from .scan import ema_scan


class ZeroInitLinear(nn.Linear):
    """A projection initialised to zero (joint decoding), so it changes nothing at conversion."""


class _WidthOverride:
    """The model config seen with another `hidden_size` (a wider concept model); every other attribute,
    `_attn_implementation` included, is read live from the model's config."""

    def __init__(self, config: ConceptMoEConfig, hidden_size: int) -> None:
        self._config = config
        self.hidden_size = hidden_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


class JointAttention(Attention):
    """Attention whose q, k, v also receive W^c_{q,k,v} of the token's concept (ConceptMoE eq. 11)."""

    def __init__(self, config, layer_idx: int, concept_width: int) -> None:
        super().__init__(config, layer_idx)
        self.concept_q_proj = ZeroInitLinear(concept_width, self.num_heads * self.head_dim, bias=False)
        self.concept_k_proj = ZeroInitLinear(
            concept_width, self.num_key_value_heads * self.head_dim, bias=False
        )
        self.concept_v_proj = ZeroInitLinear(
            concept_width, self.num_key_value_heads * self.head_dim, bias=False
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_values=None,
        token_concepts: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, L, D) token states and their (B, L, D) concepts -> (B, L, D), eq. 11."""
        additions = (
            self.concept_q_proj(token_concepts),
            self.concept_k_proj(token_concepts),
            self.concept_v_proj(token_concepts),
        )
        projected = self.project(hidden_states, additions)
        return self.attend(projected, position_embeddings, attention_mask, past_key_values, **kwargs)


class JointDecoderLayer(DecoderLayer):
    """`DecoderLayer` with joint decoding; the concepts come positionally (gradient checkpointing)."""

    def __init__(self, config, layer_idx: int, concept_width: int) -> None:
        super().__init__(config, layer_idx)
        self.self_attn = JointAttention(config, layer_idx, concept_width)

    def forward(
        self,
        hidden_states: torch.Tensor,
        token_concepts: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values=None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # `token_concepts` is positional so that gradient checkpointing treats it as an input.
        return self.attend_and_mix(
            hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            token_concepts=token_concepts,
            **kwargs,
        )


class _ConceptPassCache:
    """What one concept pass's attention sees as `past_key_values`: appends to that pass's concept K/V."""

    def __init__(self, cache: ConceptCache, pass_idx: int) -> None:
        self.cache, self.pass_idx = cache, pass_idx

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        return self.cache.update_concepts(keys, values, self.pass_idx)


@dataclass
class ConceptMoEModelOutput(ModelOutput):
    """Base-model output: final-normed token states plus what the losses and metrics need."""

    last_hidden_state: torch.Tensor | None = None
    past_key_values: Cache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    boundary_probs: torch.Tensor | None = None
    boundaries: torch.Tensor | None = None
    token_mask: torch.Tensor | None = None
    document_starts: torch.Tensor | None = None


@dataclass
class ConceptMoECausalLMOutput(ModelOutput):
    """Causal-LM output; the metric fields are detached (`compression_ratio` = real tokens per concept)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    past_key_values: Cache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    lm_loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    compression_ratio: torch.Tensor | None = None
    boundary_prob_mean: torch.Tensor | None = None


@dataclass
class _Step:
    """One call's concept-level results: per-token concepts, router outputs and the next state."""

    token_concepts: torch.Tensor
    probs: torch.Tensor
    boundaries: torch.Tensor
    state: ConceptState


class ConceptMoEPreTrainedModel(PreTrainedModel):
    """Shared class attributes and weight initialisation of the ConceptMoE family."""

    config_class = ConceptMoEConfig
    config: ConceptMoEConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules: ClassVar[list[str]] = ["DecoderLayer", "JointDecoderLayer"]
    _skip_keys_device_placement: ClassVar[list[str]] = ["past_key_values"]
    # Concept attention builds its own boolean masks, which the flash kernels do not take.
    _supports_flash_attn = False
    _supports_sdpa = True
    _supports_attention_backend = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # The marker subclasses of nn.Linear come first: they must not get the normal init.
        if isinstance(module, ZeroInitLinear):
            init.zeros_(module.weight)
        elif isinstance(module, IdentityInitLinear):
            init.eye_(module.weight)
        else:
            init_backbone_weights(module, self.config.initializer_range)


class ConceptMoEModel(ConceptMoEPreTrainedModel):
    """(B, L) ids -> (B, L, D) final-normed token states, through encoder, concepts and decoder."""

    def __init__(self, config: ConceptMoEConfig) -> None:
        super().__init__(config)
        config.check_fields()
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        width, concept_width = config.hidden_size, config.concept_width
        num_encoder, num_concept = config.encoder_layers, config.num_concept_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, width, self.padding_idx)
        self.encoder_layers = nn.ModuleList(DecoderLayer(config, index) for index in range(num_encoder))
        self.chunker = Chunker(config)
        concept_config = config if concept_width == width else _WidthOverride(config, concept_width)
        if concept_width != width:
            self.concept_in_proj = nn.Linear(width, concept_width, bias=False)
            self.concept_out_proj = nn.Linear(concept_width, width, bias=False)
        else:
            self.concept_in_proj = self.concept_out_proj = None
        self.concept_layers = nn.ModuleList(
            DecoderLayer(concept_config, num_encoder + index) for index in range(num_concept)
        )
        first_decoder = num_encoder + num_concept
        first_joint = config.decoder_layers - config.num_joint_layers
        self.decoder_layers = nn.ModuleList(
            JointDecoderLayer(config, first_decoder + index, width)
            if index >= first_joint
            else DecoderLayer(config, first_decoder + index)
            for index in range(config.decoder_layers)
        )
        self.norm = RMSNorm(width, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding.from_config(config)
        self.gradient_checkpointing = False
        self.post_init()

    def new_cache(self) -> ConceptCache:
        """An empty `ConceptCache` sized for this model."""
        config = self.config
        first_decoder = config.encoder_layers + config.num_concept_layers
        token_layers = list(range(config.encoder_layers)) + list(
            range(first_decoder, config.num_hidden_layers)
        )
        passes = len(config.concept_layer_schedule())
        return ConceptCache(config.num_hidden_layers, token_layers, passes)

    def _concept_cache(self, past_key_values: Cache | None, use_cache: bool) -> ConceptCache | None:
        """Ours as is; an empty foreign cache (generate's DynamicCache) replaced; anything else refused."""
        create = use_cache and not self.training
        return adopt_cache(past_key_values, ConceptCache, self.new_cache, create, "ConceptMoE")

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        **kwargs: Any,
    ) -> ConceptMoEModelOutput | tuple:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        return_dict = kwargs.pop("return_dict", None)
        kwargs.pop("output_attentions", None)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # (B, L, D)
        cache = self._concept_cache(past_key_values, use_cache)
        past_length = cache.get_seq_length() if cache is not None else 0
        position_ids, mask, starts = self._token_layout(
            inputs_embeds, attention_mask, position_ids, past_length
        )
        # The token masks are the plain family's (same layer types, same packing and padding rules).
        masks = PlainDecoderModel.attention_masks(self, inputs_embeds, attention_mask, cache, position_ids)
        layer_kwargs = dict(
            position_embeddings=self.rotary_emb(inputs_embeds, position_ids),
            past_key_values=cache,
            position_ids=position_ids,
            **kwargs,
        )
        all_states = [inputs_embeds]
        token_states = self._run_token_layers(
            self.encoder_layers, inputs_embeds, masks, all_states, None, layer_kwargs
        )
        step = self.concept_step(
            token_states, mask, starts, position_ids, self._state_of(cache, token_states), cache
        )
        if cache is not None:
            cache.state = step.state
        factor = straight_through(step.probs, step.boundaries).unsqueeze(-1).to(token_states.dtype)
        token_states = token_states + step.token_concepts * factor  # (B, L, D)
        token_states = self._run_token_layers(
            self.decoder_layers, token_states, masks, all_states, step.token_concepts, layer_kwargs
        )
        all_states[-1] = self.norm(token_states)
        keep_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        output = ConceptMoEModelOutput(
            last_hidden_state=all_states[-1],
            past_key_values=cache,
            hidden_states=tuple(all_states) if keep_states else None,
            boundary_probs=step.probs,
            boundaries=step.boundaries,
            token_mask=mask,
            document_starts=starts,
        )
        return output.to_tuple() if return_dict is False else output

    def _token_layout(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        past_length: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, L) position ids (counting real tokens, as the plain family), real-token mask, starts."""
        batch_size, length = inputs_embeds.shape[:2]
        if position_ids is None:
            position_ids = default_position_ids(attention_mask, length, past_length, inputs_embeds.device)
        position_ids = position_ids.expand(batch_size, -1)  # (B, L)
        mask = token_mask(attention_mask, (batch_size, length), inputs_embeds.device)
        return position_ids, mask, document_starts(mask, position_ids, has_past=past_length > 0)

    def _state_of(self, cache: ConceptCache | None, token_states: torch.Tensor) -> ConceptState:
        """The cached per-row state, or the empty state (no cache, or the cache's first call)."""
        if cache is not None and cache.state is not None:
            return cache.state
        batch_size, _, width = token_states.shape
        return ConceptState.empty(batch_size, width, width, token_states.device, token_states.dtype)

    def _run_token_layers(
        self,
        layers: nn.ModuleList,
        token_states: torch.Tensor,
        masks: dict[str, Any],
        all_states: list[torch.Tensor],
        token_concepts: torch.Tensor | None,
        layer_kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """Token-level layers; joint layers get the (B, L, D) per-token concepts positionally."""
        for layer in layers:
            layer_mask = masks[layer.attention_type]
            if isinstance(layer, JointDecoderLayer):
                token_states, _ = layer(
                    token_states, token_concepts, attention_mask=layer_mask, **layer_kwargs
                )
            else:
                token_states, _ = layer(token_states, attention_mask=layer_mask, **layer_kwargs)
            all_states.append(token_states)
        return token_states

    def boundaries(
        self,
        token_states: torch.Tensor,
        mask: torch.Tensor,
        starts: torch.Tensor,
        position_ids: torch.Tensor,
        state: ConceptState,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(B, L) probabilities, (B, L) bool boundaries and the (B, L, D) router keys (or None)."""
        config = self.config
        if config.chunking == "fixed":
            opens = fixed_boundaries(position_ids, starts, mask, int(config.compression_ratio))
            return opens.to(torch.float32), opens, None
        past_keys = state.previous_key if config.router == "cosine" else None
        probs, keys = self.chunker(token_states, starts, mask, past_keys=past_keys)
        opens = boundary_decisions(
            probs,
            starts,
            mask,
            noise=config.boundary_noise,
            threshold=config.boundary_threshold,
            tau=config.boundary_tau,
            sigma=config.boundary_sigma,
            training=self.training,
        )
        return probs, opens, keys

    def concept_step(
        self,
        token_states: torch.Tensor,
        mask: torch.Tensor,
        starts: torch.Tensor,
        position_ids: torch.Tensor,
        state: ConceptState,
        cache: ConceptCache | None,
    ) -> _Step:
        """Boundaries, new concepts, concept model, EMA and each token's readable concept."""
        probs, opens, keys = self.boundaries(token_states, mask, starts, position_ids, state)
        documents = state.document[:, None] + torch.cumsum(starts.long(), dim=1)  # (B, L)
        documents = documents.masked_fill(~mask, -1)
        emitted = emit_concepts(
            token_states, probs, opens, mask, starts, position_ids, documents, self.config.pooling, state
        )
        concepts = self.run_concept_model(emitted, cache)  # (B, C, D)
        smoothed = self.continue_ema(concepts, emitted, state)  # (B, C, D)
        token_concepts, new_state = self.read_concepts(smoothed, emitted, mask, opens, state, keys, documents)
        return _Step(token_concepts, probs, opens, new_state)

    def run_concept_model(self, emitted: EmittedConcepts, cache: ConceptCache | None) -> torch.Tensor:
        """(B, C, D) dechunk residual of the new concepts (ĉ or ĉ − c), with cached concept K/V."""
        pooled = emitted.states
        num_new = pooled.shape[1]
        if num_new == 0:
            return pooled
        slots = (emitted.valid, emitted.documents, emitted.positions)
        if cache is not None:
            cache.append_concept_slots(*slots)
            slots = cache.concept_slots()
        concept_states = pooled if self.concept_in_proj is None else self.concept_in_proj(pooled)
        position_embeddings = self.rotary_emb(concept_states, emitted.positions)
        masks = self.concept_masks(slots, num_new)
        for pass_idx, layer_idx in enumerate(self.config.concept_layer_schedule()):
            layer = self.concept_layers[layer_idx]
            concept_states, _ = layer(
                concept_states,
                attention_mask=masks[layer.attention_type],
                position_embeddings=position_embeddings,
                past_key_values=None if cache is None else _ConceptPassCache(cache, pass_idx),
            )
        if self.concept_out_proj is not None:
            concept_states = self.concept_out_proj(concept_states)
        return concept_states - pooled if self.config.dechunk_residual == "delta" else concept_states

    def concept_masks(self, slots: tuple[torch.Tensor, ...], num_queries: int) -> dict[str, Any]:
        """One mask per attention type used by the concept layers.

        Where the full-attention mask is plain causal (every slot real, one document per row, queries
        covering all slots or a single query), sdpa gets no mask: its causal kernel skips the masked
        half, which an explicit boolean mask prevents (about 2.5× faster at 4k concepts on CPU). Eager
        attention treats a missing mask as no mask at all, so it always gets the boolean one.
        """
        valid, documents, _ = slots
        layer_types = {layer.attention_type for layer in self.concept_layers}
        masks: dict[str, Any] = {}
        if "full_attention" in layer_types:
            plain_causal = (
                self.config._attn_implementation == "sdpa"
                and num_queries in (1, valid.shape[1])
                and bool(valid.all())
                and bool((documents == documents[:, :1]).all())
            )
            masks["full_attention"] = (
                None if plain_causal else concept_attention_mask(*slots, num_queries, None)
            )
        if "sliding_attention" in layer_types:
            window = self.config.sliding_window
            masks["sliding_attention"] = concept_attention_mask(*slots, num_queries, window)
        return masks

    def continue_ema(
        self, concepts: torch.Tensor, emitted: EmittedConcepts, state: ConceptState
    ) -> torch.Tensor:
        """(B, C, D) EMA over the new concepts, starting from the row's last EMA value."""
        if concepts.shape[1] == 0:
            return concepts
        # The cached value enters as a concept with p = 1, which reproduces it exactly.
        states = torch.cat([state.last_ema[:, None].to(concepts.dtype), concepts], dim=1)  # (B, 1 + C, D)
        ones = torch.ones_like(emitted.probs[:, :1])
        probs = torch.cat([ones, emitted.probs], dim=1)
        valid = torch.cat([state.has_ema[:, None], emitted.valid], dim=1)
        return ema_scan(states, probs, valid)[:, 1:]

    def read_concepts(
        self,
        smoothed: torch.Tensor,
        emitted: EmittedConcepts,
        mask: torch.Tensor,
        opens: torch.Tensor,
        state: ConceptState,
        keys: torch.Tensor | None,
        documents: torch.Tensor,
    ) -> tuple[torch.Tensor, ConceptState]:
        """(B, L, D) readable concept per token (zeros for none) and the state after this call."""
        # Real tokens before the slice's first opening continue the cached chunk: they read what the
        # row's last cached token read.
        continues = (torch.cumsum(opens.long(), dim=1) == 0) & mask & state.has_readable[:, None]
        index = torch.where(emitted.token_index >= 0, emitted.token_index + 1, continues.long() - 1)
        table = torch.cat([state.last_readable[:, None].to(smoothed.dtype), smoothed], dim=1)  # (B, 1 + C, D)
        token_concepts = gather_concepts_to_tokens(table, index)  # (B, L, D)
        rows = torch.arange(mask.shape[0], device=mask.device)
        has_real = mask.any(dim=1)
        last = mask.shape[1] - 1 - torch.argmax(mask.flip(1).long(), dim=1)  # (B,) last real token

        def at_last(values: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
            keep = has_real.view(-1, *([1] * (old.dim() - 1)))
            return torch.where(keep, values[rows, last].to(old.dtype), old)

        new_state = ConceptState(*emitted.state.tensors())
        new_state.last_readable = at_last(token_concepts, state.last_readable)
        new_state.has_readable = at_last(index >= 0, state.has_readable)
        new_state.document = at_last(documents, state.document)
        if keys is not None:
            new_state.previous_key = at_last(keys, state.previous_key)
        counts = emitted.valid.sum(dim=1)  # (B,)
        if smoothed.shape[1] > 0:
            last_slot = smoothed[rows, (counts - 1).clamp_min(0)]
            new_state.last_ema = torch.where(
                (counts > 0)[:, None], last_slot.to(state.last_ema.dtype), state.last_ema
            )
        new_state.has_ema = state.has_ema | (counts > 0)
        new_state.concept_count = state.concept_count + counts
        return token_concepts, new_state


class ConceptMoEForCausalLM(ConceptMoEPreTrainedModel, GenerationMixin):
    """Causal LM: (B, L) ids -> (B, L, V) next-token logits; logit t depends on tokens <= t only.

    With `labels`, loss = LM cross-entropy (`self.loss_function`, so Trainer's `num_items_in_batch`
    applies) + `aux_loss_weight` · ratio loss (0 for fixed chunking). Scope "global" adds the ratio
    loss share (routing.py; set `ratio_accumulator` to a `RatioAccumulator` for gradient accumulation);
    scope "sequence" is scaled by local label tokens / `num_items_in_batch` when that is given.
    """

    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: ConceptMoEConfig) -> None:
        super().__init__(config)
        self.model = ConceptMoEModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.ratio_accumulator = None
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> ConceptMoECausalLMOutput | tuple:
        return_dict = kwargs.pop("return_dict", None)
        kwargs.pop("output_attentions", None)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        logits = project_logits(self.lm_head, outputs.last_hidden_state, logits_to_keep)  # (B, L_kept, V)
        loss = lm_loss = aux_loss = None
        if labels is not None:
            lm_loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs
            )
            aux_loss = self.auxiliary_loss(outputs, labels, kwargs.get("num_items_in_batch"))
            loss = lm_loss + self.config.aux_loss_weight * aux_loss
        mask, opens = outputs.token_mask, outputs.boundaries
        output = ConceptMoECausalLMOutput(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            lm_loss=None if lm_loss is None else lm_loss.detach(),
            aux_loss=None if aux_loss is None else aux_loss.detach(),
            compression_ratio=(mask.sum() / (opens & mask).sum().clamp_min(1)).detach().float(),
            boundary_prob_mean=outputs.boundary_probs[mask].mean().detach() if mask.any() else None,
        )
        return output.to_tuple() if return_dict is False else output

    def auxiliary_loss(
        self, outputs: ConceptMoEModelOutput, labels: torch.Tensor, num_items_in_batch: Any
    ) -> torch.Tensor:
        """The ratio-loss term (before `aux_loss_weight`); 0 for fixed chunking."""
        probs = outputs.boundary_probs
        if self.config.chunking == "fixed":
            return probs.new_zeros(())
        scope = self.config.ratio_scope
        result = ratio_loss(
            probs,
            outputs.boundaries,
            outputs.token_mask,
            target_ratio=self.config.compression_ratio,
            scope=scope,
            starts=outputs.document_starts,
            # Evaluation batches are not micro-batches of an optimizer step: they never touch the accumulator.
            accumulator=self.ratio_accumulator if scope == "global" and self.training else None,
        )
        if scope == "sequence":
            local_items = (labels[..., 1:] != -100).sum()
            return scale_aux_loss(result.loss, local_items, num_items_in_batch)
        return result.loss


ConceptMoEModel.register_for_auto_class("AutoModel")
ConceptMoEForCausalLM.register_for_auto_class("AutoModelForCausalLM")
