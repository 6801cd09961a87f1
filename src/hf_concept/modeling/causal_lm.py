"""What the causal LMs of the plain, Hidden Decoding, ConceptMoE and DLCM families share: `CausalLMMixin`
(backbone call, LM head, loss and output fields; the concept families extend it in
`concept_stack.ConceptCausalLMMixin`) and the output classes with transformers' MoE field names.

Legend: B batch, L tokens (this call), V vocabulary.

A module of its own so that a family whose backbone is not the plain decoder (Hidden Decoding) ships
without the plain decoder's model classes.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_outputs import ModelOutput

from .transformers_compat import cache_field, take_cache


@cache_field
class PlainModelOutput(ModelOutput):
    """Backbone output: transformers' `MoeModelOutputWithPast` fields, the cache under the installed
    release's name (`transformers_compat.cache_field`)."""

    last_hidden_state: torch.Tensor | None = None
    cache: Cache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None


@cache_field
class PlainCausalLMOutput(ModelOutput):
    """Causal-LM output: transformers' `MoeCausalLMOutputWithPast` fields, the cache under the installed
    release's name."""

    loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: Cache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None


def project_logits(
    lm_head: nn.Module, token_states: torch.Tensor, logits_to_keep: int | torch.Tensor
) -> torch.Tensor:
    """(B, L_kept, V) logits of the kept positions: the last `logits_to_keep` (0 = all) or given indices."""
    kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return lm_head(token_states[:, kept, :])


class CausalLMMixin:
    """`forward` of every causal LM here: backbone, LM head, loss and output fields.

    The class sets `model` (a backbone returning at least `last_hidden_state`, `cache`,
    `hidden_states`, `attentions`), `lm_head` and `output_class`. `loss_and_fields` gives the loss and
    the family's output fields: here the next-token cross-entropy alone, the router logits and
    `extra_output_fields` copied from the backbone's output (plain, Hidden Decoding); the concept
    families add their auxiliary loss and metrics. Extra keyword arguments reach the backbone and the
    loss (which ignores what it does not know); `output_attentions` reaches the backbone alone.
    """

    output_class: ClassVar[type] = PlainCausalLMOutput
    extra_output_fields: ClassVar[tuple[str, ...]] = ()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> ModelOutput | tuple:
        return_dict = kwargs.pop("return_dict", None)
        cache = take_cache(cache, kwargs)
        # For the backbone alone: the loss must not receive it.
        output_attentions = kwargs.pop("output_attentions", None)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            **self.backbone_kwargs(labels, kwargs),
        )
        # (B, L_kept, V)
        logits = self.scale_logits(project_logits(self.lm_head, outputs.last_hidden_state, logits_to_keep))
        output = self.output_class(
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **self.loss_and_fields(outputs, logits, labels, kwargs),
        )
        return output.to_tuple() if return_dict is False else output

    def backbone_kwargs(self, labels: torch.Tensor | None, kwargs: dict) -> dict:
        """Hook for the keyword arguments the backbone gets beyond the inputs (Hidden Decoding asks for
        every stream's states when its loss needs them); `kwargs` as they are here."""
        return kwargs

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Hook for output multipliers (DLCM's μP); the identity here."""
        return logits

    def lm_loss(self, logits: torch.Tensor, labels: torch.Tensor | None, kwargs: dict) -> torch.Tensor | None:
        """Shifted next-token cross-entropy (`self.loss_function`: Trainer's `num_items_in_batch` applies)."""
        if labels is None:
            return None
        return self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

    def loss_and_fields(
        self, outputs: ModelOutput, logits: torch.Tensor, labels: torch.Tensor | None, kwargs: dict
    ) -> dict[str, Any]:
        fields = {name: getattr(outputs, name) for name in self.extra_output_fields}
        return dict(loss=self.lm_loss(logits, labels, kwargs), router_logits=outputs.router_logits, **fields)
