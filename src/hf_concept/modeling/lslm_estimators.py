"""LSLM's boundary estimator and boundary-rate prior (LSLM §2.5–2.6), as pure functions.

Legend: B batch, T bytes.

The paper's estimator. Training draws ẑ_t = σ(p̂_t + g′ − g″) (Gumbel-sigmoid, `routing.gumbel_sigmoid`),
decides z_t = [ẑ_t ≥ ½] and passes gradients "through this discrete step as though it were continuous"
(straight-through) into the pooling matrix B of dynamic pooling (§2.5, Figure 3, after Nawrot et al. 2023):
with ĉ_t the (straight-through) number of segment ends before byte t, V[t, m] = m − ĉ_t, and B keeps
1 − V where V = 0 and 0 elsewhere. Each byte therefore enters its own segment with weight
w_t = 1 − (c_t − ĉ_t), value exactly 1 and gradient ∂w_t/∂z_i = 1 for every end decision i < t of its row.
Mean pooling divides by the same weights, so a segment's state moves toward its later bytes when an end
inside it becomes likelier, and segments after i (all of whose weights move together) do not move.

The paper's prior. "We assume a Beta(a, b) prior for p(z)": a prior on the boundary *rate* π, with
z_t ~ Bernoulli(π) given π. Its marginal over the number k of ends among a row's n free bytes is the
Beta-Binomial, P(k) = C(n, k) · B(k + a, n − k + b) / B(a, b). Scored on the sampled count, it lets
each byte's q_t go anywhere (near 0 or 1) so long as the row's count is likely under the Beta; an
i.i.d. Bernoulli(p) KL per byte instead pins every q_t at p. The paper's eq. 4 puts that KL per byte
inside the ELBO; with the Beta its per-byte form is the KL expected under the Beta (`beta_expected_kl`).

Not the paper's: the local-expectation gradient (`local_expectation_surrogate`). q(Z) factorises over the
bytes, so ∂E_q[L(Z)]/∂p̂_t = q_t (1 − q_t) · E_{Z_−t ~ q}[L(Z_−t, z_t = 1) − L(Z_−t, z_t = 0)] exactly: one
sample of the rest Z_−t and both values of z_t give an unbiased estimate of every byte's derivative.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def straight_through_ends(relaxed: torch.Tensor, ends: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
    """Straight-through segment ends (B, T) float32 (LSLM eq. 6 with Bengio et al.'s estimator).

    Forward value: exactly `ends` as 0.0 / 1.0 (the hard decisions z_t, forced ends included).
    Backward rule: ∂/∂ẑ_t = 1 at `free` positions (the sampled decisions), 0 elsewhere (forced ends and
    pads were not decided by the router): the gradient of z_t is handed to ẑ_t unchanged.
    Reference: `hf_concept.reference.routing.straight_through_ends_reference`.
    """
    relaxed = relaxed.float()
    # (ẑ − sg(ẑ)) is exactly 0.0 in value, so the sum is exactly the hard decision.
    surrogate = torch.where(free, relaxed - relaxed.detach(), torch.zeros_like(relaxed))
    return ends.float() + surrogate


def straight_through_pool_weights(straight_ends: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each byte's weight in its own segment of dynamic pooling's matrix B (LSLM Figure 3), (B, T).

    Forward value: exactly 1.0 at `mask` bytes, 0.0 at pads.
    Backward rule: ∂w_t/∂e_i = 1 for every i < t of the row (e = `straight_ends`, ends of segments):
    w_t = 1 − V[t, c_t] with V[t, m] = m − ĉ_t and ĉ_t = Σ_{i<t} e_i, the straight-through segment index.
    Reference: `hf_concept.reference.routing.pooling_matrix_reference` (B built entry by entry).
    """
    counts = torch.cumsum(straight_ends * mask, dim=1) - straight_ends * mask  # ĉ_t, exclusive
    weights = 1.0 + (counts - counts.detach())
    return weights * mask


def beta_parameters(prior_mean: float, concentration: float) -> tuple[float, float]:
    """(a, b) of the Beta prior with mean a / (a + b) = `prior_mean` and a + b = `concentration`."""
    if not 0 < prior_mean < 1 or not concentration > 0:
        raise ValueError(
            f"prior_mean={prior_mean!r} must be in (0, 1) and concentration={concentration!r} positive"
        )
    return prior_mean * concentration, (1.0 - prior_mean) * concentration


def beta_binomial_prior_nll(
    counts: torch.Tensor, totals: torch.Tensor, alpha: float, beta: float
) -> torch.Tensor:
    """−log BetaBinomial(k; n, a, b) per row: the Beta(a, b) rate prior's marginal over the number of
    segment ends k = `counts` among n = `totals` free bytes (see the module docstring).

    Forward value: −[log C(n, k) + log B(k + a, n − k + b) − log B(a, b)], log B(x, y) = lgamma(x) +
    lgamma(y) − lgamma(x + y), at the given counts (real-valued counts interpolate through lgamma).
    Backward rule: ∂/∂k = ψ(k + 1) − ψ(n − k + 1) − ψ(k + a) + ψ(n − k + b) (ψ: digamma), to whatever
    `counts` was built from; a straight-through count Σ(z_t + ẑ_t − sg(ẑ_t)) passes it to every ẑ_t.
    The term depends on the count only, so any arrangement of the ends with a likely count is optimal.
    Reference: `hf_concept.reference.routing.beta_binomial_reference` (the Binomial integrated over the
    Beta density numerically).
    """
    if not alpha > 0 or not beta > 0:
        raise ValueError(f"alpha={alpha!r} and beta={beta!r} must be positive")
    counts = counts.to(torch.promote_types(counts.dtype, torch.float32))
    totals = totals.to(counts.dtype)
    log_choose = torch.lgamma(totals + 1) - torch.lgamma(counts + 1) - torch.lgamma(totals - counts + 1)
    log_beta = (
        torch.lgamma(counts + alpha)
        + torch.lgamma(totals - counts + beta)
        - torch.lgamma(totals + alpha + beta)
    )
    log_beta_prior = math.lgamma(alpha) + math.lgamma(beta) - math.lgamma(alpha + beta)
    return -(log_choose + log_beta - log_beta_prior)


def straight_through_target_losses(
    straight_ends: torch.Tensor, end_losses: torch.Tensor, continue_losses: torch.Tensor
) -> torch.Tensor:
    """The decoder's loss at a byte's slot with the end decision passed straight through its target.

    The slot of byte t predicts `<nxt>` when z_t = 1 and the next byte x_{t+1} when z_t = 0; as though
    z_t were continuous, its loss is z_t · ℓ_end + (1 − z_t) · ℓ_continue (ℓ_end = −log p(`<nxt>`),
    ℓ_continue = −log p(x_{t+1}), both from the slot's own logits, which exist whichever way z_t went).
    Forward value: exactly ℓ_end where z_t = 1 and ℓ_continue where z_t = 0 (the hard target's loss).
    Backward rule: ∂/∂z_t = ℓ_end − ℓ_continue (an end is favoured where the decoder finds the next byte
    harder to continue than the segment to close: before hard-to-predict bytes, such as word starts);
    ∂/∂ℓ_end = z_t and ∂/∂ℓ_continue = 1 − z_t (the decoder learns its actual target only).
    Reference: `hf_concept.reference.routing.straight_through_target_losses_reference`.
    """
    return straight_ends * end_losses + (1.0 - straight_ends) * continue_losses


def beta_expected_kl(logits: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """E_{π~Beta(a, b)}[KL(Bernoulli(q) ‖ Bernoulli(π))] per element, q = σ(`logits`): the per-byte KL of
    LSLM eq. 4 with the Beta(a, b) prior (`LSLMConfig`'s docstring, prior_loss "beta_kl", says why
    this reading).

    Forward value: q log q + (1 − q) log(1 − q) − q (ψ(a) − ψ(a + b)) − (1 − q)(ψ(b) − ψ(a + b)), ψ the
    digamma (E log π = ψ(a) − ψ(a + b), E log(1 − π) = ψ(b) − ψ(a + b)), with log q = logsigmoid(l) and
    log(1 − q) = logsigmoid(−l) as in `routing.bernoulli_kl_from_logits`: nothing is clamped, so the
    value is finite at any logit. It is the KL to Bernoulli(a / (a + b)) ("kl") plus a positive gap
    (Jensen), and smallest at q = σ(ψ(a) − ψ(b)).
    Backward rule: ∂/∂l = q (1 − q) · (l − (ψ(a) − ψ(b))), by plain autograd through logsigmoid and exp
    (float32 at least).
    Reference: `hf_concept.reference.lslm.beta_expected_kl_reference`.
    """
    if not alpha > 0 or not beta > 0:
        raise ValueError(f"alpha={alpha!r} and beta={beta!r} must be positive")
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    shapes = torch.tensor([alpha, beta, alpha + beta], dtype=torch.float64)
    psi_a, psi_b, psi_ab = torch.special.digamma(shapes).tolist()
    log_q, log_not_q = F.logsigmoid(logits), F.logsigmoid(-logits)
    return torch.exp(log_q) * (log_q - (psi_a - psi_ab)) + torch.exp(log_not_q) * (
        log_not_q - (psi_b - psi_ab)
    )


def local_expectation_surrogate(
    logits: torch.Tensor, advantages: torch.Tensor, decided: torch.Tensor
) -> torch.Tensor:
    """A scalar of value exactly 0 whose gradient to the router's logits p̂_t is the local-expectation
    gradient of the expected loss (module docstring), given each decided byte's `advantages`
    A_t = L(Z_−t, z_t = 1) − L(Z_−t, z_t = 0) (B, T) at the sampled rest (no gradient taken through A).

    Forward value: Σ_t [decided] · A_t · (q_t − sg(q_t)) = 0.0 exactly, q_t = σ(p̂_t).
    Backward rule: ∂/∂p̂_t = A_t · q_t (1 − q_t) at `decided` bytes, 0 elsewhere (forced ends, pads).
    Reference: `hf_concept.reference.lslm.expected_loss_reference` (the expectation over every layout,
    whose autograd gradient this estimate averages to).
    """
    probs = torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))
    advantages = advantages.detach().to(probs.dtype)
    return torch.where(decided, advantages * (probs - probs.detach()), torch.zeros_like(probs)).sum()
