"""LSLM's inference boundary rule "rate" (the default; `LSLMConfig.boundary_rule`): close segments at the
rate the posterior says training samples them, deterministically.

Training closes byte t with probability q_t (a Gumbel-sigmoid sample at ½ is a Bernoulli(q_t) draw), so
on any text it closes Σ q_t bytes in expectation. Thresholding q_t cannot match that while the router is
unsure: with q_t ≈ 0.7 everywhere (the KL pulls q toward the prior) a threshold of ½ closes every byte
and one of 0.8 none. The "rate" rule keeps a running sum S_t of q over the document's bytes and closes
byte t when S crosses a half-integer there, ⌊S_t + ½⌋ > ⌊S_{t−1} + ½⌋: on every text it closes Σ q_t
bytes up to rounding (the training rate on that very text), it depends on q_≤t only (causal), a byte
with q_t = 1 always closes and one with q_t = 0 never does, and higher q closes sooner.

Exactness: q_t is rounded to a multiple of 2⁻¹⁶ and summed as integers, so the parallel pass (a
cumulative sum) and generation (one addition per step, the running sum kept in the `SegmentCache`) take
the same decisions whenever they see the same q_t.
"""

from __future__ import annotations

import torch

RATE_UNITS = 1 << 16
HALF = RATE_UNITS // 2


def rate_units(probs: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """(B, T) int64: q_t in units of 2⁻¹⁶ where `counted`, else 0."""
    units = torch.round(probs.detach().float() * RATE_UNITS).long()
    return torch.where(counted, units, torch.zeros_like(units))


def crosses(previous: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """True where the running sum passed a half-integer between `previous` and `current` (int64 units)."""
    return torch.div(current + HALF, RATE_UNITS, rounding_mode="floor") > torch.div(
        previous + HALF, RATE_UNITS, rounding_mode="floor"
    )


def _running_sums(
    probs: torch.Tensor, counted: torch.Tensor, starts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) int64 running sums of each document's units before and after each column."""
    units = rate_units(probs, counted)
    total = torch.cumsum(units, dim=1)
    before = total - units
    # The running sum restarts at each document: subtract what the row held before its first column.
    # `before` never decreases along a row, so the latest start's value is the running maximum.
    base = torch.cummax(torch.where(starts, before, torch.zeros_like(before)), dim=1).values
    return before - base, total - base


def rate_matched_ends(probs: torch.Tensor, counted: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the "rate" rule over whole rows; `counted` marks the bytes the router decides,
    `starts` the first column of each document (its running sum starts at 0)."""
    before, after = _running_sums(probs, counted, starts)
    return crosses(before, after) & counted


def running_units(probs: torch.Tensor, counted: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """(B,) int64: each row's running sum after its last column (the last document's), for the cache."""
    _, after = _running_sums(probs, counted, starts)
    return after[:, -1] if after.shape[1] else after.new_zeros(after.shape[0])


HASH_MASK = 0xFFFFFFFF


def random_ends(positions: torch.Tensor, seed: int, rate: float) -> torch.Tensor:
    """Bool ends of `boundary_source="random"`: the byte of rank `positions` in its document ends its
    segment where a fixed integer hash of (rank, `seed`), read as a fraction of 2^32, falls below `rate`.
    Integer arithmetic only: the same rank gives the same answer in a parallel pass, in every cached
    step and on every device."""
    mixed = (positions.long() ^ ((seed * 0x27D4EB2D) & HASH_MASK)) & HASH_MASK
    for _ in range(3):
        # A 32-bit integer mix; the product stays below 2^59, inside int64.
        mixed = (((mixed >> 16) ^ mixed) * 0x45D9F3B) & HASH_MASK
    mixed = (mixed >> 16) ^ mixed
    return mixed < int(rate * 2**32)


def source_ends(config, positions: torch.Tensor) -> torch.Tensor:
    """Ends decided by a `boundary_source` other than the router: every byte ("every"), or `random_ends`
    at the prior's mean rate ("random")."""
    if config.boundary_source == "every":
        return torch.ones_like(positions, dtype=torch.bool)
    alpha, beta = config.beta_prior()
    return random_ends(positions, config.boundary_seed, alpha / (alpha + beta))
