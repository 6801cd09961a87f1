"""LSLM's `attentions`, one query row per input column, inside the autograd graph.

Each stage attends in its own positions (the token encoder over the byte view, the segment encoder over
segments, the decoder over its slots). `output_attentions` returns token-aligned rows instead: row t is
column t's byte, the segment column t closes, and the decoder slot whose logits column t reports — what
the cached step of column t returns (`lslm_generation.SegmentCacheSteps.step_rows`).

A stage layout maps a module's weights to a pair (aligned, used): `aligned` is the returned entry, and
`used` is read back from it — equal to the weights, value for value — wherever the aligned rows hold the
weights (elsewhere it is the weights themselves). The attention module multiplies `used` with its values,
so the returned entry is part of the graph and a loss reaches it, as in transformers' models, while the
forward computes exactly what it computes unrecorded and each weight still receives its gradient once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .lslm_layout import ByteView, DecoderSlots, Segmentation, segment_close_columns

StageLayout = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def token_layout(view: ByteView) -> StageLayout:
    """Token encoder, (B, Ht, T, T) over the view -> rows and keys at their input columns; zero at pads
    and markers."""

    def lay_out(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        is_byte = view.mask[:, None, :, None]
        rows = view.order[:, None, :, None].expand_as(weights)
        keys = view.order[:, None, None, :].expand_as(weights)
        by_row = torch.zeros_like(weights).scatter(2, rows, weights * is_byte.to(weights.dtype))
        aligned = torch.zeros_like(weights).scatter(3, keys, by_row)
        read_back = aligned.gather(3, keys).gather(2, rows)
        return aligned, torch.where(is_byte, read_back, weights)

    return lay_out


def segment_layout(view: ByteView, segmentation: Segmentation) -> StageLayout:
    """Segment encoder, (B, H, M, M') over segments -> (B, H, T, M'): each segment's row at the column
    whose cached step closes it (`segment_close_columns`); zero where no segment closes."""
    close = segment_close_columns(view, segmentation)  # (B, M); T where none
    length = view.order.shape[1]

    def lay_out(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, heads, _, width = weights.shape
        rows = close[:, None, :, None].expand(-1, heads, -1, width)
        # Row T collects the segments no column closes; it is dropped.
        placed = weights.new_zeros(batch, heads, length + 1, width).scatter(2, rows, weights)
        aligned = placed[:, :, :length]
        read_back = F.pad(aligned, (0, 0, 0, 1)).gather(2, rows)
        return aligned, torch.where((close < length)[:, None, :, None], read_back, weights)

    return lay_out


def slot_reporters(view: ByteView, column_slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """(B, S) an input column that reports each decoder slot (`column_slots` (B, T)), -1 for none; when
    several do, any one (their rows are copies of the slot's)."""
    real = view.input_documents > 0
    columns = torch.arange(column_slots.shape[1], device=column_slots.device).expand_as(column_slots)
    sink = torch.where(real, column_slots, num_slots)
    reporters = column_slots.new_full((column_slots.shape[0], num_slots + 1), -1)
    return reporters.scatter(1, sink, columns)[:, :num_slots]


def decoder_layouts(
    view: ByteView, slots: DecoderSlots, column_slots: torch.Tensor
) -> tuple[StageLayout, ...]:
    """Decoder self- and cross-attention, (B, Hd, S, ·) over slots -> (B, Hd, T, ·): the row of the slot
    column t reports (zero at pads); self-attention keys by position in the segment (what the decoder
    cache holds), (B, Hd, T, W) with W the longest segment + 1; cross-attention keys unchanged."""
    real = (view.input_documents > 0)[:, None, :, None]
    reporters = slot_reporters(view, column_slots, slots.ids.shape[1])  # (B, S)
    reported = (reporters >= 0)[:, None, :, None]
    same_segment = (slots.group[:, :, None] == slots.group[:, None, :])[:, None]  # (B, 1, S, S)
    width = int(slots.position.max()) + 1 if slots.position.numel() else 1

    def rows_of(weights: torch.Tensor) -> torch.Tensor:
        rows = column_slots[:, None, :, None].expand(-1, weights.shape[1], -1, weights.shape[-1])
        return torch.gather(weights, 2, rows) * real.to(weights.dtype)

    def read_rows(aligned: torch.Tensor) -> torch.Tensor:
        rows = reporters.clamp(min=0)[:, None, :, None].expand(-1, aligned.shape[1], -1, aligned.shape[-1])
        return aligned.gather(2, rows)

    def self_attention(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gathered = rows_of(weights)  # (B, Hd, T, S)
        keys = slots.position[:, None, None, :].expand_as(gathered)
        batch, heads, length, _ = gathered.shape
        # A slot reads only its own segment's slots: the keys of other segments at a position add zeros.
        aligned = gathered.new_zeros(batch, heads, length, width).scatter_add(3, keys, gathered)
        positions = slots.position[:, None, None, :].expand(-1, heads, weights.shape[2], -1)
        read_back = read_rows(aligned).gather(3, positions)
        return aligned, torch.where(reported & same_segment, read_back, weights)

    def cross_attention(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        aligned = rows_of(weights)
        return aligned, torch.where(reported, read_rows(aligned), weights)

    return self_attention, cross_attention
