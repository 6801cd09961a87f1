"""Boundary math shared by the concept families: router probabilities, discrete decisions, the
straight-through factor and the ratio loss (their paper equations: docs/ARCHITECTURE.md, §3). Pure
functions; no parameters live here.

Legend: B batch, L tokens, K query/key width, D token width.

Contract (every function):
- Probabilities and decisions are (B, L) over tokens. `mask` (B, L) bool marks real tokens; `starts`
  (B, L) bool marks the first real token of each sequence or packed document
  (`packing.document_starts`).
- `b_t = 1` means token t opens a chunk. Every start has p = 1 and b = 1. Pads have p = 0 and b = 0 and
  never enter a statistic.
- Routers are causal: p_t reads tokens t − 1 and t only. They never compare across a document start,
  because p is forced to 1 there and the previous-token term is not used. "Previous" means the previous
  position, which is the previous real token of the same document under left padding, right padding
  and packing. For a cached continuation, the token before position 0 comes in as `past_keys` /
  `past_token_states` (without them it is a zero vector, so p = ½ there unless position 0 is a start).
- Probabilities are computed in float32 whatever the input dtype (float64 inputs stay float64).

Zero vectors in the cosine routers. A vector's norm is floored at the machine epsilon of the input dtype
(fp32 1.2e-7, bf16 7.8e-3, fp16 9.8e-4) before dividing. So cos(0, k) = 0 and p = ½ for a zero query or
key. Near-zero vectors move continuously towards that value. The gradient with respect to a vector is at
most of the order of 1/epsilon per unit of upstream gradient, which is finite in fp16 and bf16 too.

Ratio loss (ConceptMoE eq. 3–4, DLCM eq. 8–10). With target ratio R > 1, F the fraction of real tokens
that open a chunk (no gradient) and G their mean boundary probability (with gradient):

    L = R/(R−1)·((R−1)·F·G + (1−F)(1−G)) − 1 = slope(F)·G + intercept(F),
    slope(F) = R/(R−1)·(R·F − 1),   intercept(F) = R/(R−1)·(1 − F) − 1.

L is 0 at F = G = 1/R. Scopes:
- "sequence" (DLCM's "Normal" ablation): F, G and L for each sequence, then their mean over sequences
  weighted by tokens (the models weigh by label tokens, as the LM loss does, so accumulated
  micro-batches add up to one big batch's loss). With `starts`, every packed document is a sequence,
  so a packed row gives the same loss as its documents apart. This scope is local to the micro-batch.
- "batch" (ConceptMoE): F and G over every real token of the micro-batch.
- "global" (DLCM's Global Parser): F and G over every real token of the optimizer step, which covers all
  data-parallel ranks and all accumulated micro-batches.

Global scope: each rank returns its share. For a fixed F, L is linear in G. Let S be the sum of p over
this rank's micro-batch, n its token count, and N the step's token count over ranks and micro-batches.
The share is

    share = slope(F)·S/N + intercept(F)·n/N.

Summed over ranks and micro-batches, the shares give L(F, G_step), and their gradients sum to ∇L.
Only detached counts cross ranks, in one all_reduce of three numbers. The gradient stays local, which
is what DDP needs. The all_reduce is a collective, so every rank must call the loss for every
micro-batch. Two things follow:
- DDP averages gradients over ranks, but the shares need a sum. `Trainer` multiplies the loss by the
  world size when `average_tokens_across_devices` (its default) is set and `num_items_in_batch` is
  given, and that turns DDP's mean back into a sum. Outside `Trainer`, or without that setting,
  multiply the share by the world size yourself.
- Add the shares of accumulated micro-batches as they are. Do not divide them by the accumulation
  steps, and do not pass them through `scale_aux_loss`, which is for the "batch" and "sequence" scopes.

What is exact and what is an approximation (global scope):
- Across ranks, with one micro-batch per step, everything is exact. F, G and `value` equal the
  single-process values on the concatenated batch, and the gradients summed over ranks equal its
  gradient.
- Across accumulated micro-batches, the step's F is only known after the last micro-batch, but
  micro-batch i runs backward before that. With a planned step (`ratio_step.plan_ratio_step`, which
  `ConceptTrainer` runs) every micro-batch uses the step's F and N from the start: k micro-batches give
  the loss and the gradients of one batch k times as large. Without a plan, micro-batch i uses the
  running F of micro-batches 1..i (`RatioAccumulator`); the last micro-batch sees the step's exact F,
  and an earlier one's gradient uses slope(F_i) instead of slope(F_step).
- The denominator N is exact when the step's token count is given (`RatioAccumulator.reset(
  step_token_count=...)`): the weights on G then sum to exactly 1, as in one big batch. Without it,
  N is estimated as running count · k / i, with k = `num_micro_batches`. The estimate is exact when the
  micro-batches hold equal token counts, as with packed fixed-length rows. It is not exact otherwise,
  nor for a shortened last step of an epoch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .packing import document_ids
from .ratio_step import RatioAccumulator, all_reduce_sum, scope_counts

NOISE_KINDS = ("bernoulli", "gaussian", "none")
RATIO_LOSS_SCOPES = ("sequence", "batch", "global")


def _check_token_layout(probs_shape: torch.Size, starts: torch.Tensor | None, mask: torch.Tensor) -> None:
    starts_shape = probs_shape if starts is None else starts.shape
    if starts_shape != probs_shape or mask.shape != probs_shape:
        raise ValueError(
            f"starts and mask must have the tokens' shape {tuple(probs_shape)}, got starts "
            f"{tuple(starts_shape)} and mask {tuple(mask.shape)}"
        )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _force_starts_and_pads(probs: torch.Tensor, starts: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Starts open a chunk with certainty; pads never do. masked_fill also cuts the gradient there.
    return probs.masked_fill(starts, 1.0).masked_fill(~mask, 0.0)


def _previous_tokens(vectors: torch.Tensor, past_vectors: torch.Tensor | None) -> torch.Tensor:
    """(B, L, K) vectors shifted one position later; position 0 gets `past_vectors` (B, K) or zeros."""
    if past_vectors is None:
        first = torch.zeros_like(vectors[:, :1])
    else:
        first = past_vectors.to(vectors.dtype)[:, None]  # (B, 1, K)
    return torch.cat([first, vectors[:, :-1]], dim=1)  # (B, L, K)


def _unit_vectors(vectors: torch.Tensor, norm_floor: float) -> torch.Tensor:
    # Flooring the squared norm before rsqrt keeps zero vectors at zero with a finite gradient.
    squared_norms = vectors.square().sum(dim=-1, keepdim=True)  # (B, L, 1)
    return vectors * torch.rsqrt(squared_norms.clamp_min(norm_floor**2))


def cosine_boundary_probs(
    queries: torch.Tensor,
    keys: torch.Tensor,
    starts: torch.Tensor,
    mask: torch.Tensor,
    past_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cosine router (ConceptMoE eq. 2): p_t = ½(1 − cos(q_t, k_{t−1})), clamped to [0, 1].

    DLCM eq. 6 and ConceptMoE's appendix code pair them the other way round, cos(q_{t−1}, k_t). That
    is the same router with W_q and W_k swapped, so weights taken from such code swap their roles here.

    Args:
        queries, keys: (B, L, K), any float dtype; computed in float32 (zero vectors: module docstring).
        starts, mask: (B, L) bool.
        past_keys: (B, K) key of the token before position 0 (cached decoding), or None.

    Returns:
        (B, L) float32 probabilities; 1 at starts, 0 at pads.
    """
    if queries.shape != keys.shape or queries.dim() != 3:
        raise ValueError(
            f"queries and keys must both be (B, L, K), got {tuple(queries.shape)} and {tuple(keys.shape)}"
        )
    _check_token_layout(queries.shape[:2], starts, mask)
    dtype = _compute_dtype(torch.promote_types(queries.dtype, keys.dtype))
    norm_floor = max(torch.finfo(queries.dtype).eps, torch.finfo(keys.dtype).eps)
    query_units = _unit_vectors(queries.to(dtype), norm_floor)  # (B, L, K)
    previous_keys = _previous_tokens(keys.to(dtype), past_keys)  # (B, L, K)
    key_units = _unit_vectors(previous_keys, norm_floor)
    cosine = (query_units * key_units).sum(dim=-1)  # (B, L)
    probs = (0.5 * (1.0 - cosine)).clamp(0.0, 1.0)
    return _force_starts_and_pads(probs, starts, mask)


def rule_boundary_probs(
    token_states: torch.Tensor,
    starts: torch.Tensor,
    mask: torch.Tensor,
    past_token_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rule router (DLCM §8.1): p_t = ½(1 − cos(h_{t−1}, h_t)); no parameters.

    Args:
        token_states: (B, L, D).
        starts, mask: (B, L) bool.
        past_token_states: (B, D) state of the token before position 0 (cached decoding), or None.

    Returns:
        (B, L) float32 probabilities; 1 at starts, 0 at pads.
    """
    # The cosine is symmetric, so this is the cosine router with q = k = h.
    return cosine_boundary_probs(token_states, token_states, starts, mask, past_keys=past_token_states)


def rule_boundaries(probs: torch.Tensor, threshold: float) -> torch.Tensor:
    """Rule decision (DLCM §8.1): a boundary where p_t > threshold (strictly).

    `probs` must come from a router here: starts (p = 1) then open a chunk and pads (p = 0) do not,
    for any threshold in [0, 1).
    """
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"threshold must be in [0, 1) so that starts open a chunk, got {threshold}")
    return probs > threshold


def linear_boundary_probs(logits: torch.Tensor, starts: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Linear router (ConceptMoE ablation): p_t = σ(w·h_t), from (B, L) logits; float32 out."""
    _check_token_layout(logits.shape, starts, mask)
    probs = torch.sigmoid(logits.to(_compute_dtype(logits.dtype)))
    return _force_starts_and_pads(probs, starts, mask)


def sample_gumbel_noise(
    shape: tuple[int, ...],
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent standard Gumbel noises g′, g″ of `shape`, drawn from `generator`."""
    uniforms = torch.rand((2, *shape), generator=generator, device=device, dtype=dtype)
    # torch.rand gives [0, 1): lifting 0 to the smallest normal keeps both logarithms finite.
    uniforms = uniforms.clamp_min(torch.finfo(dtype).tiny)
    noise = -torch.log(-torch.log(uniforms))
    return noise[0], noise[1]


def gumbel_sigmoid(
    logits: torch.Tensor, gumbel_noise_a: torch.Tensor, gumbel_noise_b: torch.Tensor
) -> torch.Tensor:
    """Gumbel-sigmoid sample (LSLM eq. 5): σ(p̂ + g′ − g″), float32 out.

    g′ − g″ is a standard logistic variable, so P(sample ≥ ½) = σ(p̂): thresholding at ½ (LSLM eq. 6)
    draws a Bernoulli(σ(p̂)) decision whose straight-through gradient flows into `logits`.
    """
    if gumbel_noise_a.shape != logits.shape or gumbel_noise_b.shape != logits.shape:
        raise ValueError(
            f"gumbel noises must have the logits' shape {tuple(logits.shape)}, got "
            f"{tuple(gumbel_noise_a.shape)} and {tuple(gumbel_noise_b.shape)}"
        )
    logits = logits.to(_compute_dtype(logits.dtype))
    return torch.sigmoid(logits + gumbel_noise_a.to(logits.dtype) - gumbel_noise_b.to(logits.dtype))


def sharpen_probs(probs: torch.Tensor, tau: float) -> torch.Tensor:
    """ConceptMoE eq. 5: p^{1/τ} where p ≥ ½, 1 − (1 − p)^{1/τ} where p < ½.

    With τ > 1 this pushes probabilities away from ½, so that confident decisions are rarely flipped
    by the Bernoulli draw and uncertain ones sometimes are.
    """
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    exponent = 1.0 / tau
    # Each branch sees only its own half-range, so the unused branch has no infinite derivative
    # (p^{1/τ} at p = 0) that torch.where would turn into NaN.
    upper = probs.clamp_min(0.5).pow(exponent)
    lower = 1.0 - (1.0 - probs.clamp_max(0.5)).pow(exponent)
    return torch.where(probs >= 0.5, upper, lower)


def _check_decision_args(noise: str, threshold: float, tau: float, sigma: float) -> None:
    if noise not in NOISE_KINDS:
        raise ValueError(f"noise must be one of {NOISE_KINDS}, got {noise!r}")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    if not sigma >= 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")


def boundary_decisions_from_noise(
    probs: torch.Tensor,
    starts: torch.Tensor,
    mask: torch.Tensor,
    random_values: torch.Tensor | None,
    *,
    noise: str,
    training: bool,
    threshold: float = 0.5,
    tau: float = 6.0,
    sigma: float = 0.1,
) -> torch.Tensor:
    """`boundary_decisions` with its random part given: uniforms in [0, 1) for "bernoulli", standard
    normals for "gaussian" (both (B, L)); None when the decision is deterministic."""
    _check_decision_args(noise, threshold, tau, sigma)
    _check_token_layout(probs.shape, starts, mask)
    probs = probs.detach()
    if not training or noise == "none":
        chosen = probs >= threshold
    else:
        if random_values is None or random_values.shape != probs.shape:
            shape = None if random_values is None else tuple(random_values.shape)
            raise ValueError(
                f"random_values must be (B, L) = {tuple(probs.shape)} for {noise!r}, got {shape}"
            )
        if noise == "bernoulli":
            # u < p' with u uniform in [0, 1) is a Bernoulli(p') draw.
            chosen = random_values < sharpen_probs(probs, tau)
        else:
            chosen = probs + sigma * random_values >= threshold
    return (chosen | starts) & mask


def expected_boundaries(
    probs: torch.Tensor,
    starts: torch.Tensor,
    mask: torch.Tensor,
    *,
    noise: str = "bernoulli",
    threshold: float = 0.5,
    tau: float = 6.0,
    sigma: float = 0.1,
) -> torch.Tensor:
    """(B, L) float: the probability that training's `boundary_decisions` opens a chunk at each token —
    sharpen_probs(p, τ) for "bernoulli", P(p + σε ≥ threshold) = Φ((p − threshold) / σ) for "gaussian",
    the thresholded decision for "none"; 1 at starts, 0 at pads. Its sum is the expected number of
    sampled boundaries, so real tokens / that sum is the training-time compression without drawing
    noise. A metric: no gradient.
    """
    _check_decision_args(noise, threshold, tau, sigma)
    probs = probs.detach().float()
    if noise == "bernoulli":
        expected = sharpen_probs(probs, tau)
    elif noise == "gaussian" and sigma > 0:
        expected = 0.5 * torch.erfc((threshold - probs) / (sigma * 2**0.5))
    else:
        expected = (probs >= threshold).float()
    return torch.where(starts, 1.0, expected).masked_fill(~mask, 0.0)


def boundary_decisions(
    probs: torch.Tensor,
    starts: torch.Tensor,
    mask: torch.Tensor,
    *,
    noise: str = "bernoulli",
    threshold: float = 0.5,
    tau: float = 6.0,
    sigma: float = 0.1,
    training: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Hard boundaries b (B, L) bool from probabilities (the discrete decision).

    Inference (`training=False`) or `noise="none"`: b = p ≥ threshold. Training with "bernoulli":
    b ~ Bernoulli(sharpen_probs(p, tau)) (ConceptMoE eq. 5–6). Training with "gaussian":
    b = p + N(0, σ²) ≥ threshold. Starts are always True and pads always False. The random values are
    drawn from `generator` and passed to `boundary_decisions_from_noise`.
    """
    _check_decision_args(noise, threshold, tau, sigma)
    random_values = None
    if training and noise == "bernoulli":
        random_values = torch.rand(probs.shape, generator=generator, device=probs.device)
    elif training and noise == "gaussian":
        random_values = torch.randn(probs.shape, generator=generator, device=probs.device)
    return boundary_decisions_from_noise(
        probs,
        starts,
        mask,
        random_values,
        noise=noise,
        training=training,
        threshold=threshold,
        tau=tau,
        sigma=sigma,
    )


class _OnesWithIdentityGradient(torch.autograd.Function):
    """Forward: exactly 1. Backward: the incoming gradient, unchanged."""

    @staticmethod
    def forward(ctx, chosen_probs: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(chosen_probs)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output


def straight_through(probs: torch.Tensor, boundaries: torch.Tensor) -> torch.Tensor:
    """Straight-through factor (B, L) (ConceptMoE appendix B): value exactly 1.0; its gradient goes to
    the chosen probability, p_t where b_t = 1 and 1 − p_t where b_t = 0."""
    chosen_probs = torch.where(boundaries, probs, 1.0 - probs)
    return _OnesWithIdentityGradient.apply(chosen_probs)


def decision_confidence(relaxed: torch.Tensor, ends: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
    """Straight-through confidence of every boundary decision (the H-Net confidence path, applied to a
    relaxed sample such as LSLM's Gumbel-sigmoid ẑ_t), (B, T) float32.

    Forward value: exactly 1.0 everywhere, so whatever it multiplies is unchanged.
    Backward rule: ∂c_t/∂ẑ_t = +1 where the byte ended its segment (z_t = 1), −1 where it did not
    (z_t = 0), at `free` positions; 0 elsewhere (forced ends, pads: no decision was taken there).
    Multiplying a byte's contribution (its pooled state, its decoder slot) by c_t gives the loss a
    gradient on ẑ_t at every byte: making the byte count more pushes its decision — to close or to go
    on — to be taken more surely, making it count less pushes the other way.
    Reference: `hf_concept.reference.routing.decision_confidence_reference`.
    """
    chosen = torch.where(ends, relaxed, 1.0 - relaxed)
    chosen = torch.where(free, chosen, chosen.detach())
    return torch.where(free, _OnesWithIdentityGradient.apply(chosen), torch.ones_like(chosen))


def bernoulli_kl_from_logits(logits: torch.Tensor, prior_mean: float) -> torch.Tensor:
    """KL(Bernoulli(σ(l)) ‖ Bernoulli(p)) per element, computed from log-probabilities.

    Forward value: q·(log q − log p) + (1 − q)·(log(1 − q) − log(1 − p)) with q = σ(l), log q =
    logsigmoid(l) and log(1 − q) = logsigmoid(−l), so nothing is clamped: at l = ±30 the value is finite
    and the gradient, q(1 − q)·(l − logit p), is small but not zero.
    Backward rule: plain autograd through logsigmoid and exp (float32 at least).
    Reference: `hf_concept.reference.routing.bernoulli_kl_reference`.
    """
    if not 0 < prior_mean < 1:
        raise ValueError(f"prior_mean={prior_mean!r} must be in (0, 1)")
    logits = logits.to(_compute_dtype(logits.dtype))
    log_q, log_not_q = F.logsigmoid(logits), F.logsigmoid(-logits)
    return torch.exp(log_q) * (log_q - math.log(prior_mean)) + torch.exp(log_not_q) * (
        log_not_q - math.log1p(-prior_mean)
    )


def binomial_prior_nll(counts: torch.Tensor, totals: torch.Tensor, prior_mean: float) -> torch.Tensor:
    """−log Binomial(k; n, p) per row: DTP's boundary prior (Nawrot et al. 2023, §3.2), the count form
    of "about p·n boundaries in n bytes" that does not pull every single q_t toward p as the KL does.

    Forward value: −[lgamma(n+1) − lgamma(k+1) − lgamma(n−k+1) + k log p + (n−k) log(1−p)] at the
    given (hard) counts k = `counts` out of n = `totals`.
    Backward rule: ∂/∂k = ψ(k+1) − ψ(n−k+1) − log(p / (1−p)) (ψ: digamma), to whatever `counts` was
    built from; a straight-through count Σ(z_t + ẑ_t − sg(ẑ_t)) passes it to every sampled ẑ_t.
    Reference: `torch.distributions.Binomial(n, p).log_prob(k)` for the value.
    """
    if not 0 < prior_mean < 1:
        raise ValueError(f"prior_mean={prior_mean!r} must be in (0, 1)")
    counts = counts.to(_compute_dtype(counts.dtype))
    totals = totals.to(counts.dtype)
    log_choose = torch.lgamma(totals + 1) - torch.lgamma(counts + 1) - torch.lgamma(totals - counts + 1)
    log_prob = log_choose + counts * math.log(prior_mean) + (totals - counts) * math.log1p(-prior_mean)
    return -log_prob


def _check_target_ratio(target_ratio: float) -> float:
    if not target_ratio > 1:
        raise ValueError(f"target_ratio must be > 1 (tokens per concept), got {target_ratio}")
    return float(target_ratio)


def ratio_loss_from_fractions(
    boundary_fraction: torch.Tensor, mean_prob: torch.Tensor, target_ratio: float
) -> torch.Tensor:
    """L = R/(R−1)·((R−1)·F·G + (1−F)(1−G)) − 1 (DLCM eq. 10), elementwise."""
    ratio = _check_target_ratio(target_ratio)
    F, G = boundary_fraction, mean_prob
    return ratio / (ratio - 1) * ((ratio - 1) * F * G + (1 - F) * (1 - G)) - 1


def ratio_loss_coefficients(
    boundary_fraction: torch.Tensor, target_ratio: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slope, intercept) with L = slope·G + intercept for a fixed F (module docstring)."""
    ratio = _check_target_ratio(target_ratio)
    scale = ratio / (ratio - 1)
    return scale * (ratio * boundary_fraction - 1), scale * (1 - boundary_fraction) - 1


@dataclass
class RatioLossOutput:
    """Result of `ratio_loss`.

    Attributes:
        loss: the term to add to the training loss, with gradient (the rank's and micro-batch's share
            for the "global" scope).
        value: the loss over the whole scope so far, detached, for logging.
        boundary_fraction: F over the scope (mean over sequences for "sequence"), detached.
        mean_prob: G over the scope (mean over sequences for "sequence"), detached.
        token_count: real tokens in the scope (int64).
    """

    loss: torch.Tensor
    value: torch.Tensor
    boundary_fraction: torch.Tensor
    mean_prob: torch.Tensor
    token_count: torch.Tensor


def _pooled_ratio_loss(
    probs: torch.Tensor,
    boundaries: torch.Tensor,
    mask: torch.Tensor,
    target_ratio: float,
    across_ranks: bool,
    accumulator: RatioAccumulator | None,
    process_group,
) -> RatioLossOutput:
    """The "batch" scope, and the "global" scope when `across_ranks` (shares: module docstring)."""
    prob_sum = torch.where(mask, probs, 0.0).sum()
    local_tokens = mask.sum()
    counts = scope_counts(prob_sum, boundaries, mask)
    if across_ranks:
        counts = all_reduce_sum(counts, process_group)
    denominator = counts[2]
    if accumulator is not None:
        counts, denominator = accumulator.update(counts)
    boundary_count, total_prob, token_count = counts.unbind()
    boundary_fraction = boundary_count / token_count.clamp_min(1)
    mean_prob = total_prob / token_count.clamp_min(1)
    slope, intercept = ratio_loss_coefficients(boundary_fraction, target_ratio)
    denominator = denominator.clamp_min(1).to(probs.dtype)
    share = (slope.to(probs.dtype) * prob_sum + intercept.to(probs.dtype) * local_tokens) / denominator
    value = ratio_loss_from_fractions(boundary_fraction, mean_prob, target_ratio)
    # An empty scope has no loss to report (the formula would give 1/(R−1)).
    value = torch.where(token_count > 0, value, 0.0)
    return RatioLossOutput(
        loss=share,
        value=value.to(probs.dtype),
        boundary_fraction=boundary_fraction.to(probs.dtype),
        mean_prob=mean_prob.to(probs.dtype),
        token_count=token_count.round().long(),
    )


def _sequence_ratio_loss(
    probs: torch.Tensor,
    boundaries: torch.Tensor,
    mask: torch.Tensor,
    starts: torch.Tensor | None,
    target_ratio: float,
    token_weights: torch.Tensor | None,
) -> RatioLossOutput:
    """The "sequence" scope: one loss per sequence (per document with `starts`), then their mean weighted
    by each sequence's summed `token_weights` (default: its real tokens)."""
    batch_size, length = mask.shape
    documents = torch.zeros_like(mask, dtype=torch.long) if starts is None else document_ids(mask, starts)
    rows = torch.arange(batch_size, device=mask.device)[:, None]  # (B, 1)
    # One slot per (row, document); pads add zeros to slot (row, 0).
    slots = (rows * length + documents.clamp_min(0)).flatten()  # (B·L,)
    weights = mask.flatten().to(probs.dtype)

    def per_slot(values: torch.Tensor) -> torch.Tensor:
        return probs.new_zeros(batch_size * length).index_add(0, slots, values.flatten() * weights)

    token_counts = per_slot(torch.ones_like(probs))
    boundary_fractions = per_slot(boundaries.to(probs.dtype)) / token_counts.clamp_min(1)
    mean_probs = per_slot(torch.where(mask, probs, 0.0)) / token_counts.clamp_min(1)
    losses = ratio_loss_from_fractions(boundary_fractions, mean_probs, target_ratio)
    # Weighted by tokens, a micro-batch's mean times its share of the step's tokens is its sequences'
    # part of the step's mean: accumulated micro-batches add up to one big batch's figure.
    sequence_weights = token_counts if token_weights is None else per_slot(token_weights.to(probs.dtype))
    sequence_weights = torch.where(token_counts > 0, sequence_weights, 0.0)
    total_weight = sequence_weights.sum()

    def weighted_mean(values: torch.Tensor) -> torch.Tensor:
        return (sequence_weights * values).sum() / total_weight.clamp_min(1e-12)

    loss = weighted_mean(losses)
    return RatioLossOutput(
        loss=loss,
        value=loss.detach(),
        boundary_fraction=weighted_mean(boundary_fractions),
        mean_prob=weighted_mean(mean_probs.detach()),
        token_count=mask.sum(),
    )


def ratio_loss(
    probs: torch.Tensor,
    boundaries: torch.Tensor,
    mask: torch.Tensor,
    *,
    target_ratio: float,
    scope: str = "batch",
    starts: torch.Tensor | None = None,
    accumulator: RatioAccumulator | None = None,
    process_group=None,
    token_weights: torch.Tensor | None = None,
) -> RatioLossOutput:
    """Ratio loss that steers the share of chunk-opening tokens towards 1/R (module docstring).

    Args:
        probs: (B, L) boundary probabilities, with gradient.
        boundaries: (B, L) bool decisions that were actually used (F has no gradient).
        mask: (B, L) bool real tokens.
        target_ratio: R > 1, tokens per concept.
        scope: "sequence", "batch" or "global".
        starts: (B, L) bool; for "sequence", makes every packed document its own sequence.
        accumulator: "global" only: running counts over the micro-batches of one optimizer step.
        process_group: "global" only: the data-parallel group (default: the whole world, when
            torch.distributed is initialised).
        token_weights: "sequence" only: (B, L) weight of each token; a sequence weighs the sum over its
            real tokens in the mean over sequences (default: its real-token count). The models pass
            their label tokens, as the LM loss counts them.
    """
    target_ratio = _check_target_ratio(target_ratio)
    if scope not in RATIO_LOSS_SCOPES:
        raise ValueError(f"scope must be one of {RATIO_LOSS_SCOPES}, got {scope!r}")
    if boundaries.shape != probs.shape:
        raise ValueError(
            f"boundaries must have the probs' shape {tuple(probs.shape)}, got {boundaries.shape}"
        )
    _check_token_layout(probs.shape, starts, mask)
    if scope != "global" and (accumulator is not None or process_group is not None):
        raise ValueError(f"accumulator and process_group need scope='global', got scope={scope!r}")
    if token_weights is not None and (scope != "sequence" or token_weights.shape != probs.shape):
        raise ValueError(
            f"token_weights need scope='sequence' and the probs' shape {tuple(probs.shape)}, got "
            f"scope={scope!r} and shape {tuple(token_weights.shape)}"
        )
    boundaries = boundaries.bool()
    if scope == "sequence":
        return _sequence_ratio_loss(probs, boundaries, mask, starts, target_ratio, token_weights)
    across_ranks = scope == "global"
    return _pooled_ratio_loss(probs, boundaries, mask, target_ratio, across_ranks, accumulator, process_group)


def scale_aux_loss(
    aux_loss: torch.Tensor,
    local_items: int | torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None,
) -> torch.Tensor:
    """Weight a per-micro-batch mean auxiliary loss like `Trainer` weights the LM loss.

    `Trainer` divides the summed LM loss of each micro-batch by `num_items_in_batch` (label tokens over
    all micro-batches of the step and all ranks) and does not divide by the accumulation steps. A mean
    auxiliary term added as it is would count once per micro-batch (transformers #48690). Multiplying
    it by `local_items / num_items_in_batch` turns the sum over micro-batches (and over ranks, after
    Trainer's ×world-size and DDP's mean) into the token-weighted mean. With `num_items_in_batch=None`,
    `Trainer` averages the micro-batches itself, and the term is returned unchanged.

    For the "batch" and "sequence" scopes. A "global" share is already weighted; do not pass it here.
    """
    if num_items_in_batch is None:
        return aux_loss
    if isinstance(num_items_in_batch, int | float) and num_items_in_batch <= 0:
        raise ValueError(f"num_items_in_batch must be > 0, got {num_items_in_batch}")
    return aux_loss * local_items / num_items_in_batch
