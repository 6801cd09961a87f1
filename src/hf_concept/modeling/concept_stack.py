"""The concept-level machinery that ConceptMoE and DLCM share (docs/ARCHITECTURE.md, §4.1 and §4.2).

Legend: B batch, L tokens (this call), C concept slots, D token width, Dc concept width.

- `ConceptPassCache`: what one concept layer pass sees as `past_key_values`; it appends to that pass's
  concept K/V in the `ConceptCache`.
- `ConceptStackMixin`: methods of a concept-level model (`self.config`, `self.chunker`,
  `self.concept_layers` given): the token layout (positions, real tokens, document starts), boundary
  decisions (learned router, DLCM's rule router, or fixed chunking), the masks of the concept layers and
  one run of the concept layers over new concepts with cached concept K/V.

Causality: a concept attends to earlier-or-equal concept slots of its own document; boundaries read
tokens t − 1 and t only (the previous one from the cache for a continued row).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache
from transformers.modeling_outputs import ModelOutput
from transformers.utils import logging

from .causal_lm import CausalLMMixin
from .concept_cache import ConceptCache, ConceptState
from .concept_chunking import fixed_boundaries
from .concept_ranking import local_rank_scores, recent_after
from .forward_only_cache import adopt_cache
from .layers import default_position_ids
from .loss_terms import LOSS_IN_FORWARD, TRAINERS, warn_loss_terms_dropped
from .modeling_plain import PlainDecoderModel
from .packing import document_starts, token_mask
from .pooling import slot_attention_mask
from .ratio_step import RatioAccumulator
from .routing import boundary_decisions, expected_boundaries, ratio_loss, rule_boundaries, scale_aux_loss
from .transformers_compat import cache_field, cache_kwarg, take_cache
from .varlen import VARLEN_ATTENTION

logger = logging.get_logger(__name__)


def isolate_invalid_queries(mask: torch.Tensor | None, valid: torch.Tensor) -> torch.Tensor | None:
    """The (B, 1, Cq, Ck) concept mask with each invalid query slot reading only itself. Their outputs
    are never used; an invalid slot that reads its row's valid concepts breaks the causal-segment shape
    the varlen kernel needs (trailing invalid slots of a short row), one that reads itself keeps it."""
    if mask is None:
        return None
    num_queries, num_keys = mask.shape[-2:]
    query_valid = valid[:, num_keys - num_queries :]  # (B, Cq)
    own = (
        torch.arange(num_keys, device=mask.device)[None, :]
        == torch.arange(num_keys - num_queries, num_keys, device=mask.device)[:, None]
    )  # (Cq, Ck)
    return torch.where(query_valid[:, None, :, None], mask, own)


class ConceptPassCache:
    """What one concept pass's attention sees as `past_key_values`: appends to that pass's concept K/V."""

    def __init__(self, cache: ConceptCache, pass_idx: int) -> None:
        self.cache, self.pass_idx = cache, pass_idx

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        return self.cache.update_concepts(keys, values, self.pass_idx)


@dataclass
class TokenStep:
    """What a concept-level forward starts from: (B, L, D) embeddings, the cache (or None), (B, L) position
    ids, real-token mask and document starts, one token-layer mask per attention type, and the keyword
    arguments every token layer gets (RoPE tables, cache, positions, the caller's extras)."""

    inputs_embeds: torch.Tensor
    cache: ConceptCache | None
    position_ids: torch.Tensor
    mask: torch.Tensor
    starts: torch.Tensor
    masks: dict[str, Any]
    layer_kwargs: dict[str, Any]


@dataclass
class RouterPass:
    """One call's boundaries: (B, L) probabilities (with gradient), the (B, L) scores the decisions read
    (the probabilities, or their local ranks under `boundary_rank_window`, `concept_ranking`), the (B, L)
    bool boundaries, the (B, L, Dk) router keys (None without a cosine or rule router) and each row's
    recent window after the call (None without `boundary_rank_window`)."""

    probs: torch.Tensor
    scores: torch.Tensor
    opens: torch.Tensor
    keys: torch.Tensor | None
    recent: tuple[torch.Tensor, torch.Tensor] | None

    @property
    def boundary_scores(self) -> torch.Tensor | None:
        """The scores as `ConceptModelOutput.boundary_scores` reports them: None where they are `probs`."""
        return None if self.scores is self.probs else self.scores


def call_documents(state: ConceptState, starts: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, L) long: each real token's document id, counting on from the row's cached document (-1 at
    pads)."""
    return (state.document[:, None] + torch.cumsum(starts.long(), dim=1)).masked_fill(~mask, -1)


def new_concept_cache(
    num_hidden_layers: int, encoder_layers: int, decoder_layers: int, passes: int
) -> ConceptCache:
    """An empty `ConceptCache`: token K/V for the first `encoder_layers` and last `decoder_layers` layers
    of the flat numbering, `passes` concept K/V stores."""
    first_decoder = num_hidden_layers - decoder_layers
    token_layers = list(range(encoder_layers)) + list(range(first_decoder, num_hidden_layers))
    return ConceptCache(num_hidden_layers, token_layers, passes)


class ConceptStackMixin:
    """Shared methods of the concept-level models (see the module docstring)."""

    family_name = "this family"
    # The step's `RatioAccumulator` (global ratio scope), set through the causal LM's `ratio_accumulator`.
    ratio_accumulator = None

    def begin_step(
        self,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        cache: Cache | None,
        use_cache: bool | None,
        kwargs: dict[str, Any],
    ) -> TokenStep:
        """Embeddings, the family's cache (`cache`, or `past_key_values` in `kwargs`; generate's empty
        default replaced), token layout and masks."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if not kwargs.pop(LOSS_IN_FORWARD, False):
            warn_loss_terms_dropped(self, self.family_name, self.extra_loss_terms())
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # (B, L, D)
        create = use_cache and not self.training
        cache = adopt_cache(take_cache(cache, kwargs), ConceptCache, self.new_cache, create, self.family_name)
        past_length = cache.get_seq_length() if cache is not None else 0
        position_ids, mask, starts = self.token_layout(
            inputs_embeds, attention_mask, position_ids, past_length
        )
        if cache is not None:
            # What `crop` needs to feed these tokens again (family_cache).
            given_embeds = inputs_embeds if input_ids is None else None
            cache.record_call(self, input_ids, given_embeds, attention_mask, position_ids)
        # The token masks are the plain family's (same layer types, same packing and padding rules).
        masks = PlainDecoderModel.attention_masks(self, inputs_embeds, attention_mask, cache, position_ids)
        layer_kwargs = dict(
            position_embeddings=self.rotary_emb(inputs_embeds, position_ids),
            **cache_kwarg(cache),
            position_ids=position_ids,
            **kwargs,
        )
        return TokenStep(inputs_embeds, cache, position_ids, mask, starts, masks, layer_kwargs)

    def extra_loss_terms(self) -> list[str]:
        """The family's loss terms beyond the cross-entropy, which only the causal LM's forward adds."""
        config = self.config
        if config.chunking == "fixed" or not config.aux_loss_weight:
            return []
        return [f"the ratio loss (aux_loss_weight={config.aux_loss_weight})"]

    def token_layout(
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

    def boundaries(
        self,
        token_states: torch.Tensor,
        mask: torch.Tensor,
        starts: torch.Tensor,
        position_ids: torch.Tensor,
        state: ConceptState,
        documents: torch.Tensor,
    ) -> RouterPass:
        """The call's probabilities, decision scores, boundaries, router keys and recent window;
        `documents` (B, L) from `call_documents`."""
        config = self.config
        if config.chunking == "fixed":
            opens = fixed_boundaries(position_ids, starts, mask, int(config.compression_ratio))
            probs = opens.to(torch.float32)
            return RouterPass(probs, probs, opens, None, None)
        past_keys = state.previous_key if config.router in ("cosine", "rule") else None
        probs, keys = self.chunker(token_states, starts, mask, past_keys=past_keys)
        scores, recent = self.decision_scores(probs, starts, mask, state, documents, position_ids)

        def draw() -> torch.Tensor:
            if config.router == "rule":
                # DLCM §8.1: a fixed threshold on the dissimilarity, no sampling.
                return (rule_boundaries(probs, config.rule_threshold) | starts) & mask
            return self.decide_boundaries(scores, starts, mask, self.training)

        # A planned optimizer step (ratio_step.plan_ratio_step) replays the decisions it counted.
        accumulator = self.ratio_accumulator if self.training else None
        opens = draw() if accumulator is None else accumulator.decide(probs, mask, draw)
        return RouterPass(probs, scores, opens, keys, recent)

    def decision_scores(
        self,
        probs: torch.Tensor,
        starts: torch.Tensor,
        mask: torch.Tensor,
        state: ConceptState,
        documents: torch.Tensor,
        position_ids: torch.Tensor,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """(B, L) what the learned router's decisions threshold — `probs`, or under `boundary_rank_window`
        their local ranks (`concept_ranking`; of `probs` plus `boundary_fixed_bonus` where fixed chunks
        open, at the (B, L) `position_ids`) — and the rows' recent window after the call (or None)."""
        config = self.config
        if not config.boundary_rank_window:
            return probs, None
        if config.boundary_fixed_bonus:
            # Absolute positions: a cached call marks the same tokens as a full forward does, and the
            # recent window keeps the shifted values its ranks compare with.
            fixed = fixed_boundaries(position_ids, starts, mask, int(config.compression_ratio))
            probs = probs + config.boundary_fixed_bonus * fixed.to(probs.dtype)
        arguments = (probs, starts, mask, documents, state.recent_probs, state.recent_documents)
        return local_rank_scores(*arguments), recent_after(*arguments)

    @staticmethod
    def remember_recent(
        state: ConceptState, recent: tuple[torch.Tensor, torch.Tensor] | None
    ) -> ConceptState:
        """`state` with the recent window of the call (`RouterPass.recent`), when there is one."""
        if recent is not None:
            state.recent_probs, state.recent_documents = recent
        return state

    def decide_boundaries(
        self, scores: torch.Tensor, starts: torch.Tensor, mask: torch.Tensor, training: bool
    ) -> torch.Tensor:
        """The learned router's decisions on its `decision_scores` with the config's noise: sampled in
        training, else thresholded."""
        config = self.config
        return boundary_decisions(
            scores,
            starts,
            mask,
            noise=config.boundary_noise,
            threshold=config.boundary_threshold,
            tau=config.boundary_tau,
            sigma=config.boundary_sigma,
            training=training,
        )

    def concept_masks(self, slots: tuple[torch.Tensor, ...], num_queries: int) -> dict[str, Any]:
        """One mask per attention type used by the concept layers.

        Where the full-attention mask is plain causal (every slot real, one document per row, queries
        covering all slots or a single query), sdpa gets no mask: its causal kernel skips the masked
        half, which an explicit boolean mask prevents (about 2.5× faster at 4k concepts on CPU). The
        varlen kernel reads a missing mask the same way and is spared reading the layout off one. Eager
        attention treats a missing mask as no mask at all, so it always gets the boolean one.
        """
        valid, documents, _ = slots
        layer_types = {layer.attention_type for layer in self.concept_layers}
        masks: dict[str, Any] = {}
        if "full_attention" in layer_types:
            plain_causal = (
                self.config._attn_implementation in ("sdpa", VARLEN_ATTENTION)
                and num_queries in (1, valid.shape[1])
                and bool(valid.all())
                and bool((documents == documents[:, :1]).all())
            )
            masks["full_attention"] = None if plain_causal else slot_attention_mask(*slots, num_queries, None)
        if "sliding_attention" in layer_types:
            window = self.config.sliding_window
            masks["sliding_attention"] = slot_attention_mask(*slots, num_queries, window)
        if self.config._attn_implementation == VARLEN_ATTENTION:
            masks = {kind: isolate_invalid_queries(mask, valid) for kind, mask in masks.items()}
        return masks

    def state_of(self, cache: ConceptCache | None, token_states: torch.Tensor) -> ConceptState:
        """The cached per-row state, or the empty state (no cache, or the cache's first call)."""
        if cache is not None and cache.state is not None:
            return cache.state
        batch_size, _, width = token_states.shape
        concept_width = getattr(self.config, "concept_hidden_size", None)
        return ConceptState.empty(
            batch_size,
            width,
            width,
            token_states.device,
            token_states.dtype,
            concept_width,
            self.config.boundary_rank_window,
        )

    def run_concept_layers(
        self,
        concept_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        cache: ConceptCache | None,
        after_pass: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """(B, C, Dc) new concepts through the concept layers (loops unrolled by the schedule); `slots`
        describe every concept slot the new ones may attend to (valid, documents, positions).
        `after_pass` (output_hidden_states) sees each pass's output and returns the states to go on with
        (equal values: `concept_views.ConceptPassViews`)."""
        masks = self.concept_masks(slots, concept_states.shape[1])
        for pass_idx, layer_idx in enumerate(self.concept_layer_schedule()):
            layer = self.concept_layers[layer_idx]
            concept_states, _ = layer(
                concept_states,
                attention_mask=masks[layer.attention_type],
                position_embeddings=position_embeddings,
                **cache_kwarg(None if cache is None else ConceptPassCache(cache, pass_idx)),
            )
            if after_pass is not None:
                concept_states = after_pass(concept_states)
        return concept_states

    def concept_layer_schedule(self) -> list[int]:
        """Concept-layer indices in the order they run; one pass each unless the family loops them."""
        return list(range(len(self.concept_layers)))

    def attention_modules(self) -> list[Any]:
        """The module behind each entry of `attentions` (`ConceptModelOutput`): encoder self-attention,
        concept passes, then each decoder layer's self-attention and its cross-attention if it has one."""
        encoder = [layer.self_attn for layer in self.encoder_layers]
        concept = [self.concept_layers[index].self_attn for index in self.concept_layer_schedule()]
        decoder = [
            module
            for layer in self.decoder_layers
            for module in (layer.self_attn, getattr(layer, "cross_attn", None))
            if module is not None
        ]
        return encoder + concept + decoder


@cache_field
class ConceptModelOutput(ModelOutput):
    """Base-model output: final-normed token states plus what the losses and metrics need.

    Every entry of `hidden_states` and `attentions` is token-level, its dim −2 the call's L tokens:
    transformers splits a verification pass (assisted or prompt-lookup decoding) per token there. A
    concept pass is shown at the token that emits each concept (`concept_views`: under "first" pooling the
    opening token, under "sum"/"mean" the opening that closes the chunk), zeros at the other tokens, so a
    cached step's rows equal a full forward's.

    `hidden_states` (with `output_hidden_states=True`): 1 + encoder layers + concept passes + decoder
    layers tensors (= num_hidden_layers + 1 without `concept_loop`): the (B, L, D) embeddings, each encoder
    layer's (B, L, D) output, each concept pass's (B, L, Dc) token view, each decoder layer's (B, L, D)
    output, the last one final-normed (`last_hidden_state`). The concept passes go on from their views
    (equal values), so every entry lies on the path to the logits.

    `attentions` (with `output_attentions=True` under eager attention; an empty tuple under sdpa): one
    entry per attention run, in the order they run (`ConceptStackMixin.attention_modules`), never None,
    with S the cached plus new tokens and N the concept slots the call's concepts may read (all cached
    slots with a cache, else the C new ones):
    - each encoder layer's self-attention, (B, H, L, S), as Llama's;
    - each concept pass (the concept layers in the order they run; ConceptMoE's `concept_loop` repeats
      layers), (B, Hc, L, N): row t the weights of the concept token t emits over the slots, zeros where
      it emits none (all zeros in a decoding step inside a chunk);
    - each decoder layer's self-attention, (B, H, L, S); in DLCM followed by its cross-attention,
      (B, Hx, L, 1 + N): the null concept, then per slot the weight the token gives it, summed over the
      positions that carry it (concept replication, DLCM §4.1), which both cross-attention forms compute.
    Rows of pads are meaningless (a pad token or an empty slot still attends somewhere, or gets zeros).
    transformers' split of a verification pass cuts each token's last dim at its key count (p + 1 at
    position p), which keeps every slot its row can use: a concept emitted at p has slot index <= p, and
    the concepts DLCM's token p reads were closed by openings <= p, so 1 + their index <= p + 1.

    `boundary_scores` (B, L): what the learned router's decisions thresholded, the local ranks of
    `boundary_probs` under `boundary_rank_window` (`concept_ranking`); None where they are the probabilities.
    """

    last_hidden_state: torch.Tensor | None = None
    cache: Cache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor | None, ...] | None = None
    boundary_probs: torch.Tensor | None = None
    boundaries: torch.Tensor | None = None
    token_mask: torch.Tensor | None = None
    document_starts: torch.Tensor | None = None
    boundary_scores: torch.Tensor | None = None


@cache_field
class ConceptCausalLMOutput(ModelOutput):
    """Causal-LM output; the metric fields are detached. `compression_ratio`: real tokens per concept of
    the boundaries this pass used (sampled in training); `inference_compression_ratio`: the same with the
    inference decisions (thresholded) on the same tokens, what generation realises;
    `sampled_compression_ratio`: real tokens per boundary expected under training's sampler on the same
    tokens (`routing.expected_boundaries`), so that evaluation reports the training rate too.
    `attentions`: the backbone's (`ConceptModelOutput`)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: Cache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor | None, ...] | None = None
    lm_loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    compression_ratio: torch.Tensor | None = None
    inference_compression_ratio: torch.Tensor | None = None
    sampled_compression_ratio: torch.Tensor | None = None
    boundary_prob_mean: torch.Tensor | None = None


def decision_scores_of(outputs: ConceptModelOutput) -> torch.Tensor:
    """(B, L) the scores the pass's decisions read: `boundary_scores`, or the probabilities."""
    return outputs.boundary_probs if outputs.boundary_scores is None else outputs.boundary_scores


class ConceptCausalLMMixin(CausalLMMixin):
    """Causal LM of the concept-level families: loss = LM cross-entropy + `aux_loss_weight` · ratio loss
    (0 for fixed chunking), with `lm_loss`, `aux_loss`, `compression_ratio` (real tokens per concept)
    and `boundary_prob_mean` in the output. Scope "global" adds the ratio loss share (routing.py; set
    `ratio_accumulator` to a `RatioAccumulator` reset every optimizer step — `ConceptTrainer` does);
    under a `Trainer` without one it computes the batch scope (`unplanned_global_scope`); scopes "batch"
    and "sequence" are scaled by local label tokens / `num_items_in_batch` when that is given. The
    backbone returns a `ConceptModelOutput`.
    """

    output_class = ConceptCausalLMOutput

    @property
    def ratio_accumulator(self) -> RatioAccumulator | None:
        """The optimizer step's `RatioAccumulator` (global scope); the backbone reads it too, to replay a
        planned step's boundary decisions (`ratio_step.plan_ratio_step`)."""
        return self.model.ratio_accumulator

    @ratio_accumulator.setter
    def ratio_accumulator(self, accumulator: RatioAccumulator | None) -> None:
        self.model.ratio_accumulator = accumulator

    def backbone_kwargs(self, labels: torch.Tensor | None, kwargs: dict) -> dict:
        """With labels this forward assembles the family's loss: the backbone is told so, and warns about
        dropped loss terms only when it is not (loss_terms.py)."""
        return kwargs if labels is None else {**kwargs, LOSS_IN_FORWARD: True}

    def loss_and_fields(
        self, outputs: ConceptModelOutput, logits: torch.Tensor, labels: torch.Tensor | None, kwargs: dict
    ) -> dict[str, Any]:
        loss = lm_loss = aux_loss = None
        if labels is not None:
            lm_loss = self.lm_loss(logits, labels, kwargs)
            aux_loss = self.auxiliary_loss(outputs, labels, kwargs.get("num_items_in_batch"))
            loss = lm_loss + self.config.aux_loss_weight * aux_loss
        mask, opens = outputs.token_mask, outputs.boundaries
        return dict(
            loss=loss,
            lm_loss=None if lm_loss is None else lm_loss.detach(),
            aux_loss=None if aux_loss is None else aux_loss.detach(),
            compression_ratio=(mask.sum() / (opens & mask).sum().clamp_min(1)).detach().float(),
            inference_compression_ratio=(
                mask.sum() / (self.inference_boundaries(outputs) & mask).sum().clamp_min(1)
            )
            .detach()
            .float(),
            sampled_compression_ratio=mask.sum() / self.expected_boundaries(outputs).sum().clamp_min(1),
            boundary_prob_mean=outputs.boundary_probs[mask].mean().detach() if mask.any() else None,
        )

    def unplanned_global_scope(self, labels: torch.Tensor, num_items_in_batch: Any) -> str:
        """The scope a "global" ratio loss computes under a `Trainer` that plans no step: "batch".

        `num_items_in_batch` is what says a `Trainer` runs this forward: the label tokens of the whole
        optimizer step (every micro-batch and, with `average_tokens_across_devices`, every process).
        Without the step's counts (a `RatioAccumulator`, which `ConceptTrainer` sets) each micro-batch
        would add the step's whole loss again, so the micro-batch's own statistics are used, weighted as
        the LM loss is: the batch scope, exact for what it is. With one micro-batch on one process that
        is the global scope itself. The step is larger than this micro-batch when `num_items_in_batch`
        exceeds its label tokens (accumulation, or processes counted together) or when torch.distributed
        runs several processes (`average_tokens_across_devices=False` leaves the count local): then the
        scope is smaller than asked, and the model says so once. The check reads only what reaches the
        model, since remote code cannot see the trainer; a miscount can only cost a spurious warning,
        never a different loss.
        """
        if not getattr(self, "_warned_unplanned_global", False):
            local_items = (labels[..., 1:] != -100).sum()
            accumulated = bool(torch.as_tensor(num_items_in_batch).max().cpu() > local_items.cpu())
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
            if accumulated or (distributed and torch.distributed.get_world_size() > 1):
                self._warned_unplanned_global = True
                logger.warning(
                    "ratio_scope='global' takes the ratio statistics over the whole optimizer step, which "
                    "needs the step planned: this Trainer accumulates micro-batches or runs several "
                    "processes without a plan, so each micro-batch uses its own statistics "
                    f"(ratio_scope='batch'). Train with {TRAINERS} for the global scope."
                )
        return "batch"

    @torch.no_grad()
    def inference_boundaries(self, outputs: ConceptModelOutput) -> torch.Tensor:
        """(B, L) the boundaries inference would take on this pass's tokens: the pass's own outside
        training and for fixed or rule chunking (no sampling), else the thresholded probabilities."""
        config = self.config
        if not self.training or config.chunking == "fixed" or config.router == "rule":
            return outputs.boundaries
        return self.model.decide_boundaries(
            decision_scores_of(outputs), outputs.document_starts, outputs.token_mask, training=False
        )

    @torch.no_grad()
    def expected_boundaries(self, outputs: ConceptModelOutput) -> torch.Tensor:
        """(B, L) probability of a boundary at each token under training's decisions: the sampler's for
        the learned router, the pass's own boundaries for fixed or rule chunking (nothing is sampled)."""
        config = self.config
        if config.chunking == "fixed" or config.router == "rule":
            return (outputs.boundaries & outputs.token_mask).float()
        return expected_boundaries(
            decision_scores_of(outputs),
            outputs.document_starts,
            outputs.token_mask,
            noise=config.boundary_noise,
            threshold=config.boundary_threshold,
            tau=config.boundary_tau,
            sigma=config.boundary_sigma,
        )

    def auxiliary_loss(
        self, outputs: ConceptModelOutput, labels: torch.Tensor, num_items_in_batch: Any
    ) -> torch.Tensor:
        """The ratio-loss term (before `aux_loss_weight`); 0 for fixed chunking."""
        probs = outputs.boundary_probs
        if self.config.chunking == "fixed":
            return probs.new_zeros(())
        scope = self.config.ratio_scope
        if (
            scope == "global"
            and self.training
            and self.ratio_accumulator is None
            and num_items_in_batch is not None
        ):
            scope = self.unplanned_global_scope(labels, num_items_in_batch)
        token_weights = None
        if scope == "sequence":
            # Token t carries the label at t (predicted from t − 1): a sequence weighs its label tokens.
            token_weights = torch.zeros_like(probs)
            token_weights[:, 1:] = (labels[..., 1:] != -100).to(probs.dtype)
        result = ratio_loss(
            probs,
            outputs.boundaries,
            outputs.token_mask,
            target_ratio=self.config.compression_ratio,
            scope=scope,
            starts=outputs.document_starts,
            token_weights=token_weights,
            # Evaluation batches are not micro-batches of an optimizer step: they never touch the accumulator.
            accumulator=self.ratio_accumulator if scope == "global" and self.training else None,
        )
        if scope in ("sequence", "batch"):
            # A micro-batch's figure weighs by its share of the step's label tokens, as the LM loss does.
            local_items = (labels[..., 1:] != -100).sum()
            return scale_aux_loss(result.loss, local_items, num_items_in_batch)
        return result.loss
