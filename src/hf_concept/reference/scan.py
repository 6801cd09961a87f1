"""The dechunk EMA as a plain Python loop over concepts (the form of ConceptMoE's appendix B).

Legend: B batch, C concepts, D width. Same contract as `hf_concept.modeling.concept_scan.ema_scan`.
"""

from __future__ import annotations

import torch


def ema_scan_loop(
    concept_states: torch.Tensor, probs: torch.Tensor, concept_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, C, D): ema_m = p_m c_m + (1 - p_m) ema_{m-1}, one concept at a time; masked slots skipped, zero."""
    batch_size, num_concepts, width = concept_states.shape
    if concept_mask is None:
        concept_mask = torch.ones(batch_size, num_concepts, dtype=torch.bool, device=concept_states.device)
    # Masked slots may hold anything (NaN included): blank them so that not even 0 * NaN reaches a gradient.
    concept_states = torch.where(concept_mask.unsqueeze(-1), concept_states, 0.0)
    probs = torch.where(concept_mask, probs, 0.0)
    ema = concept_states.new_zeros(batch_size, width)
    outputs = []
    # unbind, not indexing inside the loop: its backward stacks the per-concept gradients once instead of
    # building a full-size zero gradient per concept.
    steps = zip(
        concept_states.unbind(1),
        probs.unsqueeze(-1).unbind(1),
        concept_mask.unsqueeze(-1).unbind(1),
        strict=True,
    )
    for concept, prob, real in steps:
        updated = prob * concept + (1 - prob) * ema
        ema = torch.where(real, updated, ema)
        outputs.append(torch.where(real, updated, 0.0))
    if not outputs:
        return concept_states.new_zeros(batch_size, 0, width)
    return torch.stack(outputs, dim=1)
