"""Local-rank boundary scores: the router's probability ranked among its document's recent tokens.

Legend: B batch, L tokens (this call), W `boundary_rank_window`.

Why: a threshold on the router's probabilities p_t is one number for every text, and the probabilities
of different languages sit at different levels. On SmolLM2-135M converted at R = 2, one threshold held
the ratio over the mix by opening a concept at nearly every Chinese or Japanese token and almost never in
English (93 tokens per concept on English prose, 1.2 on Chinese prose): the mix met R while no language
did. Ranking p_t among the probabilities of the last W tokens of its own document makes the decision
relative: a token opens a concept when it is among the most boundary-like of its neighbourhood, so every
text of W tokens or more gets about one concept per R tokens whatever the level of its probabilities,
and the router decides *where* the concepts go, not how many.

The score (no gradient; the straight-through factor and the ratio loss still read p_t):

    r_t = 1 − (g_t + ½) / n_t,

n_t the free tokens of t's document among the last W positions up to t (t included; free: real and
not a document start), g_t those among them with p_j > p_t. r_t is the midpoint of p_t's rank interval
among them, so `r_t ≥ 1 − 1/R` holds for about one free token in R of any stationary stretch
(exactly round(n/R) of n exchangeable probabilities without ties). Starts score 1 and pads 0, as their
probabilities do, so every rule written for probabilities (`routing.boundary_decisions`, the held
threshold of `training.ratio_hold`) applies to the scores unchanged.

Causal: r_t reads p of positions t − W + 1 .. t. Cached decoding carries the last W − 1 probabilities of
each row and their documents (`ConceptState.recent_probs`, `recent_documents`; −1 for a position that is
not a free token), so a continued row scores exactly as a full forward does. Pads and earlier documents
never count, so a left-padded row scores as it does alone.
"""

from __future__ import annotations

import torch


def free_token_documents(starts: torch.Tensor, mask: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """(B, L) long: each free token's document id (real and not a start), −1 elsewhere."""
    return documents.masked_fill(starts | ~mask, -1)


def _history(
    probs: torch.Tensor,
    starts: torch.Tensor,
    mask: torch.Tensor,
    documents: torch.Tensor,
    recent_probs: torch.Tensor,
    recent_documents: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The call's (B, L) owning documents, and the (B, W − 1 + L) probabilities and owners of the row's
    recent positions followed by the call's (detached, in the probabilities' dtype)."""
    owners = free_token_documents(starts, mask, documents)
    history_probs = torch.cat([recent_probs.to(probs.dtype), probs.detach()], dim=1)
    return owners, history_probs, torch.cat([recent_documents, owners], dim=1)


def local_rank_scores(
    probs: torch.Tensor,
    starts: torch.Tensor,
    mask: torch.Tensor,
    documents: torch.Tensor,
    recent_probs: torch.Tensor,
    recent_documents: torch.Tensor,
) -> torch.Tensor:
    """(B, L) detached local-rank scores r_t (module docstring); 1 at starts, 0 at pads.

    Args:
        probs: (B, L) router probabilities (float32 or float64).
        starts, mask: (B, L) bool document starts and real tokens.
        documents: (B, L) long document id of each real token (counting on from the cached rows).
        recent_probs, recent_documents: (B, W − 1) the row's previous positions (`recent_after`); zeros
            and −1 for a row without history.
    """
    probs = probs.detach()
    owners, history_probs, history_owners = _history(
        probs, starts, mask, documents, recent_probs, recent_documents
    )
    window = recent_probs.shape[1] + 1
    # (B, L, W): the W positions ending at each token.
    window_probs, window_owners = history_probs.unfold(1, window, 1), history_owners.unfold(1, window, 1)
    counted = (window_owners == owners[..., None]) & (owners >= 0)[..., None]
    above = counted & (window_probs > probs[..., None])
    count, higher = counted.sum(dim=-1), above.sum(dim=-1)  # (B, L)
    scores = 1.0 - (higher.to(probs.dtype) + 0.5) / count.clamp_min(1).to(probs.dtype)
    scores = torch.where(owners >= 0, scores, 0.0)
    return torch.where(starts & mask, 1.0, scores)


def recent_after(
    probs: torch.Tensor,
    starts: torch.Tensor,
    mask: torch.Tensor,
    documents: torch.Tensor,
    recent_probs: torch.Tensor,
    recent_documents: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (B, W − 1) probabilities and owning documents of each row's last W − 1 positions after this
    call, what the next call's `local_rank_scores` continues from (arguments as there)."""
    _, history_probs, history_owners = _history(
        probs, starts, mask, documents, recent_probs, recent_documents
    )
    first = history_probs.shape[1] - recent_probs.shape[1]
    return history_probs[:, first:].to(recent_probs.dtype), history_owners[:, first:]
