"""The dechunk EMA over concepts (ConceptMoE eq. 8) as a parallel scan, and its one-step decoding form.

Legend: B batch, C concepts, D width, T block length of the scan.

Contract: `ema_scan(concept_states (B, C, D), probs (B, C), concept_mask (B, C))` returns (B, C, D) with

    ema_m = p_m * c_m + (1 - p_m) * ema_{m-1},    ema_{-1} = 0,

over each row's real concepts (masked slots are skipped: they change nothing and read as zeros, even if
their inputs are NaN; `concept_mask=None` means all real, and checking whether any slot is masked costs
one host sync). A document's first concept has p = 1, which resets the recurrence, so packed
documents never mix. Causal over the concept index: output m depends on concepts 0..m only.
`ema_step` is the same recurrence for one new concept at decoding time.

How the scan works: split C into blocks of T. Inside a block, the recurrence is a (T, T) lower-triangular
matrix of decay products applied with one batched matmul; the products come from a masked cumulative
product, never from logs or divisions, because 1 - p is exactly 0 at document starts. Block end states are
then carried across blocks by the same recurrence one level up (C / T items), applied recursively.
Half-precision inputs are computed in float32 and returned in their own dtype; gradients are autograd's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_BLOCK_SIZE = 16


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _decay_matrix(decay: torch.Tensor) -> torch.Tensor:
    """(B, N, T, T) with [j, m] = prod of decay over (j, m] for m >= j, else 0, from (B, N, T) decays."""
    block = decay.shape[-1]
    later = torch.ones(block, block, dtype=torch.bool, device=decay.device).triu(1)
    # Row j keeps the decays after j and ones up to j, so its running product is the decay from j to m.
    factors = torch.where(later, decay.unsqueeze(-2), 1.0)
    return torch.cumprod(factors, dim=-1).triu()


def linear_recurrence(
    decay: torch.Tensor,
    weight: torch.Tensor | None,
    states: torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> torch.Tensor:
    """(B, C, D) solution of x_m = decay_m * x_{m-1} + weight_m * states_m with x_{-1} = 0.

    `decay` and `weight` are (B, C) (weight None means ones), `states` (B, C, D), all in one floating dtype.
    """
    batch_size, length, width = states.shape
    block = min(block_size, length)
    num_blocks = -(-length // block)
    padding = num_blocks * block - length
    if padding:
        # Padded steps keep the state (decay 1) and add nothing (weight 0); they are cut off at the end.
        decay = F.pad(decay, (0, padding), value=1.0)
        weight = F.pad(weight, (0, padding)) if weight is not None else None
        states = F.pad(states, (0, 0, 0, padding))
    decay = decay.view(batch_size, num_blocks, block)
    products = _decay_matrix(decay)
    # (B, N, T, T): [m, j] = weight_j * decay product from j to m, the weight of input j in output m.
    mixing = products.transpose(-1, -2)
    if weight is not None:
        mixing = mixing * weight.view(batch_size, num_blocks, 1, block)
    # (B, N, T, D)
    blocked = torch.matmul(mixing, states.view(batch_size, num_blocks, block, width))
    if num_blocks > 1:
        from_block_start = torch.cumprod(decay, dim=-1)
        block_ends = blocked[:, :, -1].clone()
        carried = linear_recurrence(from_block_start[:, :, -1], None, block_ends, block_size)
        # (B, N, 1, D): the state each block starts from, zero for the first block.
        incoming = F.pad(carried[:, :-1], (0, 0, 1, 0)).unsqueeze(2)
        blocked = blocked.addcmul_(from_block_start.unsqueeze(-1), incoming)
    # (B, C, D)
    output = blocked.view(batch_size, num_blocks * block, width)
    return output[:, :length] if padding else output


def _check_scan_inputs(
    concept_states: torch.Tensor, probs: torch.Tensor, concept_mask, block_size: int
) -> None:
    if concept_states.dim() != 3:
        raise ValueError(f"concept_states must be (B, C, D), got shape {tuple(concept_states.shape)}")
    if probs.shape != concept_states.shape[:2]:
        raise ValueError(
            f"probs must be (B, C) = {tuple(concept_states.shape[:2])}, got {tuple(probs.shape)}"
        )
    if concept_mask is not None and (concept_mask.shape != probs.shape or concept_mask.dtype != torch.bool):
        raise ValueError(
            f"concept_mask must be a (B, C) bool tensor, got shape {tuple(concept_mask.shape)} "
            f"dtype {concept_mask.dtype}"
        )
    # Blocks of one would recurse forever: each level must shrink the sequence.
    if not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"block_size must be an integer >= 2, got {block_size!r}")


def ema_scan(
    concept_states: torch.Tensor,
    probs: torch.Tensor,
    concept_mask: torch.Tensor | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> torch.Tensor:
    """(B, C, D) EMA of concepts: ema_m = p_m c_m + (1 - p_m) ema_{m-1}; zeros on masked slots."""
    _check_scan_inputs(concept_states, probs, concept_mask, block_size)
    if concept_states.shape[1] == 0:
        return concept_states.clone()
    dtype = _compute_dtype(concept_states.dtype)
    states = concept_states.to(dtype)
    probs = probs.to(dtype)
    # Checking once lets the common all-real case skip two full passes over the states.
    some_masked = concept_mask is not None and not bool(concept_mask.all())
    if some_masked:
        states = torch.where(concept_mask.unsqueeze(-1), states, 0.0)
        probs = torch.where(concept_mask, probs, 0.0)
        decay = torch.where(concept_mask, 1.0 - probs, 1.0)
    else:
        decay = 1.0 - probs
    output = linear_recurrence(decay, probs, states, block_size)
    if some_masked:
        output = torch.where(concept_mask.unsqueeze(-1), output, 0.0)
    return output.to(concept_states.dtype)


def ema_step(previous_ema: torch.Tensor, concept_states: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """(B, D) one EMA step for a new concept per row: p * concept + (1 - p) * previous (p is (B,))."""
    if previous_ema.shape != concept_states.shape or previous_ema.dim() != 2:
        raise ValueError(
            f"previous_ema and concept_states must both be (B, D), got {tuple(previous_ema.shape)} "
            f"and {tuple(concept_states.shape)}"
        )
    if probs.shape != concept_states.shape[:1]:
        raise ValueError(f"probs must be (B,) = ({concept_states.shape[0]},), got {tuple(probs.shape)}")
    dtype = _compute_dtype(concept_states.dtype)
    prob = probs.to(dtype).unsqueeze(-1)
    updated = prob * concept_states.to(dtype) + (1.0 - prob) * previous_ema.to(dtype)
    return updated.to(concept_states.dtype)
