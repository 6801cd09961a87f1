"""LSLM's own layers: the boundary router (the inference network q(z | x)) and the segment decoder's layer
with cross-attention to the encoded segments; `stage_config` gives the token encoder and the decoder their
own widths."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_lslm import LSLMConfig
from .layers import (
    AttentionRecorder,
    ConfigView,
    DecoderLayer,
    RMSNorm,
    eager_attention_forward,
    residual_body,
)
from .transformers_compat import layer_cache


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
        """(B, T, Dt) -> (B, T) logits p̂_t in float32 at least (a float64 model's stay float64, so that its
        estimators can be checked to float64 precision)."""
        logits = self.fc_out(F.relu(self.fc_in(token_states)))
        return logits.to(torch.promote_types(logits.dtype, torch.float32)).sum(dim=-1)


class SegmentCrossAttention(nn.Module):
    """Decoder slots (Dd) attend to encoded segments (D) and a null segment, under a boolean mask. While an
    `AttentionRecorder` is attached it also records the (B, H, S, M) weights (eager products beside the
    kernel's output)."""

    attention_recorder: AttentionRecorder | None = None
    # One key/value head per query head (what `eager_attention_forward` reads).
    num_key_value_groups = 1

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
        recorder = self.attention_recorder
        if recorder is not None:
            # The weights beside the kernel join the graph only when the recorder puts its entries there
            # (`AttentionRecorder.lay_out`): a checkpointed layer recomputes unrecorded.
            with torch.set_grad_enabled(recorder.in_graph and torch.is_grad_enabled()):
                _, weights = eager_attention_forward(
                    self, query, keys, values, allowed[:, None], scaling=self.head_dim**-0.5
                )
            used = recorder.record(self, weights)
            if used is not weights:
                # The recorded entry joins the graph: the kernel's values, the gradient of the product
                # with the entry's view of the weights (the same attention, computed the eager way).
                product = torch.matmul(used, values)
                attended = attended.detach() + (product - product.detach())
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
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        def cross(states: torch.Tensor) -> torch.Tensor:
            normed = self.cross_attention_layernorm(states)
            return self.cross_attn(normed, cross_keys, cross_values, cross_allowed)

        cache = layer_cache(kwargs)

        return residual_body(
            self,
            hidden_states,
            cross,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=cache,
        )
