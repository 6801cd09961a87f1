"""The plain decoder family: embeddings -> `DecoderLayer` x N -> RMSNorm -> LM head.

Legend: B batch, L tokens (this call), S cached + new tokens, D width, V vocabulary, E experts,
N flattened tokens (B·L).

It is the stack that source checkpoints (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE)
load into exactly, and the family the conformance suite runs before the concept-level families land.

Contract:
- Inputs (B, L) ids or (B, L, D) embeddings; a 2-D `attention_mask` (B, S) marks real tokens (it may
  cover cached tokens too, as `generate` passes it); `position_ids` (B or 1, L).
- Causality: a token at position t reads only real tokens at positions <= t of its own document
  (sliding layers: the last `sliding_window` of them). Masks come from `transformers.masking_utils`:
  left padding through `attention_mask`; packed documents through `position_ids` restarting at 0
  (eager/sdpa, no mask, no cache) or through the flash kwargs.
- Without `position_ids`, positions count real tokens (`cumsum(attention_mask) - 1`), so a left-padded
  row gives the same logits as the row alone; without a mask they continue from the cache length.
- `output_attentions=True` (eager attention): `attentions` holds one (B, H, L, S) tensor per layer, as
  Llama's; under sdpa it is an empty tuple, with a warning (`layers.attention_recorder`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from .causal_lm import CausalLMMixin, PlainModelOutput
from .configuration_plain import PlainDecoderConfig
from .layers import (
    DecoderLayer,
    RMSNorm,
    RotaryEmbedding,
    attention_recorder,
    default_position_ids,
    init_backbone_weights,
    recording_attentions,
)
from .transformers_compat import CACHE_KEYS, cache_kwarg, take_cache


class PlainDecoderPreTrainedModel(PreTrainedModel):
    """Shared class attributes and weight initialisation of the plain family."""

    config_class = PlainDecoderConfig
    config: PlainDecoderConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules: ClassVar[list[str]] = ["DecoderLayer"]
    _skip_keys_device_placement: ClassVar[list[str]] = list(CACHE_KEYS)
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_attention_backend = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        init_backbone_weights(module, self.config.initializer_range)


class PlainDecoderModel(PlainDecoderPreTrainedModel):
    """Decoder stack without the LM head: (B, L) ids -> (B, L, D) final-normed token states (causal)."""

    def __init__(self, config: PlainDecoderConfig) -> None:
        super().__init__(config)
        config.check_fields()
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(DecoderLayer(config, index) for index in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding.from_config(config)
        self.gradient_checkpointing = False
        self.post_init()

    def attention_masks(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | dict | None,
        cache: Cache | None,
        position_ids: torch.Tensor,
    ) -> dict[str, Any]:
        """One mask per attention layer type, in the form the current kernel wants (built before the
        cache is updated, since it sizes itself from the cache)."""
        if isinstance(attention_mask, dict):
            return attention_mask
        if (
            attention_mask is None
            and cache is not None
            and not cache.is_compileable
            and cache.get_seq_length() == 0
        ):
            # An empty growing cache sizes the mask like no cache at all, but its presence would stop
            # masking_utils from detecting packed documents in `position_ids` (use_cache defaults to True).
            cache = None
        mask_kwargs = dict(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **cache_kwarg(cache),
        )
        masks = {"full_attention": create_causal_mask(**mask_kwargs)}
        if "sliding_attention" in self.config.layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)
        return masks

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
        **kwargs: Any,
    ) -> PlainModelOutput | tuple:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        cache = take_cache(cache, kwargs)
        return_dict = kwargs.pop("return_dict", None)
        # The weights are recorded here; the flag itself must not reach the kernels.
        recorder = attention_recorder(self.config, kwargs.pop("output_attentions", None))
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if inputs_embeds is None:
            # (B, L, D)
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_length = cache.get_seq_length() if cache is not None else 0
            position_ids = default_position_ids(
                attention_mask, inputs_embeds.shape[1], past_length, inputs_embeds.device
            )
        masks = self.attention_masks(inputs_embeds, attention_mask, cache, position_ids)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        with recording_attentions(self, recorder):
            all_states, all_router_logits = self.run_layers(
                inputs_embeds,
                masks,
                position_embeddings=position_embeddings,
                **cache_kwarg(cache),
                use_cache=use_cache,
                position_ids=position_ids,
                **kwargs,
            )
        keep_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        keep_routers = (
            self.config.output_router_logits if output_router_logits is None else output_router_logits
        )
        output = PlainModelOutput(
            last_hidden_state=all_states[-1],
            cache=cache,
            hidden_states=tuple(all_states) if keep_states else None,
            attentions=None if recorder is None else recorder.entries(self.attention_modules()),
            router_logits=tuple(all_router_logits) if keep_routers and all_router_logits else None,
        )
        return output.to_tuple() if return_dict is False else output

    def attention_modules(self) -> list[nn.Module]:
        """The module behind each entry of `attentions`: every layer's self-attention, in order."""
        return [layer.self_attn for layer in self.layers]

    def run_layers(
        self, token_states: torch.Tensor, masks: dict[str, Any], **layer_kwargs: Any
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The (B, L, D) input of every layer plus the final-normed output, and each sparse layer's
        (N, E) router logits."""
        all_states, all_router_logits = [token_states], []
        for layer in self.layers:
            token_states, router_logits = layer(
                token_states, attention_mask=masks[layer.attention_type], **layer_kwargs
            )
            all_states.append(token_states)
            if router_logits is not None:
                all_router_logits.append(router_logits)
        # The last layer's raw output is replaced by its normed version (transformers' convention).
        all_states[-1] = self.norm(token_states)
        return all_states, all_router_logits


class PlainDecoderForCausalLM(CausalLMMixin, PlainDecoderPreTrainedModel, GenerationMixin):
    """Causal LM: (B, L) ids -> (B, L, V) next-token logits; logit t depends on tokens <= t only.

    `labels` (B, L) give the usual shifted cross-entropy through `self.loss_function`, so the Trainer's
    `num_items_in_batch` normalisation applies. `output_router_logits=True` returns the per-layer (N, E)
    router logits of sparse layers; `output_attentions=True` (eager) one (B, H, L, S) tensor per layer, S
    the cached plus new positions.
    """

    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: PlainDecoderConfig) -> None:
        super().__init__(config)
        self.model = PlainDecoderModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


PlainDecoderModel.register_for_auto_class("AutoModel")
PlainDecoderForCausalLM.register_for_auto_class("AutoModelForCausalLM")
