"""Where sequences and documents start, from `attention_mask` and `position_ids`.

Legend: B batch, L tokens.

Every non-standard path (routers, pooling, EMA, concept attention, streams, segments) takes document
boundaries from here, so that a row packed by `DataCollatorWithFlattening` (positions restarting at 0)
gives the same result as its documents run apart, and a left-padded row the same as the row alone.

Contract:
- `token_mask` is True on real tokens, False on pads.
- A real token starts a document when its position id is 0, or when it is the first real token of the
  row and the call has no past (a continuation of a cached row starts nothing by itself).
- Pads are never starts and belong to no document (`document_ids` gives -1).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def token_mask(
    attention_mask: torch.Tensor | None, input_shape: tuple[int, int], device=None
) -> torch.Tensor:
    """Boolean (B, L) mask of real tokens; all True when `attention_mask` is None.

    `attention_mask` may be longer than the input (it then covers past tokens too, as in `generate`);
    only its last L columns are used.
    """
    batch_size, length = input_shape
    if attention_mask is None:
        return torch.ones(batch_size, length, dtype=torch.bool, device=device)
    if attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be 2-D (batch, length), got shape {tuple(attention_mask.shape)}"
        )
    return attention_mask[:, -length:].bool()


def document_starts(
    mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    has_past: bool = False,
) -> torch.Tensor:
    """Boolean (B, L): True where a real token starts a sequence or a packed document.

    Args:
        mask: (B, L) bool, real tokens.
        position_ids: (B, L) or (1, L) ints; a real token at position 0 starts a document.
        has_past: the row continues cached tokens, so its first real token is not a start unless its
            position id says so.
    """
    starts = torch.zeros_like(mask)
    if position_ids is not None:
        starts = (position_ids.expand_as(mask) == 0) & mask
    if not has_past:
        # The first real token of the row: real, with no real token before it.
        real_before = torch.cumsum(mask.long(), dim=-1) - mask.long()
        starts = starts | (mask & (real_before == 0))
    return starts


def document_ids(mask: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Integer (B, L) document index within each row (0, 1, ...), -1 on pads.

    Real tokens of a continued row before its first start get 0: they belong to the document the
    cache ended in, and callers that track documents across calls offset the ids themselves.
    """
    ids = torch.cumsum(starts.long(), dim=-1) - 1
    ids = ids.clamp(min=0)
    return ids.masked_fill(~mask, -1)


def last_real_picker(mask: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`pick(values, old)`: each row's entry of (B, L, ...) `values` at its last real token, cast to the
    dtype of `old` (B, ...), which is kept for rows with no real token. What a cache carries from one
    call to the next; the positions are found once per call."""
    has_real = mask.any(dim=1)
    rows = torch.arange(mask.shape[0], device=mask.device)
    last = mask.shape[1] - 1 - torch.argmax(mask.flip(1).long(), dim=1)  # (B,)

    def pick(values: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        keep = has_real.view(-1, *([1] * (old.dim() - 1)))
        return torch.where(keep, values[rows, last].to(old.dtype), old)

    return pick
