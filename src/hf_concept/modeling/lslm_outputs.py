"""LSLM's output classes and the record of one parallel pass (modeling_lslm.py fills them).

Legend: B batch, T input columns, S decoder slots, Dd decoder width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutput, ModelOutput

from .lslm_layout import ByteView, DecoderSlots, Segmentation
from .lslm_segment_cache import SegmentCache
from .transformers_compat import cache_field


@cache_field
class LSLMCausalLMOutput(ModelOutput):
    """Per-token logits plus the ELBO's parts (detached metrics): `lm_loss` (decoder cross-entropy, nats
    per target), `kl_loss`, `boundary_rate` (segment ends per free byte: sampled in training,
    the inference rule in eval), `expected_boundary_rate` (mean q_t), `inference_boundary_rate` (the share
    the inference rule closes on the same bytes), `bits_per_byte`,
    `compression_ratio` (bytes per segment), `boundaries` (B, T) bool, True where an input token opens
    a segment (b_t = 1, docs/ARCHITECTURE.md §2; markers never open one), and `boundary_probs` (B, T)
    float32, the probability that it opens one (`lslm_layout.opening_probs`: q of the byte before it, 1
    where the opening is forced, 0 at markers and pads). `loss` is defined in `LSLMForCausalLM`.

    `hidden_states` (with `output_hidden_states`) and `attentions` (with `output_attentions`), of a parallel
    pass and of cached calls alike: as in `LSLMModelOutput` (summed up in `LSLMForCausalLM`)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: Cache | None = None
    attentions: tuple[torch.Tensor | None, ...] | None = None
    lm_loss: torch.Tensor | None = None
    kl_loss: torch.Tensor | None = None
    boundary_rate: torch.Tensor | None = None
    expected_boundary_rate: torch.Tensor | None = None
    inference_boundary_rate: torch.Tensor | None = None
    bits_per_byte: torch.Tensor | None = None
    compression_ratio: torch.Tensor | None = None
    boundaries: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    boundary_probs: torch.Tensor | None = None


@dataclass
class LSLMModelOutput(BaseModelOutput):
    """What `LSLMModel.forward` returns.

    `last_hidden_state` (B, T, Dd): for each input column, the normed decoder state whose `lm_head`
    projection is `LSLMForCausalLM`'s logits there (the slot of the column's byte while its segment is
    open, else the `<bos>` slot of the document's next segment; see the module docstring).
    `hidden_states` (with `output_hidden_states`): token-encoder layers + 1 tensors of (B, T, Dt), the
    input of each token-encoder layer (the first is the byte embeddings) and then the encoder's normed
    output (what the router and the pooling read), each at the input column of its byte; columns that
    hold no byte (pads, `<bos>`/`<nxt>` markers) are zero, since the token encoder never reads them.
    They are the tensors the computation goes on from (a loss on the logits reaches them). A cached call
    of Q columns returns the same count of (B, Q, Dt) tensors, the full forward's rows at its columns.
    `boundaries` (B, T) bool: True where an input token opens a segment; `boundary_probs` (B, T) float32:
    the probability that it opens one (as `LSLMCausalLMOutput.boundary_probs`).

    `attentions` (with `output_attentions=True` under eager attention; an empty tuple under sdpa): one
    entry per attention module in the order they run (`LSLMModel.attention_modules`), never None, each
    token-aligned: one query row per input column, the row that column's cached step computes, zero
    where that step has none (`lslm_attention_layout`):
    - each token-encoder layer (byte level), (B, Ht, T, T'): the column's byte over the bytes, keys at
      their input columns (in a cached step: the token cache's columns, the prefill's bytes then one
      per step); zero rows at pads and markers;
    - each segment-encoder layer (segment level), (B, H, T, M'): the segment the column closes (its last
      byte's column, or the marker's that closes it) over the segments (M' the stored ones with a
      cache); zero rows where no segment closes;
    - per decoder layer (decoder level) its self-attention, (B, Hd, T, W): the slot whose logits the
      column reports over the slots of its segment by position (`<bos>` first; W the longest segment
      + 1), then its cross-attention, (B, Hd, T, 1 + M'): the null segment, then the segments; zero rows
      at pads.
    A cached call of Q columns (assisted decoding's verification) has Q rows, each column's own step,
    keys zero-padded on the right to the widest.
    """

    boundaries: torch.Tensor | None = None
    boundary_probs: torch.Tensor | None = None


@dataclass
class LSLMPass:
    """One parallel pass, what the heads read: the real-column `mask` (B, T), the `view`, the
    `segmentation` and decoder `slots`, the (B, S, Dd) normed `slot_states`, `column_slots` (B, T) (the
    slot each input column reports, `lslm_layout.token_slots`), `boundaries` and `boundary_probs` (B, T)
    at the input columns, the `hidden_states` tuple (or None), the `cache` it filled (or None), the
    `attentions` tuple (with an `AttentionRecorder`, else None) and the view's `token_states`."""

    mask: torch.Tensor
    view: ByteView
    segmentation: Segmentation
    slots: DecoderSlots
    slot_states: torch.Tensor
    column_slots: torch.Tensor
    boundaries: torch.Tensor
    boundary_probs: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None
    cache: SegmentCache | None
    attentions: tuple[torch.Tensor | None, ...] | None = None
    # (B, T, Dt) the token encoder's normed states in view order (what the router and the pooling read).
    token_states: torch.Tensor | None = None

    def column_states(self) -> torch.Tensor:
        """(B, T, Dd) the slot state each input column reports."""
        index = self.column_slots[..., None].expand(-1, -1, self.slot_states.shape[-1])
        return torch.gather(self.slot_states, 1, index)


def at_input_columns(states: torch.Tensor, view: ByteView) -> torch.Tensor:
    """(B, T, ·) states of the view's columns -> the same states at their input columns (the view's
    `order` is a permutation), zero where the view holds no byte."""
    states = states * view.mask[..., None].to(states.dtype)
    return torch.zeros_like(states).scatter(1, view.order[..., None].expand_as(states), states)
