"""Token-level views of concept-level results, for `output_hidden_states` and `output_attentions`.

Legend: B batch, L tokens (this call), C new concepts (this call), N concept slots a new concept may read,
Dc concept width, Hc concept heads.

transformers reads every entry of `hidden_states` and `attentions` as token-level: generation splits a
verification pass's outputs per token by slicing dim -2 (`generation.utils._split_model_outputs`), so an
entry must be a tensor whose dim -2 runs over the call's tokens. A concept pass has concept rows; its view
puts each concept at the token that *emits* it, the token where it becomes readable in the call that
computes it: its opening token under "first" pooling, under "sum"/"mean" (DLCM always) the opening token
that closes its chunk (the row's next opening, a document start included). A token emits at most one
concept and a concept is emitted in exactly one call, so a cached step's rows equal a full forward's;
tokens that emit none get zeros.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def emission_index(
    opens: torch.Tensor, mask: torch.Tensor, had_open: torch.Tensor, pooling: str
) -> torch.Tensor:
    """(B, L) long: which of the call's new concepts (their order in `EmittedConcepts`) token t emits, -1
    for none. `had_open` (B,) bool: the row's cache held an open chunk before the call."""
    openings = opens & mask
    rank = torch.cumsum(openings.long(), dim=1) - 1  # (B, L) index among the call's openings
    if pooling != "first":
        # An opening closes the row's previous chunk: the cached open one first, then the call's own.
        rank = rank - 1 + had_open.long()[:, None]
    return torch.where(openings & (rank >= 0), rank, -1)


def concepts_at_tokens(concept_states: torch.Tensor, emission: torch.Tensor) -> torch.Tensor:
    """(B, L, Dc): each token's emitted concept from (B, C, Dc), zeros where it emits none."""
    table = F.pad(concept_states, (0, 0, 1, 0))  # (B, 1 + C, Dc): index -1 lands on the zero row
    return torch.gather(table, 1, (emission + 1)[..., None].expand(-1, -1, table.shape[-1]))


def concepts_from_tokens(
    token_view: torch.Tensor, emission: torch.Tensor, concept_states: torch.Tensor
) -> torch.Tensor:
    """(B, C, Dc) the concepts read back from their emitting tokens' rows of `token_view` (the same values),
    so that the view lies on the path the computation takes; slots no token emits (a row's padding) keep
    `concept_states`."""
    batch, num_concepts, width = concept_states.shape
    length = emission.shape[1]
    # (B, C + 1) the token emitting each slot, L for none; column C gathers the tokens that emit none.
    source = emission.new_full((batch, num_concepts + 1), length)
    target = torch.where(emission >= 0, emission, num_concepts)
    tokens = torch.arange(length, device=emission.device).expand(batch, -1)
    source = source.scatter(1, target, tokens)[:, :num_concepts]
    padded = F.pad(token_view, (0, 0, 0, 1))  # (B, L + 1, Dc)
    read = torch.gather(padded, 1, source[..., None].expand(-1, -1, width))
    return torch.where((source < length)[..., None], read, concept_states)


class ConceptPassViews:
    """Called after each concept pass (`ConceptStackMixin.run_concept_layers`): keeps the pass's (B, L, Dc)
    token view and hands the concepts back read from it (`concepts_from_tokens`, equal values)."""

    def __init__(self, emission: torch.Tensor) -> None:
        self.emission = emission
        self.views: list[torch.Tensor] = []

    def __call__(self, concept_states: torch.Tensor) -> torch.Tensor:
        view = concepts_at_tokens(concept_states, self.emission)
        self.views.append(view)
        return concepts_from_tokens(view, self.emission, concept_states)

    def states(self, num_passes: int, like: torch.Tensor, width: int) -> list[torch.Tensor]:
        """One (B, L, Dc) view per pass; zeros for every pass of a call that emitted no concept."""
        if self.views:
            return self.views
        return [like.new_zeros(*like.shape[:2], width) for _ in range(num_passes)]


def concept_weights_at_tokens(
    weights: torch.Tensor | None, emission: torch.Tensor, num_heads: int, num_slots: int, like: torch.Tensor
) -> torch.Tensor:
    """(B, Hc, L, N) from a concept pass's (B, Hc, C, N) weights (None: the call ran no pass): row t holds
    the weights of the concept token t emits, zeros where it emits none."""
    batch, length = emission.shape
    if weights is None:
        return like.new_zeros(batch, num_heads, length, num_slots)
    table = F.pad(weights, (0, 0, 1, 0))  # (B, Hc, 1 + C, N)
    index = (emission + 1)[:, None, :, None].expand(-1, table.shape[1], -1, table.shape[-1])
    return torch.gather(table, 2, index)


def concept_entries_at_tokens(
    entries: tuple[torch.Tensor | None, ...],
    first: int,
    heads: Sequence[int],
    emission: torch.Tensor,
    num_slots: int,
    like: torch.Tensor,
) -> tuple[torch.Tensor | None, ...]:
    """`attentions` with the concept passes' entries (`first`, then one per element of `heads`) replaced
    by their token views; the empty tuple (no weights computed) stays empty."""
    if not entries:
        return entries
    result = list(entries)
    for offset, num_heads in enumerate(heads):
        result[first + offset] = concept_weights_at_tokens(
            result[first + offset], emission, num_heads, num_slots, like
        )
    return tuple(result)


def concept_model_attentions(
    model, recorder, emission: torch.Tensor, num_slots: int, like: torch.Tensor
) -> tuple[torch.Tensor | None, ...]:
    """A concept-level model's `attentions` (`ConceptModelOutput`), the concept passes as token views;
    `num_slots` the slots a pass would have read in a call that ran none (the cached ones)."""
    entries = recorder.entries(model.attention_modules())
    heads = [model.concept_layers[index].self_attn.num_heads for index in model.concept_layer_schedule()]
    return concept_entries_at_tokens(entries, len(model.encoder_layers), heads, emission, num_slots, like)


def slot_count(cache) -> int:
    """The concept slots a cache holds (0 without a cache)."""
    return 0 if cache is None else cache.num_concept_slots
