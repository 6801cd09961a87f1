"""DLCM's probability smoothing as a plain loop over concepts (H-Net's EMA written one step at a time).

Legend: B batch, C concepts, Dc concept width. Same contract as
`hf_concept.modeling.concept_smoothing.probability_smoothing`.
"""

from __future__ import annotations

import torch


def probability_smoothing_reference(
    concept_states: torch.Tensor,
    opening_probs: torch.Tensor,
    concept_mask: torch.Tensor,
    previous_smoothed: torch.Tensor,
    has_previous: torch.Tensor,
) -> torch.Tensor:
    """(B, C, Dc): z̃_m = p_m z_m + (1 − p_m) z̃_{m−1}, from the cached z̃ where a row has one, else 0."""
    batch_size, num_concepts, width = concept_states.shape
    rows = []
    for row in range(batch_size):
        smoothed = previous_smoothed[row] if bool(has_previous[row]) else concept_states.new_zeros(width)
        outputs = []
        for index in range(num_concepts):
            if not bool(concept_mask[row, index]):
                outputs.append(concept_states.new_zeros(width))
                continue
            prob = opening_probs[row, index]
            smoothed = prob * concept_states[row, index] + (1 - prob) * smoothed
            outputs.append(smoothed)
        rows.append(torch.stack(outputs) if outputs else concept_states.new_zeros(0, width))
    return torch.stack(rows)
