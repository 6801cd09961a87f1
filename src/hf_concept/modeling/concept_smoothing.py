"""DLCM's concept smoothing (§3.5.1) in its two forms, as pure functions over one call's new concepts.

Legend: B batch, C concepts (new in this call), Dc concept width.

- "ema" (H-Net's smoothing, which DLCM says it follows): z̃_m = p_m z_m + (1 − p_m) z̃_{m−1}, p_m the
  boundary probability of concept m's opening token. A document's first concept opens at the document
  start, where p = 1, so the recurrence restarts per document. The output depends on the probabilities,
  so the LM loss reaches a learned router through it (and through the straight-through confidence the
  decoder multiplies its cross-attention with, `routing.straight_through`). ConceptMoE's dechunk EMA
  (its eq. 8) is the same recurrence and calls the same function.
- "linear" (the form of checkpoints saved before the option existed): z̃_m = z_m + W_s z_{m−1} within a
  document, W_s zero at init. Nothing in it depends on the probabilities.

Both continue from a cached previous concept so that a cached call equals the full forward. Causal over
the concept index: z̃_m depends on concepts <= m of its own document.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .concept_scan import ema_scan


def probability_smoothing(
    concept_states: torch.Tensor,
    opening_probs: torch.Tensor,
    concept_mask: torch.Tensor,
    previous_smoothed: torch.Tensor,
    has_previous: torch.Tensor,
) -> torch.Tensor:
    """H-Net smoothing of (B, C, Dc) new concepts, continuing each row from its cached z̃ (B, Dc).

    Forward value: z̃_m = p_m · z_m + (1 − p_m) · z̃_{m−1} over each row's real concepts (`concept_mask`
    (B, C)), with z̃_{−1} = `previous_smoothed` where `has_previous` (B,) and 0 otherwise; masked slots
    are 0 and never read.
    Backward rule: plain autograd of that recurrence, ∂z̃_m/∂p_m = z_m − z̃_{m−1}, ∂z̃_m/∂z_m = p_m and
    ∂z̃_m/∂z̃_{m−1} = 1 − p_m.
    Reference: `hf_concept.reference.smoothing.probability_smoothing_reference`.
    """
    if concept_states.shape[1] == 0:
        return concept_states.clone()
    # The cached value enters as a concept with p = 1, which reproduces it exactly.
    states = torch.cat([previous_smoothed[:, None].to(concept_states.dtype), concept_states], dim=1)
    probs = torch.cat([torch.ones_like(opening_probs[:, :1]), opening_probs], dim=1)  # (B, 1 + C)
    valid = torch.cat([has_previous[:, None], concept_mask], dim=1)
    return ema_scan(states, probs, valid)[:, 1:]


def previous_concept_smoothing(
    concept_states: torch.Tensor,
    weight: torch.Tensor,
    documents: torch.Tensor,
    concept_mask: torch.Tensor,
    previous_concept: torch.Tensor,
    previous_document: torch.Tensor,
) -> torch.Tensor:
    """z̃_m = z_m + W_s z_{m−1} for (B, C, Dc) new concepts, z_{m−1} the row's previous concept (the
    cached `previous_concept` (B, Dc) of document `previous_document` (B,), −1: none, before the first
    new one) when it is real and of the same document, else nothing is added. Gradient: plain autograd."""
    previous = torch.cat([previous_concept[:, None].to(concept_states.dtype), concept_states[:, :-1]], dim=1)
    previous_documents = torch.cat([previous_document[:, None], documents[:, :-1]], dim=1)
    previous_valid = torch.cat([previous_document[:, None] >= 0, concept_mask[:, :-1]], dim=1)
    same_document = previous_valid & (previous_documents == documents)  # (B, C)
    return concept_states + F.linear(previous * same_document[..., None].to(previous.dtype), weight)
