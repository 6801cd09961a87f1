"""The DLCM family: token encoder -> boundaries -> W_up·mean concepts -> concept transformer -> smoothing ->
decoder layers of self-attention, cross-attention to concepts and MLP (DLCM §3; docs/ARCHITECTURE.md,
§3.2 and §4.2).

Legend: B batch, L tokens (this call), C concepts (new in this call), N concept slots readable by tokens
(the null concept at index 0, then the row's concepts), D token width, Dc concept width, Hx / Gx / Kx
cross-attention heads / key-value heads / head dim, V vocabulary.

Pipeline, per call:
1. embed; encoder `DecoderLayer`s at d_token (token K/V in the cache);
2. boundaries from the cosine router (sampled in training) or the rule router (fixed threshold), or every
   R-th token (`chunking="fixed"`); document starts always open a chunk. The discrete decision itself is
   not differentiated; with `smoothing="ema"` the LM loss reaches the learned router's probabilities
   through the smoothing weights and the straight-through confidence (step 4), with `"linear"` the
   router learns from the ratio loss alone. The rule router's probabilities are detached there (§8.1);
3. mean pooling with the availability rule (a chunk becomes readable once it has closed,
   `concept_chunking.emit_concepts`), W_up into d_concept, concept `DecoderLayer`s over the concept sequence
   (RoPE at the opening token's position, causal over concepts of a document, cached concept K/V), a
   final concept norm, then smoothing within a document (`concept_smoothing.py`): "ema" z̃_m = p_m z_m +
   (1 − p_m) z̃_{m−1}, or "linear" z̃_m = z_m + W_s z_{m−1} (W_s = 0 at init, so the identity);
4. decoder layers: token self-attention; cross-attention with Q = RMSNorm(W_Q h) and K, V =
   RMSNorm(W_K z̃), W_V z̃ per concept, with *concept replication* semantics (§4.1): position s carries
   the K/V of its latest readable concept (the learned null concept in a document's first chunk) and
   token t attends causally over s <= t of its document, so a concept weighs as many times as positions
   carried it; under "ema" its output is multiplied by the straight-through confidence of token t's
   decision (value exactly 1); then the MLP;
5. final norm, LM head (logits × 1/s_token under μP with `mup_output_scaling`).

Two forms of step 4, equal by construction: without a cache (training) the K/V are replicated to token
positions and SDPA runs causally (`dlcm_replication.replicated_concept_attention`); with a `ConceptCache` one
K/V per concept is stored with how many positions carried it, and the scores get + log(count)
(`dlcm_replication.concept_attention_counted`) — M entries instead of L. A call with nothing cached before
it takes `config.cross_attention_form` ("auto": the form measured faster on the device).

Causality: a token at position t reads only real tokens <= t of its own document; the concept of its
own open chunk is never readable (its mean would include later tokens).

`output_attentions=True` (eager attention) returns the weights of encoder, concept layers, and each
decoder layer's self- and cross-attention (per concept slot), shapes in
`concept_stack.ConceptModelOutput`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer

from .concept_cache import ConceptCache, ConceptState
from .concept_chunking import Chunker, EmittedConcepts, LegacyRouterKeysMixin, emit_concepts
from .concept_smoothing import previous_concept_smoothing, probability_smoothing
from .concept_stack import (
    ConceptCausalLMMixin,
    ConceptModelOutput,
    ConceptStackMixin,
    RouterPass,
    TokenStep,
    call_documents,
    new_concept_cache,
)
from .concept_views import ConceptPassViews, concept_model_attentions, emission_index, slot_count
from .configuration_dlcm import DLCMConfig
from .dlcm_replication import (
    concept_attention_biased,
    concept_counts,
    concept_slot_weights,
    cross_varlen_kernel,
    log_count_bias,
    preferred_form,
    replicated_concept_attention,
    replicated_concept_attention_varlen,
    run_count_bias,
)
from .layers import (
    MLP,
    Attention,
    AttentionRecorder,
    ConfigView,
    DecoderLayer,
    RMSNorm,
    RotaryEmbedding,
    attention_recorder,
    init_backbone_weights,
    recording_attentions,
    residual_body,
)
from .packing import last_real_picker
from .routing import straight_through
from .transformers_compat import CACHE_KEYS, layer_cache


class SmoothingLinear(nn.Linear):
    """W_s of the concept smoothing, initialised to zero so that smoothing starts as the identity."""


@dataclass
class ConceptReading:
    """How the tokens of one call read concepts: `index` (B, L) the slot each position carries (-1 for
    pads; 0 the null concept), `mask` / `starts` (B, L), for the counted form the (B, L, N) log(count)
    `slot_bias` and the (B, L) `sees` (`dlcm_replication.log_count_bias`, built once for every layer). Only
    tensors outside the autograd graph live here: gradient checkpointing sees the layer's positional
    arguments only."""

    index: torch.Tensor
    mask: torch.Tensor
    starts: torch.Tensor
    slot_bias: torch.Tensor | None = None
    sees: torch.Tensor | None = None
    plain_causal: bool = False


class ConceptCrossAttention(nn.Module):
    """Cross-attention from tokens (d_token) to concepts (d_concept) in a common head dim (eq. 12–14), with
    RMSNorm on queries and keys (§4). While an `AttentionRecorder` is attached it also records the
    (B, Hx, L, N) weights per concept slot (`dlcm_replication.concept_slot_weights`), beside the kernel's
    output.
    """

    attention_recorder: AttentionRecorder | None = None

    def __init__(self, config: DLCMConfig) -> None:
        super().__init__()
        # Kept to read `_attn_implementation` at run time (`set_attn_implementation` changes it later).
        self.config = config
        self.num_heads = config.cross_num_attention_heads
        self.num_key_value_heads = config.cross_num_key_value_heads
        self.head_dim = config.cross_head_dim
        self.scaling = self.head_dim**-0.5
        width, concept_width = config.hidden_size, config.concept_hidden_size
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(concept_width, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(concept_width, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, width, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def concept_kv(self, concept_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, Gx, C, Kx) normed keys and values of (B, C, Dc) concepts."""
        shape = (*concept_states.shape[:-1], self.num_key_value_heads, self.head_dim)
        keys = self.k_norm(self.k_proj(concept_states).view(shape))
        values = self.v_proj(concept_states).view(shape)
        return keys.transpose(1, 2), values.transpose(1, 2)

    def forward(
        self,
        token_states: torch.Tensor,
        concept_keys: torch.Tensor,
        concept_values: torch.Tensor,
        reading: ConceptReading,
        confidence: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, L, D) token states, (B, Gx, N, Kx) slot keys/values -> (B, L, D); the output is multiplied by
        the (B, L) straight-through `confidence` when given (value exactly 1, only its gradient matters)."""
        batch, length, _ = token_states.shape
        query = self.q_proj(token_states).view(batch, length, self.num_heads, self.head_dim)
        query = self.q_norm(query).transpose(1, 2)  # (B, Hx, L, Kx)
        varlen_kernel = (
            cross_varlen_kernel(query, self.config._attn_implementation)
            if reading.slot_bias is None
            else None
        )
        if reading.slot_bias is not None:
            attended = concept_attention_biased(
                query, concept_keys, concept_values, reading.slot_bias, reading.sees, scale=self.scaling
            )
        elif varlen_kernel is not None:
            # GPU path (DLCM §4.1): replicated K/V packed per document on a varlen causal kernel.
            attended = replicated_concept_attention_varlen(
                query,
                concept_keys,
                concept_values,
                reading.index,
                reading.mask,
                reading.starts,
                scale=self.scaling,
                varlen_kernel=varlen_kernel,
            )
        else:
            attended = replicated_concept_attention(
                query,
                concept_keys,
                concept_values,
                reading.index,
                reading.mask,
                reading.starts,
                scale=self.scaling,
                plain_causal=reading.plain_causal,
            )
        if self.attention_recorder is not None:
            self.attention_recorder.record(self, self.slot_weights(query, concept_keys, reading))
        attended = self.o_proj(attended.transpose(1, 2).reshape(batch, length, -1))  # (B, L, D)
        if confidence is not None:
            attended = attended * confidence.unsqueeze(-1).to(attended.dtype)
        return attended

    def slot_weights(
        self, query: torch.Tensor, concept_keys: torch.Tensor, reading: ConceptReading
    ) -> torch.Tensor:
        """(B, Hx, L, N) weight of each token on each slot; the replicated form's log(count) bias is built
        here (`dlcm_replication.run_count_bias`), the counted form brings its own."""
        bias, sees = reading.slot_bias, reading.sees
        if bias is None:
            bias_dtype = torch.promote_types(query.dtype, torch.float32)
            bias, sees = run_count_bias(
                reading.index, reading.mask, reading.starts, concept_keys.shape[2], bias_dtype
            )
        return concept_slot_weights(query, concept_keys, bias, sees, scale=self.scaling)


class DLCMDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: x + self_attn(norm x), x + cross_attn(norm x, concepts), x + mlp(norm x)."""

    def __init__(self, config: DLCMConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.attention_type = "full_attention"
        width, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(width, eps=eps)
        self.self_attn = Attention(config, layer_idx)
        self.cross_attention_layernorm = RMSNorm(width, eps=eps)
        self.cross_attn = ConceptCrossAttention(config)
        self.post_attention_layernorm = RMSNorm(width, eps=eps)
        self.mlp = MLP(width, config.decoder_intermediate_size, config.hidden_act, bias=config.mlp_bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        concept_keys: torch.Tensor,
        concept_values: torch.Tensor,
        confidence: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        reading: ConceptReading | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        # The concept K/V and the (B, L) straight-through confidence are positional so that gradient
        # checkpointing treats them as inputs: reentrant checkpointing sees only positional tensors, and a
        # graph tensor reaching the recompute another way is backpropagated once per layer (an error).
        def cross(states: torch.Tensor) -> torch.Tensor:
            normed = self.cross_attention_layernorm(states)
            return self.cross_attn(normed, concept_keys, concept_values, reading, confidence)

        cache = layer_cache(kwargs)

        return residual_body(
            self,
            hidden_states,
            cross,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=cache,
            **kwargs,
        )


class DLCMPreTrainedModel(LegacyRouterKeysMixin, PreTrainedModel):
    """Shared class attributes and (μP-aware) weight initialisation of the DLCM family."""

    config_class = DLCMConfig
    config: DLCMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules: ClassVar[list[str]] = ["DecoderLayer", "DLCMDecoderLayer"]
    _skip_keys_device_placement: ClassVar[list[str]] = list(CACHE_KEYS)
    # Concept and cross attention build their own masks, which the flash kernels do not take.
    _supports_flash_attn = False
    _supports_sdpa = True
    _supports_attention_backend = True

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        # transformers decides from the source: an attention class on nn.Module that does not look its
        # kernel up (ConceptCrossAttention, whose forms need no kernel choice) makes it refuse
        # `set_attn_implementation`. Every attention that does choose reads `config._attn_implementation`
        # when it runs, so switching after loading is safe.
        return True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        config = self.config
        if isinstance(module, SmoothingLinear):
            init.zeros_(module.weight)
        elif isinstance(module, nn.Linear) and getattr(module, "mup_stage", None) is not None:
            # Decoupled μP: hidden matrices of a stage start with variance σ² / s (s = 1 without μP).
            scale = config.mup_concept_scale if module.mup_stage == "concept" else config.mup_token_scale
            init_backbone_weights(module, config.initializer_range / scale**0.5)
        elif isinstance(module, DLCMModel):
            init.normal_(module.null_concept, mean=0.0, std=config.initializer_range)
        else:
            init_backbone_weights(module, config.initializer_range)


def mup_stage_of(parameter_name: str) -> str | None:
    """ "token" / "concept" for the hidden matrices of each stage, None for the others (embeddings, norms,
    LM head, null concept). The concept stage owns what reads or writes concept width."""
    concept_prefixes = ("concept_layers.", "concept_in_proj.", "smoothing.")
    concept_parts = (".cross_attn.k_proj.", ".cross_attn.v_proj.")
    name = parameter_name.removeprefix("model.")
    if not name.endswith(".weight") or "norm" in name.rsplit(".", 2)[-2] or name.startswith("embed_tokens"):
        return None
    if name.startswith(concept_prefixes) or any(part in name for part in concept_parts):
        return "concept"
    if name.startswith(("encoder_layers.", "decoder_layers.", "chunker.")):
        return "token"
    return None


class DLCMModel(ConceptStackMixin, DLCMPreTrainedModel):
    """(B, L) ids -> (B, L, D) final-normed token states through encoder, concepts and decoder.

    `hidden_states`: num_hidden_layers + 1 token-level tensors: the (B, L, D) embeddings, each encoder
    layer, each concept layer as a (B, L, Dc) view (the concept each token emits, i.e. closes, zeros
    elsewhere; before the concept norm and smoothing), each decoder layer (the last final-normed).
    `attentions` (eager): encoder (B, H, L, S), concept layers (B, Hc, L, N) in the same token view, then
    per decoder layer its self-attention (B, H, L, S) and cross-attention (B, Hx, L, 1 + N); never None.
    Details in `concept_stack.ConceptModelOutput`.
    """

    family_name = "DLCM"

    def __init__(self, config: DLCMConfig) -> None:
        super().__init__(config)
        config.check_fields()
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        width, concept_width = config.hidden_size, config.concept_hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, width, self.padding_idx)
        self.encoder_layers = nn.ModuleList(
            DecoderLayer(config, index) for index in range(config.encoder_layers)
        )
        self.chunker = Chunker(config)
        self.concept_in_proj = nn.Linear(width, concept_width, bias=False)
        self.null_concept = nn.Parameter(torch.zeros(concept_width))
        concept_config = ConfigView(
            config,
            hidden_size=concept_width,
            num_attention_heads=config.concept_num_attention_heads,
            num_key_value_heads=config.concept_num_key_value_heads,
            head_dim=config.concept_head_dim,
            intermediate_size=config.concept_intermediate_size,
        )
        first_concept = config.encoder_layers
        self.concept_layers = nn.ModuleList(
            DecoderLayer(concept_config, first_concept + index) for index in range(config.concept_layers)
        )
        self.concept_norm = RMSNorm(concept_width, eps=config.rms_norm_eps)
        # Only the W_s form has parameters; "ema" reads the router's probabilities instead.
        linear = config.smoothing == "linear"
        self.smoothing = SmoothingLinear(concept_width, concept_width, bias=False) if linear else None
        first_decoder = first_concept + config.concept_layers
        self.decoder_layers = nn.ModuleList(
            DLCMDecoderLayer(config, first_decoder + index) for index in range(config.decoder_layers)
        )
        self.norm = RMSNorm(width, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding.from_config(config)
        self.concept_rotary_emb = RotaryEmbedding.from_config(concept_config)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                module.mup_stage = mup_stage_of(f"{name}.weight")
        self.gradient_checkpointing = False
        self.post_init()

    def new_cache(self) -> ConceptCache:
        """An empty `ConceptCache`: token K/V for encoder and decoder layers, concept K/V for each concept
        layer and each decoder layer's cross-attention."""
        config = self.config
        passes = config.concept_layers + config.decoder_layers
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
        keep_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        all_states = [step_in.inputs_embeds]
        with recording_attentions(self, recorder):
            router, emission = self.run_stages(step_in, all_states, keep_states)
        all_states[-1] = self.norm(all_states[-1])
        attentions = None
        if recorder is not None:
            num_slots = slot_count(step_in.cache)
            attentions = concept_model_attentions(self, recorder, emission, num_slots, step_in.inputs_embeds)
        output = ConceptModelOutput(
            last_hidden_state=all_states[-1],
            cache=step_in.cache,
            hidden_states=tuple(all_states) if keep_states else None,
            attentions=attentions,
            boundary_probs=router.probs,
            boundaries=router.opens,
            token_mask=step_in.mask,
            document_starts=step_in.starts,
            boundary_scores=router.boundary_scores,
        )
        return output.to_tuple() if return_dict is False else output

    def run_stages(
        self, step_in: TokenStep, all_states: list[torch.Tensor], keep_states: bool = False
    ) -> tuple[RouterPass, torch.Tensor]:
        """Encoder, boundaries, concept model and decoder over one call; appends each layer's output to
        `all_states` (the last one before the final norm; concept layers as (B, L, Dc) token views when
        `keep_states`, `concept_views`) and returns the call's `RouterPass` and the new concept each token
        emits, (B, L) (-1: none)."""
        cache, position_ids = step_in.cache, step_in.position_ids
        mask, starts, masks, layer_kwargs = step_in.mask, step_in.starts, step_in.masks, step_in.layer_kwargs
        token_states = step_in.inputs_embeds
        for layer in self.encoder_layers:
            token_states, _ = layer(token_states, attention_mask=masks[layer.attention_type], **layer_kwargs)
            all_states.append(token_states)
        state = self.state_of(cache, token_states)
        documents = call_documents(state, starts, mask)  # (B, L)
        router = self.boundaries(token_states, mask, starts, position_ids, state, documents)
        probs, opens = router.probs, router.opens
        smoothing_probs = self.smoothing_probs(probs)
        emitted = emit_concepts(
            token_states, smoothing_probs, opens, mask, starts, position_ids, documents, "mean", state
        )
        slots_before = cache.num_concept_slots if cache is not None else 0
        emission = emission_index(opens, mask, state.has_open, "mean")  # (B, L)
        views = ConceptPassViews(emission) if keep_states else None
        concepts, new_state = self.concept_model(emitted, state, cache, views)
        if views is not None:
            all_states.extend(views.states(len(self.concept_layers), token_states, concepts.shape[-1]))
        at_last = last_real_picker(mask)
        reading, new_state = self.read_concepts(
            emitted, opens, mask, starts, slots_before, new_state, cache, at_last
        )
        new_state = self.remember_router(new_state, router.keys, documents, state, at_last)
        new_state = self.remember_recent(new_state, router.recent)
        # (B, L) or None; handed to each decoder layer positionally (see DLCMDecoderLayer.forward).
        confidence = None
        if self.config.smoothing == "ema" and torch.is_grad_enabled():
            confidence = straight_through(smoothing_probs, opens)
        if cache is not None:
            cache.state = new_state
        for index, layer in enumerate(self.decoder_layers):
            concept_keys, concept_values = self.cross_kv(layer, concepts, cache, index)
            token_states, _ = layer(
                token_states,
                concept_keys,
                concept_values,
                confidence,
                attention_mask=masks[layer.attention_type],
                reading=reading,
                **layer_kwargs,
            )
            all_states.append(token_states)
        return router, emission

    def concept_model(
        self,
        emitted: EmittedConcepts,
        state: ConceptState,
        cache: ConceptCache | None,
        views: ConceptPassViews | None = None,
    ) -> tuple[torch.Tensor, ConceptState]:
        """(B, C, Dc) smoothed new concepts (W_up, concept layers, norm, smoothing) and the state after;
        `views` collects each concept layer's token view (output_hidden_states)."""
        new_state = ConceptState(*emitted.state.tensors())
        pooled = emitted.states
        if pooled.shape[1] == 0:
            return pooled.new_zeros(*pooled.shape[:2], self.config.concept_hidden_size), new_state
        slots = (emitted.valid, emitted.documents, emitted.positions)
        if cache is not None:
            cache.append_concept_slots(*slots)
            slots = cache.concept_slots()
        concept_states = self.concept_in_proj(pooled)  # (B, C, Dc)
        position_embeddings = self.concept_rotary_emb(concept_states, emitted.positions)
        concept_states = self.run_concept_layers(concept_states, position_embeddings, slots, cache, views)
        concept_states = self.concept_norm(concept_states)
        return self.smooth(concept_states, emitted, state, new_state)

    def smoothing_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """(B, L) the probabilities the smoothing and the confidence read: the rule router's detached, so
        that the LM loss cannot steer its segmentation through them (§8.1)."""
        return probs.detach() if self.config.router == "rule" else probs

    def smooth(
        self,
        concept_states: torch.Tensor,
        emitted: EmittedConcepts,
        state: ConceptState,
        new_state: ConceptState,
    ) -> tuple[torch.Tensor, ConceptState]:
        """(B, C, Dc) smoothed new concepts (`concept_smoothing.py`) continuing the row's cached concept,
        which is z̃ of its latest concept under "ema" and z (before smoothing) under "linear"."""
        if self.smoothing is None:
            smoothed = probability_smoothing(
                concept_states,
                emitted.probs,
                emitted.valid,
                state.last_concept,
                state.last_concept_document >= 0,
            )
            carried = smoothed
        else:
            smoothed = previous_concept_smoothing(
                concept_states,
                self.smoothing.weight,
                emitted.documents,
                emitted.valid,
                state.last_concept,
                state.last_concept_document,
            )
            carried = concept_states
        counts = emitted.valid.sum(dim=1)  # (B,)
        has_new = counts > 0
        rows = torch.arange(counts.shape[0], device=counts.device)
        last = (counts - 1).clamp_min(0)
        new_state.last_concept = torch.where(
            has_new[:, None], carried[rows, last].to(state.last_concept.dtype), state.last_concept
        )
        new_state.last_concept_document = torch.where(
            has_new, emitted.documents[rows, last], state.last_concept_document
        )
        new_state.concept_count = state.concept_count + counts
        return smoothed, new_state

    def read_concepts(
        self,
        emitted: EmittedConcepts,
        opens: torch.Tensor,
        mask: torch.Tensor,
        starts: torch.Tensor,
        slots_before: int,
        state: ConceptState,
        cache: ConceptCache | None,
        at_last: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> tuple[ConceptReading, ConceptState]:
        """Which slot each position carries (null concept 0, cache slot j as j + 1), in the replicated
        form when nothing came before this call (training, a fresh prefill) and otherwise in the counted
        form, continuing the row's cached counts; a cache also gets each row's counts at its last token."""
        # Tokens before the slice's first opening continue the cached chunk: they carry what the row's
        # last cached token carried. Other tokens with no closed chunk in their document carry the null.
        continues = (torch.cumsum((opens & mask).long(), dim=1) == 0) & (state.read_slot[:, None] >= 0)
        carried = torch.where(continues, state.read_slot[:, None], 0)
        index = torch.where(emitted.token_index >= 0, 1 + slots_before + emitted.token_index, carried)
        index = index.masked_fill(~mask, -1)  # (B, L)
        fresh = cache is None or (slots_before == 0 and not bool((state.read_slot >= 0).any()))
        num_slots = 1 + (cache.num_concept_slots if cache is not None else emitted.states.shape[1])
        form = "counted" if not fresh else self.fresh_cross_attention_form(mask, num_slots)
        # The log(count) bias in at least float32: a half-precision log would round long runs' weights.
        bias_dtype = torch.promote_types(emitted.states.dtype, torch.float32)
        if form == "replicated":
            plain_causal = bool(mask.all()) and not bool(starts[:, 1:].any())
            reading = ConceptReading(index, mask, starts, plain_causal=plain_causal)
            if cache is not None:
                state = self._remember_reads(state, index, mask, starts, num_slots, at_last)
            return reading, state
        if fresh:
            # Built from each slot's run; a cache keeps only each row's counts at its last token.
            bias, sees = run_count_bias(index, mask, starts, num_slots, bias_dtype)  # (B, L, N), (B, L)
            if cache is not None:
                state = self._remember_reads(state, index, mask, starts, num_slots, at_last)
            return ConceptReading(index, mask, starts, slot_bias=bias, sees=sees), state
        initial = nn.functional.pad(state.read_counts, (0, num_slots - state.read_counts.shape[1]))
        counts = concept_counts(index, mask, starts, num_slots, initial_counts=initial)  # (B, L, N)
        state.read_slot = at_last(index, state.read_slot)
        state.read_counts = at_last(counts, initial)
        bias, sees = log_count_bias(counts, bias_dtype)
        return ConceptReading(index, mask, starts, slot_bias=bias, sees=sees), state

    def fresh_cross_attention_form(self, mask: torch.Tensor, num_slots: int) -> str:
        """The form of a call with nothing before it (training, a first prefill): the config's, or under
        "auto" the one measured faster on this device at this size (`dlcm_replication.preferred_form`)."""
        form = self.config.cross_attention_form
        if form != "auto":
            return form
        return preferred_form(mask.device, mask.shape[1], num_slots, torch.is_grad_enabled())

    def _remember_reads(
        self,
        state: ConceptState,
        index: torch.Tensor,
        mask: torch.Tensor,
        starts: torch.Tensor,
        num_slots: int,
        at_last: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> ConceptState:
        """Each row's slot at its last real token and, per slot, how many positions of that token's
        document carried it (what the counted form continues from), without a (B, L, N) table."""
        documents = torch.cumsum((starts & mask).long(), dim=1)  # (B, L)
        last_document = at_last(documents, documents.new_full((mask.shape[0],), -1))
        carries = mask & (index >= 0) & (documents == last_document[:, None])
        # Rows without a real token carry nothing: their counts stay zero.
        counts = torch.zeros(mask.shape[0], num_slots, dtype=torch.long, device=mask.device)
        counts.scatter_add_(1, index.clamp(min=0), carries.long())
        state.read_slot = at_last(index, state.read_slot)
        state.read_counts = counts
        return state

    def remember_router(
        self,
        state: ConceptState,
        keys: torch.Tensor | None,
        documents: torch.Tensor,
        old: ConceptState,
        at_last: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> ConceptState:
        """The router key and document of each row's last real token, for the next call."""
        if keys is not None:
            state.previous_key = at_last(keys, old.previous_key)
        state.document = at_last(documents, old.document)
        return state

    def cross_kv(
        self, layer: DLCMDecoderLayer, concepts: torch.Tensor, cache: ConceptCache | None, index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, Gx, N, Kx) keys and values of the null concept and every readable concept slot."""
        batch = concepts.shape[0]
        null = self.null_concept.to(concepts.dtype).expand(batch, 1, -1)
        # One projection over [null, new concepts]: a separate one-row product could round differently.
        keys, values = layer.cross_attn.concept_kv(torch.cat([null, concepts], dim=1))  # (B, Gx, 1 + C, Kx)
        if cache is None:
            return keys, values
        new_keys, new_values = cache.update_concepts(
            keys[:, :, 1:], values[:, :, 1:], self.config.concept_layers + index
        )
        return torch.cat([keys[:, :, :1], new_keys], dim=2), torch.cat([values[:, :, :1], new_values], dim=2)


class DLCMForCausalLM(ConceptCausalLMMixin, DLCMPreTrainedModel, GenerationMixin):
    """Causal LM: (B, L) ids -> (B, L, V) next-token logits; logit t depends on tokens <= t only.

    Loss = LM cross-entropy + `aux_loss_weight` · ratio loss (`ConceptCausalLMMixin`); outputs carry
    `lm_loss`, `aux_loss`, `compression_ratio` (real tokens per concept) and `boundary_prob_mean`. Under
    μP with `mup_output_scaling` the logits are multiplied by 1 / s_token.
    """

    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DLCMConfig) -> None:
        super().__init__(config)
        self.model = DLCMModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.ratio_accumulator = None
        self.post_init()

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        config = self.config
        if config.mup_base_width is None or not config.mup_output_scaling:
            return logits
        return logits / config.mup_token_scale


DLCMModel.register_for_auto_class("AutoModel")
DLCMForCausalLM.register_for_auto_class("AutoModelForCausalLM")
