"""The Hidden Decoding family: every token runs through the backbone as n streams (HD paper).

Legend: B batch, L tokens (this call), T cached tokens, S streams (the paper's n), D width, V vocabulary,
H query heads, G key/value heads, K head dim.

Pipeline (docs/ARCHITECTURE.md, §4.3): n embedding tables (one `nn.Embedding` of width S·D: row v =
[E_1(v) | … | E_S(v)]) -> the expanded sequence, token i's stream k at expanded position i·S + k ->
`DecoderLayer` x N, each with a stream attention kind (the layers and their kernels:
hidden_decoding_layers.py) -> final norm -> shared LM head on the final stream of each token (or, with
`stream_supervision="sum"`, on the norm of the sum of the token's S streams).

Stream attention kinds (config `stream_attention_layout`):
- "intra": each stream attends to earlier positions of its own stream (eq. 4). Run by folding the
  streams into the batch, (B·S, L, D): cost S·L², never an S²L² mask. RoPE positions are p·S + k
  ("expanded", the paper) or p ("token"). With `stream_kv="shared"` (§5.2 ablation) a stream instead
  attends to the final stream's keys of earlier tokens plus its own key at the current token.
- "local": causal sliding window of `sliding_window` expanded positions over the interleaved sequence.
- "full": causal over the S·L interleaved positions.
Local and full layers ("cross-stream") take their mask from `cross_stream_mask`: "causal" as above (the
paper's Fig. 3: stream k of token i sees streams ≤ k of token i), or "token_block": every stream of token
i sees all S streams of tokens ≤ i (a local layer: of the last `sliding_window / S` whole tokens). Their
RoPE positions are p·S + k ("expanded", `cross_stream_positions`) or p ("token").

Lossless conversion (token-block masks, token positions in every layer). Claim: a source whose embedding
is replicated into S equal tables computes, at every layer and for every stream of every token, the
source's state of that token; so the logits equal the source's, at any S and for any layout. Induction
over layers. Base: every stream of token i enters as E(x_i), the source's input. Step, assuming every
stream of every token j holds the source's state h_j: the S streams of token j then have equal queries,
keys and values, all at RoPE position p_j. An intra layer gives stream k of token i its own stream's
tokens j ≤ i (within the source's window, if any): exactly the source's keys and positions, so the
source's output. A token-block cross layer gives every stream of token i the S streams of each token j ≤ i
(of the last w tokens for a local layer of window w tokens, the source's window): S identical copies of
each of the source's keys. Softmax over S equal copies gives each the source weight over S, and their
values sum back to the source output; the query is the source's at every stream. So every stream leaves
the layer with the source's state, and the head reads the final stream: the source's logits. With the
paper's "causal" mask this fails at S > 1: stream k of token i sees k + 1 copies of token i but S of each
earlier token, so streams drift apart and later tokens read drifted states; expanded positions p·S + k
also stretch every distance the source saw (SmolLM2-135M converted in the paper's form, before training:
+0.16 nats per token at S = 2, +0.44 at S = 4 on held-out English text; token-block: 0.0000). The
same argument makes `expand` S → m·S exact for any trained token-block model (cyclic copies E_1..E_S,
E_1..E_S, …: stream k + S·r repeats stream k at every layer).
Token-block attention is no leak: every stream of token i depends on tokens ≤ i only, and the loss at
token i predicts token i + 1.

Contract:
- Inputs and outputs are per token: input_ids (B, L), attention_mask (B, T + L), position_ids (B or 1, L),
  labels (B, L), logits (B, L, V) from each token's final stream (the streams' sum under "sum"
  supervision). Expansion is internal.
- Causality: stream k of token i reads only streams of tokens < i and streams < = k of token i (intra:
  only its own stream; token-block cross layers: every stream of token i), all within its document
  (packed rows: position ids restart at 0), real tokens only (left padding through `attention_mask`).
- With S = 1 every kind is plain causal attention: the model computes the plain family's logits.
- The forward is the incremental step over a `StreamCache`: tokens [0, n) then [n, m) equal [0, m).
- `output_attentions=True` (eager attention): one tensor per layer, shapes in `HiddenDecodingModelOutput`;
  the last layer then runs for every stream (no final-stream shortcut), so that its weights are whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.utils import logging

from .causal_lm import CausalLMMixin, PlainCausalLMOutput, PlainModelOutput
from .configuration_hidden_decoding import HiddenDecodingConfig
from .forward_only_cache import adopt_cache
from .hidden_decoding_cache import StreamCache
from .hidden_decoding_layers import StreamAttention, StreamDecoderLayer, final_query_mask
from .hidden_decoding_masks import StreamMasks, stream_masks
from .hidden_decoding_streams import (
    deinterleave_streams,
    expand_position_ids,
    interleave_streams,
    token_aligned_weights,
)
from .layers import (
    AttentionRecorder,
    RMSNorm,
    RotaryEmbedding,
    SparseMoeBlock,
    attention_recorder,
    default_position_ids,
    init_backbone_weights,
    mlp_residual,
    recording_attentions,
)
from .loss_terms import LOSS_IN_FORWARD, warn_loss_terms_dropped
from .transformers_compat import CACHE_KEYS, cache_field, cache_kwarg, take_cache

logger = logging.get_logger(__name__)

# Model-internal states, per stream: (B, S, L, D) "stream-major". Intra layers see it as (B·S, L, D);
# local/full layers as the interleaved (B, L·S, D).


def fold_streams(stream_states: torch.Tensor) -> torch.Tensor:
    """(B, S, L, D) -> (B·S, L, D): each stream becomes a row of the batch (a view when contiguous)."""
    batch, streams, length, width = stream_states.shape
    return stream_states.reshape(batch * streams, length, width)


def through_final_stream(stream_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S, L, D) -> the same values rebuilt from its streams with the (B, L, D) final stream as a tensor of
    its own, and that final stream: what the next layer reads is built from it, so autograd reaches the
    layers through it (a plain slice would be a side branch the computation never reads)."""
    final_states = stream_states[:, -1]
    return torch.cat([stream_states[:, :-1], final_states[:, None]], dim=1), final_states


def head_input_states(stream_states: torch.Tensor, supervision: str) -> torch.Tensor:
    """(B, S, L, D) last-layer states -> (B, L, D) the states the final norm and LM head read.

    "final" and "all_streams": each token's final stream (eq. 2; "all_streams" adds its other streams in
    the loss only). "sum" (§5.1, "summing their outputs before prediction"): the sum over the S streams,
    taken before the final norm, so the prediction is head(norm(Σ_k h_k)) and the norm, not S, sets the
    scale; with S = 1 it is the final stream exactly.
    """
    if supervision == "sum":
        return stream_states.sum(dim=1)
    return stream_states[:, -1]


def stream_positions(position_ids: torch.Tensor, num_streams: int, kind: str) -> torch.Tensor:
    """(B·S, L) RoPE positions of the folded streams from (B, L) token positions p: p·S + k or p."""
    batch, length = position_ids.shape
    if kind == "token":
        return position_ids.repeat_interleave(num_streams, dim=0)
    streams = torch.arange(num_streams, device=position_ids.device)
    # (B, S, L)
    expanded = position_ids[:, None, :] * num_streams + streams[None, :, None]
    return expanded.reshape(batch * num_streams, length)


class HiddenDecodingPreTrainedModel(PreTrainedModel):
    """Shared class attributes and weight initialisation of the Hidden Decoding family."""

    config_class = HiddenDecodingConfig
    config: HiddenDecodingConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules: ClassVar[list[str]] = ["StreamDecoderLayer"]
    _skip_keys_device_placement: ClassVar[list[str]] = list(CACHE_KEYS)
    # The flash path would need per-kind position ids and cu_seqlens; it has never run here (no GPU).
    _supports_flash_attn = False
    _supports_sdpa = True
    _supports_attention_backend = False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        init_backbone_weights(module, self.config.initializer_range)


@dataclass
class StreamPositions:
    """Position ids and RoPE tables of the two views: interleaved (B, L·S) and folded streams (B·S, L).
    `expanded_ids` are the interleaved view's RoPE ids: p·S + k, or p under token cross-stream positions."""

    expanded_ids: torch.Tensor
    expanded_rope: tuple[torch.Tensor, torch.Tensor] | None
    folded_ids: torch.Tensor
    folded_rope: tuple[torch.Tensor, torch.Tensor] | None


@cache_field
class HiddenDecodingModelOutput(PlainModelOutput):
    """`last_hidden_state` (B, L, D) is what the LM head reads, normed: the final stream of each token (the
    sum of its streams under "sum" supervision); `stream_states` (B, S, L, D) all streams, normed (only
    with `output_stream_states=True`).

    `hidden_states` (`output_hidden_states=True`): num_hidden_layers + 1 tensors (B, L, D), token-level as
    transformers' convention: each token's final stream (stream S − 1) entering layer 0, after each layer,
    and last the normed head input (`last_hidden_state`). They are the tensors the next layer's input is
    built from (`through_final_stream`), so gradients reach them; the other streams are in
    `stream_states` (last layer) only.

    `attentions` (`output_attentions=True` under eager attention; an empty tuple under sdpa): one tensor
    per layer, T the cached plus new tokens (keys as the layer's cache returns them), every one with the
    query tokens and key tokens as its last two dims (transformers splits a verification pass per token
    there), query streams folded into the batch (row b·S + k is stream k of sample b,
    `.unflatten(0, (B, S))` separates them):
    - "intra" layers, (B·S, H, L, T): each stream over its own stream's tokens (shared KV: the final
      stream's keys of earlier tokens and its own key at the current one, `SharedKVAttention`);
    - "full" and "local" layers, (B·S, H·S, L, T): "head" h·S + j holds head h's weights on key stream j
      (`hidden_decoding_streams.token_aligned_weights`; the interleaved order, token i's stream k at
      i·S + k, is what the layer computes); a local layer's keys past its cached window are the ones its
      cache keeps.
    """

    stream_states: torch.Tensor | None = None


@cache_field
class HiddenDecodingCausalLMOutput(PlainCausalLMOutput):
    """Causal-LM output plus `stream_states` (B, S, L, D), normed, for stream probes."""

    stream_states: torch.Tensor | None = None


class HiddenDecodingModel(HiddenDecodingPreTrainedModel):
    """Backbone over n streams per token: (B, L) ids -> (B, L, D) final-stream states (normed).

    `hidden_states`: num_hidden_layers + 1 tensors (B, L, D), each token's final stream entering the first
    layer, after each layer, and last the normed head input; the tensors the computation goes on from.
    `attentions` (eager): one per layer, token-aligned, intra (B·S, H, L, T), full/local (B·S, H·S, L, T).
    Details in `HiddenDecodingModelOutput`.
    """

    def __init__(self, config: HiddenDecodingConfig) -> None:
        super().__init__(config)
        config.check_fields()
        self.num_streams = config.num_streams
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        # Row v holds the S stream embeddings of token v side by side: [E_1(v) | ... | E_S(v)].
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.num_streams * config.hidden_size, self.padding_idx
        )
        self.layers = nn.ModuleList(
            StreamDecoderLayer(config, index) for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding.from_config(config)
        self.gradient_checkpointing = False
        self.post_init()

    def new_cache(self) -> StreamCache:
        """An empty `StreamCache` shaped for this model's layout."""
        config = self.config
        window = config.sliding_window
        if config.cross_stream_mask == "token_block" and window is not None:
            # Whole tokens: the w - 1 earlier tokens of a w-token window, S slots each (stream_cache).
            window = (config.local_window_tokens - 1) * config.num_streams + 1
        return StreamCache(
            config.stream_attention_layout,
            config.num_streams,
            window,
            config.stream_kv,
            intra_window=config.intra_window,
        )

    def _stream_cache(self, cache: Cache | None, use_cache: bool) -> StreamCache | None:
        """Ours as is; an empty foreign cache (generate's DynamicCache) replaced; anything else refused."""
        create = use_cache and not self.training
        return adopt_cache(cache, StreamCache, self.new_cache, create, "Hidden Decoding")

    def embed(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        """(B, S, L, D) stream embeddings from (B, L) ids or (B, L, S·D) concatenated embeddings."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        streams, width = self.num_streams, self.config.hidden_size
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != streams * width:
            raise ValueError(
                f"inputs_embeds has shape {tuple(inputs_embeds.shape)}; expected (B, L, num_streams * "
                f"hidden_size = {streams * width}), the streams' embeddings side by side"
            )
        batch, length, _ = inputs_embeds.shape
        return inputs_embeds.view(batch, length, streams, width).transpose(1, 2).contiguous()

    def stream_positions(self, stream_states: torch.Tensor, position_ids: torch.Tensor) -> StreamPositions:
        """RoPE ids and tables per view, each by its config field: the interleaved view (local and full
        layers, `cross_stream_positions`) and the folded one (intra layers, `intra_stream_positions`)."""
        kinds = set(self.config.stream_attention_layout)
        streams = self.num_streams
        if self.config.cross_stream_positions == "token":
            expanded_ids = position_ids.repeat_interleave(streams, dim=1)
        else:
            expanded_ids = expand_position_ids(position_ids, streams)
        folded_ids = stream_positions(position_ids, streams, self.config.intra_stream_positions)
        expanded_rope = self.rotary_emb(stream_states, expanded_ids) if kinds & {"local", "full"} else None
        folded_rope = self.rotary_emb(stream_states, folded_ids) if "intra" in kinds else None
        return StreamPositions(expanded_ids, expanded_rope, folded_ids, folded_rope)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_router_logits: bool | None = None,
        output_stream_states: bool = False,
        **kwargs: Any,
    ) -> HiddenDecodingModelOutput | tuple:
        return_dict = kwargs.pop("return_dict", None)
        recorder = attention_recorder(self.config, kwargs.pop("output_attentions", None))
        if not kwargs.pop(LOSS_IN_FORWARD, False):
            warn_loss_terms_dropped(self, "Hidden Decoding", self.extra_loss_terms())
        if self.training and torch.is_grad_enabled():
            self.warn_if_streams_stay_copies()
        stream_states, cache, position_ids = self.call_inputs(
            input_ids, inputs_embeds, attention_mask, position_ids, take_cache(cache, kwargs), use_cache
        )
        masks = stream_masks(self.config, stream_states, attention_mask, position_ids, cache)
        positions = self.stream_positions(stream_states, position_ids)
        keep_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        keep_routers = (
            self.config.output_router_logits if output_router_logits is None else output_router_logits
        )
        # Recorded weights cover every stream's queries: the last layer then runs whole.
        recording = recorder is not None and recorder.enabled
        final_only = not (output_stream_states or recording) and self.final_stream_suffices(keep_routers)
        with recording_attentions(self, recorder):
            stream_states, all_states, all_router_logits = self.run_layers(
                stream_states, masks, positions, cache, final_only, keep_states, **kwargs
            )
        # (B, L, D)
        head_states = self.norm(head_input_states(stream_states, self.config.stream_supervision))
        if keep_states:
            all_states[-1] = head_states
        output = HiddenDecodingModelOutput(
            last_hidden_state=head_states,
            cache=cache,
            hidden_states=tuple(all_states) if keep_states else None,
            attentions=None if recorder is None else self.attention_entries(recorder),
            router_logits=tuple(all_router_logits) if keep_routers and all_router_logits else None,
            stream_states=self.norm(stream_states) if output_stream_states else None,
        )
        return output.to_tuple() if return_dict is False else output

    def call_inputs(
        self,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        cache: Cache | None,
        use_cache: bool | None,
    ) -> tuple[torch.Tensor, StreamCache | None, torch.Tensor]:
        """-> (B, S, L, D) stream states, the call's `StreamCache` (None without one) and (B, L) position
        ids; a cache records the call (what `crop` needs to feed these tokens again, family_cache)."""
        use_cache = self.config.use_cache if use_cache is None else use_cache
        stream_states = self.embed(input_ids, inputs_embeds)  # (B, S, L, D)
        batch, _, length, _ = stream_states.shape
        # The cache first: a static cache comes with a 4-D mask, and the cache is what needs fixing.
        cache = self._stream_cache(cache, use_cache)
        if attention_mask is not None and (not torch.is_tensor(attention_mask) or attention_mask.dim() != 2):
            raise ValueError("attention_mask must be a 2-D (batch, tokens) tensor for Hidden Decoding")
        if position_ids is None:
            past_length = cache.get_seq_length() if cache is not None else 0
            position_ids = default_position_ids(attention_mask, length, past_length, stream_states.device)
        position_ids = position_ids.expand(batch, -1)
        if cache is not None:
            cache.record_call(self, input_ids, inputs_embeds, attention_mask, position_ids)
        return stream_states, cache, position_ids

    def warn_if_streams_stay_copies(self) -> None:
        """Warn, once per model, when training cannot make the streams differ: every layer treats a token's
        streams alike (intra layers and token positions; token-block cross layers, or none), the loss is
        symmetric in them ("sum", "all_streams") and the tables are equal (a fresh lossless conversion).
        Every stream then gets the same gradient, the tables stay equal and the model stays its source."""
        if getattr(self, "_checked_stream_symmetry", False):
            return
        self._checked_stream_symmetry = True
        config, streams = self.config, self.num_streams
        cross = {"local", "full"} & set(config.stream_attention_layout)
        symmetric_layers = (
            config.intra_stream_positions == "token"
            and config.stream_kv != "shared"
            and (
                not cross
                or (config.cross_stream_mask, config.cross_stream_positions) == ("token_block", "token")
            )
        )
        if streams == 1 or config.stream_supervision == "final" or not symmetric_layers:
            return
        # (V, S, D): row v holds [E_1(v) | … | E_S(v)].
        tables = self.embed_tokens.weight.detach().view(config.vocab_size, streams, -1)
        if torch.equal(tables, tables[:, :1].expand_as(tables)):
            logger.warning(
                f"Hidden Decoding: stream_supervision={config.stream_supervision!r} with equal stream tables "
                "and stream-symmetric layers (token-block cross layers, token positions) gives every stream "
                "the same gradient: the streams stay copies and the model stays its source. Train with "
                "stream_supervision='final', or convert with --cross-stream-mask causal "
                "--cross-stream-positions expanded."
            )

    def extra_loss_terms(self) -> list[str]:
        """The loss terms beyond the logits' cross-entropy, which only the causal LM's forward adds."""
        if self.config.stream_supervision != "all_streams":
            return []
        return ["the other streams' cross-entropy (stream_supervision='all_streams')"]

    def attention_modules(self) -> list[nn.Module]:
        """The module behind each entry of `attentions`: every layer's stream attention, in order."""
        return [layer.self_attn for layer in self.layers]

    def attention_entries(self, recorder: AttentionRecorder) -> tuple[torch.Tensor | None, ...]:
        """Each layer's weights (`HiddenDecodingModelOutput`), the interleaved layers' token-aligned."""
        layout, streams = self.config.stream_attention_layout, self.num_streams
        # Empty when no weights were computed (sdpa): zip then yields nothing.
        return tuple(
            weights if kind == "intra" or weights is None else token_aligned_weights(weights, streams)
            for kind, weights in zip(layout, recorder.entries(self.attention_modules()), strict=False)
        )

    def final_stream_suffices(self, keep_routers: bool) -> bool:
        """Whether nothing reads the last layer's outputs on streams other than the final one: not the
        "sum" head, not a caller's `output_stream_states`, not a sparse last layer's router logits when
        they are returned. Gradient checkpointing and the shared-KV ablation keep the plain layer call."""
        last = self.layers[-1]
        if self.config.stream_supervision == "sum" or not isinstance(last.self_attn, StreamAttention):
            return False
        if self.gradient_checkpointing and self.training:
            return False
        return not (keep_routers and isinstance(last.mlp, SparseMoeBlock))

    def run_layers(
        self,
        stream_states: torch.Tensor,
        masks: StreamMasks,
        positions: StreamPositions,
        cache: StreamCache | None,
        final_only: bool = False,
        keep_states: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """(B, S, L, D) after every layer ((B, 1, L, D), the final stream, when `final_only`), the final
        stream's (B, L, D) input of each layer and the last layer's output, and each sparse layer's (N, E)
        router logits. With `keep_states` the next layer reads the stream tensor rebuilt around the
        returned final stream (`through_final_stream`), so the returned states lie in the graph."""
        streams = self.num_streams
        all_states, all_router_logits = [], []
        if keep_states:
            stream_states, final_states = through_final_stream(stream_states)
            all_states.append(final_states)
        for index, layer in enumerate(self.layers):
            last = index == len(self.layers) - 1
            trimmed = (
                last and final_only and self.final_stream_layer(layer, stream_states, masks, positions, cache)
            )
            if trimmed:
                stream_states, router_logits = trimmed
            elif layer.stream_kind == "intra":
                shape = stream_states.shape
                output, router_logits = layer(
                    fold_streams(stream_states),
                    attention_mask=masks.intra,
                    position_embeddings=positions.folded_rope,
                    **cache_kwarg(cache),
                    position_ids=positions.folded_ids,
                    **kwargs,
                )
                stream_states = output.view(shape)
            else:
                output, router_logits = layer(
                    interleave_streams(stream_states),
                    attention_mask=masks.local if layer.stream_kind == "local" else masks.full,
                    position_embeddings=positions.expanded_rope,
                    **cache_kwarg(cache),
                    position_ids=positions.expanded_ids,
                    **kwargs,
                )
                # A view; the next intra layer's fold copies it where needed.
                stream_states = deinterleave_streams(output, streams)
            if keep_states:
                stream_states, final_states = through_final_stream(stream_states)
                all_states.append(final_states)
            if router_logits is not None:
                all_router_logits.append(router_logits)
        return stream_states, all_states, all_router_logits

    def final_stream_layer(
        self,
        layer: StreamDecoderLayer,
        stream_states: torch.Tensor,
        masks: StreamMasks,
        positions: StreamPositions,
        cache: StreamCache | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The last layer computed for the final stream only: (B, S, L, D) -> (B, 1, L, D) and the router
        logits, or None where the plain call must run (a local layer that would need its window rebuilt).

        Every stream's keys and values are still projected and cached (later tokens and the final stream's
        own cross-stream attention read them); the queries, the attention output, o_proj and the MLP run
        on the final stream alone, so the layer costs about 1/S of its work outside the key/value
        projections. Row by row the same arithmetic as the plain call."""
        streams, attention = self.num_streams, layer.self_attn
        batch, _, length, _ = stream_states.shape
        if layer.stream_kind == "intra":
            inputs, rope, mask = fold_streams(stream_states), positions.folded_rope, masks.intra
        else:
            inputs, rope = interleave_streams(stream_states), positions.expanded_rope
            mask = masks.local if layer.stream_kind == "local" else masks.full
            if mask is None and length > 1 and layer.stream_kind == "local":
                return None

        def narrow(query, key, value, mask):
            if layer.stream_kind == "intra":
                # (B·S, ...) rows -> the final stream's (B, ...) rows; intra attention reads its own stream.
                query, key, value = (
                    rows.unflatten(0, (batch, streams))[:, -1] for rows in (query, key, value)
                )
                if mask is not None and mask.shape[0] == batch * streams:
                    mask = mask.unflatten(0, (batch, streams))[:, -1]
                return query, key, value, mask
            # (B, H, L, K): the queries at expanded positions i·S + S - 1.
            query = query[:, :, streams - 1 :: streams]
            return query, key, value, final_query_mask(mask, length, streams, key.shape[2], query.device)

        projected = attention.project(layer.input_layernorm(inputs))
        # (B, L, D)
        attended, _ = attention.attend(projected, rope, mask, cache, narrow=narrow)
        token_states, router_logits = mlp_residual(layer, stream_states[:, -1] + attended)
        return token_states[:, None], router_logits


class HiddenDecodingForCausalLM(CausalLMMixin, HiddenDecodingPreTrainedModel, GenerationMixin):
    """Causal LM: (B, L) ids -> (B, L, V) next-token logits from each token's final stream (from the sum
    of its streams under "sum" supervision).

    `labels` (B, L) are per token, as for any causal LM, and the loss is the shifted cross-entropy
    (`self.loss_function`, so Trainer's `num_items_in_batch` applies) of what `stream_supervision` says:
    "final", the final streams only (HD eq. 2, the other streams get no direct loss); "sum", the head on
    the streams' sum (the logits' own cross-entropy in both); "all_streams", the mean over streams of each
    stream's cross-entropy (`all_streams_loss`). Under "all_streams" the loss is therefore not the logits'
    cross-entropy: read held-out LM loss from the logits. `output_stream_states=True` also returns every
    stream's normed states (always returned under "all_streams" with labels: the loss is taken on them).
    """

    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}
    output_class = HiddenDecodingCausalLMOutput
    extra_output_fields = ("stream_states",)

    def __init__(self, config: HiddenDecodingConfig) -> None:
        super().__init__(config)
        self.model = HiddenDecodingModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def backbone_kwargs(self, labels: torch.Tensor | None, kwargs: dict) -> dict:
        """Every stream's states are requested when the loss needs them ("all_streams" with labels); with
        labels the backbone also learns that the loss is assembled here (loss_terms.py)."""
        if labels is None:
            return kwargs
        if self.config.stream_supervision == "all_streams":
            return dict(kwargs, output_stream_states=True, **{LOSS_IN_FORWARD: True})
        return dict(kwargs, **{LOSS_IN_FORWARD: True})

    def loss_and_fields(
        self,
        outputs: HiddenDecodingModelOutput,
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        kwargs: dict,
    ) -> dict[str, Any]:
        """The mixin's loss and fields; under "all_streams" the loss becomes `all_streams_loss`."""
        fields = super().loss_and_fields(outputs, logits, labels, kwargs)
        if labels is not None and self.config.stream_supervision == "all_streams":
            fields["loss"] = self.all_streams_loss(fields["loss"], outputs.stream_states, labels, kwargs)
        return fields

    def all_streams_loss(
        self, final_loss: torch.Tensor, stream_states: torch.Tensor, labels: torch.Tensor, kwargs: dict
    ) -> torch.Tensor:
        """The "all-token loss" of §5.1: (1/S) Σ_k CE_k over the S streams, where CE_k is stream k's
        shifted next-token cross-entropy through the shared norm and LM head, normalised as the plain loss
        is (by the count of labels != -100, or by Trainer's `num_items_in_batch`), so the sum stays a
        per-label-token quantity and S only averages. `stream_states` (B, S, L, D) are normed already;
        `final_loss` is CE_S, the loss the mixin took on the logits (the final stream's head output)."""
        streams = stream_states.shape[1]
        total = final_loss
        for stream in range(streams - 1):
            # (B, L, V)
            logits = self.scale_logits(self.lm_head(stream_states[:, stream]))
            total = total + self.lm_loss(logits, labels, kwargs)
        return total / streams


HiddenDecodingModel.register_for_auto_class("AutoModel")
HiddenDecodingForCausalLM.register_for_auto_class("AutoModelForCausalLM")
