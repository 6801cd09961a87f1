"""The LSLM pass's layout, without parameters: the byte view of a batch (markers taken out), the
segmentation record, the decoder's slots, and the index maps between them (modeling_lslm's legend)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ByteView:
    """A batch with its marker ids taken out: every row's bytes (the ids the token encoder reads) keep
    their order at the right end, pads and markers move to the left. All fields are (B, T).

    `order`: the input column of each column; `ids`: byte ids (pad id elsewhere); `mask`: holds a byte;
    `position_ids`: the byte's rank in its document; `documents`: document number (1-based, counted over
    the input, so a document of markers only still has one; 0 elsewhere); `starts`: a document's first
    byte; `marker_ends`: a marker follows the byte before its document's next byte. `input_bytes` and
    `input_documents` are the byte flags and document numbers of the input columns.
    """

    order: torch.Tensor
    ids: torch.Tensor
    mask: torch.Tensor
    position_ids: torch.Tensor
    documents: torch.Tensor
    starts: torch.Tensor
    marker_ends: torch.Tensor
    input_bytes: torch.Tensor
    input_documents: torch.Tensor


@dataclass
class Segmentation:
    """One pass's boundaries over a `ByteView`, each (B, T): `ends` (byte t ends a segment), `logits` p̂_t
    and `probs` q_t (float32 at least), `forced` (ends not decided by the router: `<BoS>`, `<eos>`, a
    document's last byte, a byte before a marker), `content_ends` (ends decided by the byte itself: the
    router, `<BoS>`, `<eos>`), `index` (segment of each byte, -1 elsewhere) and `opens`. `confidence`: in
    training with `boundary_estimator="confidence"`, each byte's straight-through decision confidence
    (`routing.decision_confidence`: value 1, gradient to the byte's own Gumbel-sigmoid sample); None
    otherwise."""

    ends: torch.Tensor
    logits: torch.Tensor
    probs: torch.Tensor
    forced: torch.Tensor
    content_ends: torch.Tensor
    index: torch.Tensor
    opens: torch.Tensor
    confidence: torch.Tensor | None = None
    # The Gumbel-sigmoid samples ẑ_t in training (q_t in eval): straight-through counts are built on it.
    relaxed: torch.Tensor | None = None
    # What inference would decide on these bytes (`boundary_rule`), for the logged inference rate.
    inferred: torch.Tensor | None = None
    # Training with the straight-through estimator: the ends as 0/1 floats whose gradient reaches the
    # samples (`lslm_estimators.straight_through_ends`); None otherwise.
    straight_ends: torch.Tensor | None = None


@dataclass
class DecoderSlots:
    """The decoder's view of a row, each (B, S): `ids`, `targets` (-100: none), `group` (slots that
    attend to each other; -1: empty slot), `reads` (the slot reads its document's segments with index
    below this), `document`, `position` (index within the segment); and `token_slot` (B, T), the slot of
    each byte of the `ByteView`. After the segments' slots come one `<bos>` slot per input document for
    the segment that would follow its last one (read when a document ends on a closed segment)."""

    ids: torch.Tensor
    targets: torch.Tensor
    group: torch.Tensor
    reads: torch.Tensor
    document: torch.Tensor
    position: torch.Tensor
    token_slot: torch.Tensor
    num_segment_slots: int
    # (B, S) in training: the decision confidence that scales each slot's input (see `Segmentation`).
    confidence: torch.Tensor | None = None


def _previous(values: torch.Tensor, fill) -> torch.Tensor:
    """(B, T) -> the value of the column before (fill in column 0)."""
    return F.pad(values, (1, 0), value=fill)[:, :-1]


def byte_view(input_ids: torch.Tensor, mask: torch.Tensor, starts: torch.Tensor, config) -> ByteView:
    """Take `<bos>`/`<nxt>` markers out of (B, T) ids: they are boundary signals, not bytes."""
    markers = mask & (
        (input_ids == config.segment_start_token_id) | (input_ids == config.segment_end_token_id)
    )
    is_byte = mask & ~markers
    documents = torch.cumsum(starts.long(), dim=1) * mask  # (B, T) input columns
    order = torch.sort(is_byte.long(), dim=1, stable=True).indices
    view_mask = torch.gather(is_byte, 1, order)
    ids = torch.gather(input_ids, 1, order).masked_fill(~view_mask, config.pad_token_id)
    view_documents = torch.gather(documents, 1, order) * view_mask
    view_starts = view_mask & (view_documents != _previous(view_documents, -1))
    rank = torch.cumsum(view_mask.long(), dim=1) - 1
    first = torch.cummax(torch.where(view_starts, rank, 0), dim=1).values
    position_ids = (rank - first).masked_fill(~view_mask, 0)
    # The byte before each marker (same document) ends its segment.
    columns = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    last_byte = torch.cummax(torch.where(is_byte, columns, -1), dim=1).values
    same_document = torch.gather(documents, 1, last_byte.clamp(min=0)) == documents
    follows = markers & (last_byte >= 0) & same_document
    marker_ends = torch.zeros_like(documents).scatter_add_(1, last_byte.clamp(min=0), follows.long()) > 0
    return ByteView(
        order=order,
        ids=ids,
        mask=view_mask,
        position_ids=position_ids,
        documents=view_documents,
        starts=view_starts,
        marker_ends=torch.gather(marker_ends, 1, order) & view_mask,
        input_bytes=is_byte,
        input_documents=documents,
    )


def document_causal_mask(mask: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool: causal within a document over real columns; an empty query row reads itself
    (a finite, unused output instead of NaN)."""
    length = mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    same = documents[:, :, None] == documents[:, None, :]
    allowed = causal[None] & same & mask[:, None, :] & mask[:, :, None]
    eye = torch.eye(length, dtype=torch.bool, device=mask.device)[None]
    return (allowed | (eye & ~mask[:, :, None]))[:, None]


def _with_pending_slots(
    fields: dict[str, torch.Tensor],
    view: ByteView,
    start_id: int,
    num_segments: int,
    token_slot,
    num_slots: int,
) -> DecoderSlots:
    """Append one `<bos>` slot per input document (document d at column num_slots + d - 1): the segment
    that would follow the document's last one, reading all of its segments."""
    batch = view.ids.shape[0]
    documents_per_row = view.input_documents.amax(dim=1) if view.ids.shape[1] else view.ids.new_zeros(batch)
    num_pending = int(documents_per_row.max()) if batch else 0
    number = torch.arange(1, num_pending + 1, device=view.ids.device).expand(batch, -1)
    present = number <= documents_per_row[:, None]
    pending = dict(
        ids=torch.full_like(number, start_id),
        targets=torch.full_like(number, -100),
        group=torch.where(present, num_segments + number - 1, -1),
        reads=torch.full_like(number, num_segments),
        document=torch.where(present, number, -1),
        position=torch.zeros_like(number),
    )
    merged = {name: torch.cat([fields[name], pending[name]], dim=1) for name in pending}
    return DecoderSlots(**merged, token_slot=token_slot, num_segment_slots=num_slots)


def _segment_starts(segment_documents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, M) bool: the first segment of each document."""
    previous = F.pad(segment_documents, (1, 0), value=-1)[:, :-1]
    return valid & (segment_documents != previous)


def always_closing(ids: torch.Tensor, config) -> torch.Tensor:
    """Bool mask of `<BoS>` and `<eos>` ids: bytes that end their segment whatever the router says."""
    return (ids == config.bos_token_id) | (ids == _first_id(config.eos_token_id))


def _first_id(token_id: int | list[int] | None) -> int:
    return token_id[0] if isinstance(token_id, list) else (-1 if token_id is None else token_id)


def token_slots(view: ByteView, segmentation: Segmentation, slots: DecoderSlots) -> torch.Tensor:
    """(B, T) the slot whose logits each input column reports: the slot of its byte while the byte's
    segment is open; once the segment is closed (by the byte itself or by a marker) the `<bos>` slot of
    the document's next segment (or its pending slot when no byte follows)."""
    length = view.order.shape[1]
    columns = torch.arange(length, device=view.order.device).expand_as(view.order)
    inverse = torch.argsort(view.order, dim=1)  # (B, T) view column of each input column
    is_byte, documents = view.input_bytes, view.input_documents
    last = torch.cummax(torch.where(is_byte, columns, -1), dim=1).values
    # The first byte strictly after each column (length when none).
    following = torch.where(is_byte, columns, length).flip(1).cummin(dim=1).values.flip(1)
    following = F.pad(following, (0, 1), value=length)[:, 1:]
    has_next = (following < length) & (
        torch.gather(documents, 1, following.clamp(max=length - 1)) == documents
    )
    last_view = torch.gather(inverse, 1, last.clamp(min=0))
    next_view = torch.gather(inverse, 1, following.clamp(max=length - 1))
    open_segment = is_byte & ~torch.gather(segmentation.content_ends, 1, last_view)
    own = torch.gather(slots.token_slot, 1, last_view)
    next_bos = torch.gather(slots.token_slot, 1, next_view) - 1
    pending = slots.num_segment_slots + documents - 1
    return torch.where(open_segment, own, torch.where(has_next, next_bos, pending)).clamp(min=0)


def opening_probs(segmentation: Segmentation, view: ByteView) -> torch.Tensor:
    """(B, T) float32 over the view: the probability that each byte opens a segment (b_{t+1} = z_t,
    docs/ARCHITECTURE.md §2), i.e. q of the byte before it; 1 at a document's first byte and after a
    forced end (`<BoS>`, `<eos>`, a byte before a marker); 0 where the view holds no byte. Detached: a
    figure to show, not a term of the loss."""
    ends = torch.where(segmentation.forced, 1.0, segmentation.probs.detach().float())
    return torch.where(view.starts, 1.0, _previous(ends, 1.0)) * view.mask


def closed_segments(segmentation: Segmentation, view: ByteView) -> torch.Tensor:
    """(B,) segments of each row that have closed (all of them unless the last byte's is still open)."""
    count = (segmentation.index.max(dim=1).values + 1).clamp(min=0)
    last_open = view.mask[:, -1] & ~segmentation.ends[:, -1] if view.mask.shape[1] else count.bool()
    return count - last_open.long()


def slot_confidence(
    segmentation: Segmentation, slot: torch.Tensor, bos_slot: torch.Tensor, sink: int, total: int
) -> torch.Tensor:
    """(B, total) confidence of the decision each decoder slot stands for: a byte's slot, that of its own
    decision; a segment's `<bos>` slot, that of the close before it (1 at a document's first segment,
    whose opening no router decided; 1 at the pending slots). `slot`/`bos_slot` (B, T) map view bytes to
    the `sink` segment slots (`sink` itself: no slot)."""
    confidence = segmentation.confidence
    table = confidence.new_ones(confidence.shape[0], total + 1)
    table[:, : sink + 1].scatter_(1, slot, confidence)
    table[:, : sink + 1].scatter_(1, bos_slot, _previous(confidence, 1.0))
    # Drop the sink column (what belongs to no slot); the pending slots after it keep 1.
    return torch.cat([table[:, :sink], table[:, sink + 1 :]], dim=1)


def segment_close_columns(view: ByteView, segmentation: Segmentation) -> torch.Tensor:
    """(B, M) the input column whose cached step closes (and encodes) each segment: its last byte's when
    the byte ends it (router, `<BoS>`, `<eos>`, a following document), the first marker after it when
    only a marker does; T (no column) for a row's segment still open."""
    batch, length = view.order.shape
    index = segmentation.index
    num_segments = int(index.max()) + 1 if index.numel() else 0
    columns = torch.arange(length, device=index.device).expand(batch, -1)
    is_marker = (view.input_documents > 0) & ~view.input_bytes
    # The first marker strictly after each input column (T when none).
    next_marker = torch.where(is_marker, columns, length).flip(1).cummin(dim=1).values.flip(1)
    next_marker = F.pad(next_marker, (0, 1), value=length)[:, 1:]
    by_marker = view.marker_ends & ~segmentation.content_ends
    close = torch.where(by_marker, torch.gather(next_marker, 1, view.order), view.order)
    closed = segmentation.ends & view.mask
    result = index.new_full((batch, num_segments + 1), length)
    sink = torch.where(closed, index, num_segments)  # bytes that close nothing write the dropped column
    result.scatter_(1, sink, close.masked_fill(~closed, length))
    return result[:, :num_segments]
