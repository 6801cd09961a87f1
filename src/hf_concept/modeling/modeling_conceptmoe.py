"""The ConceptMoE family: token encoder -> chunk -> concept model (dense or MoE) -> dechunk -> decoder.

Legend: B batch, L tokens (this call), C concepts (new in this call), D token width, Dc concept width,
V vocabulary.

Pipeline (ConceptMoE §3; docs/ARCHITECTURE.md, §4.1), per call:
1. embed; encoder `DecoderLayer`s at token level (token K/V in the cache);
2. boundaries: cosine or linear router (`chunking="dynamic"`; Bernoulli/Gaussian noise only in
   training; starts forced) or every R-th token of each document (`"fixed"`, p = 1 at openings, 0
   elsewhere, so the ratio loss has nothing to steer and is 0);
3. the concepts that become readable in this call (`concept_chunking.emit_concepts`): pooled "first", "sum" or
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

`output_attentions=True` (eager attention) returns the weights of encoder, concept passes and decoder,
shapes in `concept_stack.ConceptModelOutput`.
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

from .concept_cache import ConceptCache, ConceptState
from .concept_chunking import (
    Chunker,
    EmittedConcepts,
    IdentityInitLinear,
    LegacyRouterKeysMixin,
    emit_concepts,
)
from .concept_smoothing import probability_smoothing
from .concept_stack import (
    ConceptCausalLMMixin,
    ConceptModelOutput,
    ConceptStackMixin,
    call_documents,
    new_concept_cache,
)
from .concept_views import ConceptPassViews, concept_model_attentions, emission_index, slot_count
from .configuration_conceptmoe import ConceptMoEConfig
from .layers import (
    Attention,
    ConfigView,
    DecoderLayer,
    RMSNorm,
    RotaryEmbedding,
    attention_recorder,
    init_backbone_weights,
    recording_attentions,
)
from .packing import last_real_picker
from .pooling import gather_concepts_to_tokens
from .routing import straight_through
from .transformers_compat import CACHE_KEYS, layer_cache


class ZeroInitLinear(nn.Linear):
    """A projection initialised to zero (joint decoding), so it changes nothing at conversion."""


class JointAttention(Attention):
    """Attention whose q, k, v also receive W^c_{q,k,v} of the token's concept (ConceptMoE eq. 11).

    With `joint_decoding_norm` the projections read RMSNorm(concept), as q/k/v_proj read the layer's
    normed input: the concept is an unnormalised residual-stream update, and a projection's gradient grows
    with the size of what it reads. A zero concept (none readable yet) stays zero.
    """

    def __init__(self, config, layer_idx: int, concept_width: int) -> None:
        super().__init__(config, layer_idx)
        self.concept_norm = (
            RMSNorm(concept_width, eps=config.rms_norm_eps) if config.joint_decoding_norm else None
        )
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
        if self.concept_norm is not None:
            token_concepts = self.concept_norm(token_concepts)
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
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # `token_concepts` is positional so that gradient checkpointing treats it as an input.
        cache = layer_cache(kwargs)
        return self.attend_and_mix(
            hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=cache,
            token_concepts=token_concepts,
            **kwargs,
        )


@dataclass
class _Step:
    """One call's concept-level results: per-token concepts, router outputs and the next state."""

    token_concepts: torch.Tensor
    probs: torch.Tensor
    scores: torch.Tensor | None
    boundaries: torch.Tensor
    state: ConceptState
    # (B, L) the new concept each token emits (-1: none) and, with output_hidden_states, each concept
    # pass's (B, L, Dc) token view (`concept_views`).
    emission: torch.Tensor
    pass_states: list[torch.Tensor]


class ConceptMoEPreTrainedModel(LegacyRouterKeysMixin, PreTrainedModel):
    """Shared class attributes and weight initialisation of the ConceptMoE family."""

    config_class = ConceptMoEConfig
    config: ConceptMoEConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules: ClassVar[list[str]] = ["DecoderLayer", "JointDecoderLayer"]
    _skip_keys_device_placement: ClassVar[list[str]] = list(CACHE_KEYS)
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


class ConceptMoEModel(ConceptStackMixin, ConceptMoEPreTrainedModel):
    """(B, L) ids -> (B, L, D) final-normed token states, through encoder, concepts and decoder.

    `hidden_states`: num_hidden_layers + 1 token-level tensors (one per concept pass under
    `concept_loop`): the (B, L, D) embeddings, each encoder layer, each concept pass as a (B, L, Dc) view
    (the concept each token emits, zeros elsewhere), each decoder layer (the last final-normed).
    `attentions` (eager): encoder (B, H, L, S), concept passes (B, Hc, L, N) in the same token view,
    decoder (B, H, L, S); never None. Details in `concept_stack.ConceptModelOutput`.
    """

    family_name = "ConceptMoE"

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
        # The concept stack may be wider, with more heads and experts, than the token stages (§3.5).
        overrides = config.concept_overrides()
        concept_config = ConfigView(config, **overrides) if overrides else config
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
        passes = len(config.concept_layer_schedule())
        return new_concept_cache(
            config.num_hidden_layers, config.encoder_layers, config.decoder_layers, passes
        )

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        **kwargs: Any,
    ) -> ConceptModelOutput | tuple:
        return_dict = kwargs.pop("return_dict", None)
        recorder = attention_recorder(self.config, kwargs.pop("output_attentions", None))
        step_in = self.begin_step(
            input_ids, inputs_embeds, attention_mask, position_ids, cache, use_cache, kwargs
        )
        inputs_embeds, cache, position_ids = step_in.inputs_embeds, step_in.cache, step_in.position_ids
        mask, starts, masks, layer_kwargs = step_in.mask, step_in.starts, step_in.masks, step_in.layer_kwargs
        keep_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        all_states = [inputs_embeds]
        with recording_attentions(self, recorder):
            token_states = self._run_token_layers(
                self.encoder_layers, inputs_embeds, masks, all_states, None, layer_kwargs
            )
            step = self.concept_step(
                token_states,
                mask,
                starts,
                position_ids,
                self.state_of(cache, token_states),
                cache,
                keep_states,
            )
            all_states.extend(step.pass_states)
            if cache is not None:
                cache.state = step.state
            factor = straight_through(step.probs, step.boundaries).unsqueeze(-1).to(token_states.dtype)
            token_states = token_states + step.token_concepts * factor  # (B, L, D)
            token_states = self._run_token_layers(
                self.decoder_layers, token_states, masks, all_states, step.token_concepts, layer_kwargs
            )
        all_states[-1] = self.norm(token_states)
        output = ConceptModelOutput(
            last_hidden_state=all_states[-1],
            cache=cache,
            hidden_states=tuple(all_states) if keep_states else None,
            attentions=None
            if recorder is None
            else concept_model_attentions(self, recorder, step.emission, slot_count(cache), inputs_embeds),
            boundary_probs=step.probs,
            boundaries=step.boundaries,
            token_mask=mask,
            document_starts=starts,
            boundary_scores=step.scores,
        )
        return output.to_tuple() if return_dict is False else output

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

    def concept_step(
        self,
        token_states: torch.Tensor,
        mask: torch.Tensor,
        starts: torch.Tensor,
        position_ids: torch.Tensor,
        state: ConceptState,
        cache: ConceptCache | None,
        keep_states: bool = False,
    ) -> _Step:
        """Boundaries, new concepts, concept model, EMA and each token's readable concept; with
        `keep_states` also each concept pass's (B, L, Dc) token view (`concept_views`)."""
        pooling = self.config.pooling
        documents = call_documents(state, starts, mask)  # (B, L)
        router = self.boundaries(token_states, mask, starts, position_ids, state, documents)
        probs, opens = router.probs, router.opens
        emitted = emit_concepts(
            token_states, probs, opens, mask, starts, position_ids, documents, pooling, state
        )
        emission = emission_index(opens, mask, state.has_open, pooling)  # (B, L)
        views = ConceptPassViews(emission) if keep_states else None
        concepts = self.run_concept_model(emitted, cache, views)  # (B, C, D)
        # The dechunk EMA is DLCM's "ema" smoothing: one function continues both from the cached value.
        weights = emitted.probs
        if self.config.dechunk_ema == "straight_through":
            weights = straight_through(emitted.probs, emitted.valid)  # 1 in value, p's gradient
        smoothed = probability_smoothing(concepts, weights, emitted.valid, state.last_ema, state.has_ema)
        token_concepts, new_state = self.read_concepts(
            smoothed, emitted, mask, opens, state, router.keys, documents
        )
        new_state = self.remember_recent(new_state, router.recent)
        passes = len(self.concept_layer_schedule())
        concept_width = self.config.concept_width
        pass_states = [] if views is None else views.states(passes, token_states, concept_width)
        return _Step(token_concepts, probs, router.boundary_scores, opens, new_state, emission, pass_states)

    def run_concept_model(
        self, emitted: EmittedConcepts, cache: ConceptCache | None, views: ConceptPassViews | None = None
    ) -> torch.Tensor:
        """(B, C, D) dechunk residual of the new concepts (ĉ or ĉ − c), with cached concept K/V; `views`
        collects each pass's token view (output_hidden_states)."""
        pooled = emitted.states
        if pooled.shape[1] == 0:
            return pooled
        slots = (emitted.valid, emitted.documents, emitted.positions)
        if cache is not None:
            cache.append_concept_slots(*slots)
            slots = cache.concept_slots()
        concept_states = pooled if self.concept_in_proj is None else self.concept_in_proj(pooled)
        position_embeddings = self.rotary_emb(concept_states, emitted.positions)
        concept_states = self.run_concept_layers(concept_states, position_embeddings, slots, cache, views)
        if self.concept_out_proj is not None:
            concept_states = self.concept_out_proj(concept_states)
        return concept_states - pooled if self.config.dechunk_residual == "delta" else concept_states

    def concept_layer_schedule(self) -> list[int]:
        return self.config.concept_layer_schedule()

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
        at_last = last_real_picker(mask)
        new_state = ConceptState(*emitted.state.tensors())
        new_state.last_readable = at_last(token_concepts, state.last_readable)
        new_state.has_readable = at_last(index >= 0, state.has_readable)
        new_state.document = at_last(documents, state.document)
        if keys is not None:
            new_state.previous_key = at_last(keys, state.previous_key)
        counts = emitted.valid.sum(dim=1)  # (B,)
        if smoothed.shape[1] > 0:
            rows = torch.arange(counts.shape[0], device=counts.device)
            last_slot = smoothed[rows, (counts - 1).clamp_min(0)]
            new_state.last_ema = torch.where(
                (counts > 0)[:, None], last_slot.to(state.last_ema.dtype), state.last_ema
            )
        new_state.has_ema = state.has_ema | (counts > 0)
        new_state.concept_count = state.concept_count + counts
        return token_concepts, new_state


class ConceptMoEForCausalLM(ConceptCausalLMMixin, ConceptMoEPreTrainedModel, GenerationMixin):
    """Causal LM: (B, L) ids -> (B, L, V) next-token logits; logit t depends on tokens <= t only.

    With `labels`, loss = LM cross-entropy (`self.loss_function`, so Trainer's `num_items_in_batch`
    applies) + `aux_loss_weight` · ratio loss (0 for fixed chunking). Scope "global" adds the ratio
    loss share (routing.py; set `ratio_accumulator` to a `RatioAccumulator` for gradient accumulation);
    scopes "sequence" and "batch" (and "global" where a training forward without an accumulator falls
    back to "batch") are scaled by local label tokens / `num_items_in_batch` when that is given
    (`routing.scale_aux_loss`), as the LM loss is.
    """

    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: ConceptMoEConfig) -> None:
        super().__init__(config)
        self.model = ConceptMoEModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.ratio_accumulator = None
        self.post_init()


ConceptMoEModel.register_for_auto_class("AutoModel")
ConceptMoEForCausalLM.register_for_auto_class("AutoModelForCausalLM")
