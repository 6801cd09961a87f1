"""Plain loop versions of `hf_concept.modeling.routing`, for tests and benchmarks.

Legend: B batch, L tokens, K query/key width, D token width.

Each function walks rows and positions with Python loops over torch scalars. It follows the formulas as
the papers write them: ConceptMoE eq. 2–6, DLCM eq. 8–10, LSLM eq. 5. Gradients flow through them, so
tests can compare both outputs and gradients. Conventions are the fast module's: p = 1 and b = 1 at
starts, p = 0 and b = 0 at pads, and vector norms floored at the input dtype's machine epsilon.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _scalar(value: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype)


def _cosine(query: torch.Tensor, key: torch.Tensor, norm_floor: float) -> torch.Tensor:
    query_norm = torch.clamp(torch.linalg.vector_norm(query), min=norm_floor)
    key_norm = torch.clamp(torch.linalg.vector_norm(key), min=norm_floor)
    return torch.dot(query, key) / (query_norm * key_norm)


def cosine_boundary_probs_reference(
    queries: torch.Tensor,
    keys: torch.Tensor,
    starts: torch.Tensor,
    mask: torch.Tensor,
    past_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """p[b, t] = ½(1 − cos(q[b, t], k[b, t − 1])) clamped to [0, 1]; 1 at starts, 0 at pads."""
    dtype = torch.promote_types(torch.promote_types(queries.dtype, keys.dtype), torch.float32)
    norm_floor = max(torch.finfo(queries.dtype).eps, torch.finfo(keys.dtype).eps)
    batch_size, length, _ = queries.shape
    rows = []
    for row in range(batch_size):
        row_probs = []
        for position in range(length):
            if not mask[row, position]:
                row_probs.append(_scalar(0.0, dtype))
            elif starts[row, position]:
                row_probs.append(_scalar(1.0, dtype))
            else:
                if position > 0:
                    previous_key = keys[row, position - 1]
                elif past_keys is not None:
                    previous_key = past_keys[row]
                else:
                    previous_key = torch.zeros_like(keys[row, 0])
                cosine = _cosine(queries[row, position].to(dtype), previous_key.to(dtype), norm_floor)
                row_probs.append(torch.clamp(0.5 * (1 - cosine), 0.0, 1.0))
        rows.append(torch.stack(row_probs))
    return torch.stack(rows)


def rule_boundary_probs_reference(
    token_states: torch.Tensor,
    starts: torch.Tensor,
    mask: torch.Tensor,
    past_token_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """p[b, t] = ½(1 − cos(h[b, t − 1], h[b, t])); 1 at starts, 0 at pads."""
    dtype = torch.promote_types(token_states.dtype, torch.float32)
    norm_floor = torch.finfo(token_states.dtype).eps
    batch_size, length, _ = token_states.shape
    probs = torch.zeros(batch_size, length, dtype=dtype)
    for row in range(batch_size):
        for position in range(length):
            if not mask[row, position]:
                continue
            if starts[row, position]:
                probs[row, position] = 1.0
                continue
            if position > 0:
                previous_state = token_states[row, position - 1]
            elif past_token_states is not None:
                previous_state = past_token_states[row]
            else:
                previous_state = torch.zeros_like(token_states[row, 0])
            cosine = _cosine(previous_state.to(dtype), token_states[row, position].to(dtype), norm_floor)
            probs[row, position] = torch.clamp(0.5 * (1 - cosine), 0.0, 1.0)
    return probs


def linear_boundary_probs_reference(
    logits: torch.Tensor, starts: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """p[b, t] = 1 / (1 + exp(−logit)); 1 at starts, 0 at pads."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    probs = torch.zeros(logits.shape, dtype=dtype)
    for row in range(logits.shape[0]):
        for position in range(logits.shape[1]):
            if not mask[row, position]:
                continue
            if starts[row, position]:
                probs[row, position] = 1.0
            else:
                probs[row, position] = 1 / (1 + torch.exp(-logits[row, position].to(dtype)))
    return probs


def gumbel_sigmoid_reference(
    logits: torch.Tensor, gumbel_noise_a: torch.Tensor, gumbel_noise_b: torch.Tensor
) -> torch.Tensor:
    """Each element: 1 / (1 + exp(−(p̂ + g′ − g″)))."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    flat_logits, flat_a, flat_b = logits.reshape(-1), gumbel_noise_a.reshape(-1), gumbel_noise_b.reshape(-1)
    samples = []
    for index in range(flat_logits.numel()):
        argument = flat_logits[index].to(dtype) + flat_a[index].to(dtype) - flat_b[index].to(dtype)
        samples.append(1 / (1 + torch.exp(-argument)))
    return torch.stack(samples).reshape(logits.shape)


def sharpen_probs_reference(probs: torch.Tensor, tau: float) -> torch.Tensor:
    """Each element: p^{1/τ} if p ≥ ½ else 1 − (1 − p)^{1/τ} (ConceptMoE eq. 5)."""
    flat = probs.reshape(-1)
    sharpened = []
    for index in range(flat.numel()):
        prob = flat[index]
        sharpened.append(prob ** (1 / tau) if prob >= 0.5 else 1 - (1 - prob) ** (1 / tau))
    return torch.stack(sharpened).reshape(probs.shape)


def boundary_decisions_reference(
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
    """Decisions with given noise: uniforms for "bernoulli", standard normals for "gaussian"."""
    decisions = torch.zeros(probs.shape, dtype=torch.bool)
    for row in range(probs.shape[0]):
        for position in range(probs.shape[1]):
            prob = float(probs[row, position])
            if not mask[row, position]:
                decision = False
            elif starts[row, position]:
                decision = True
            elif not training or noise == "none":
                decision = prob >= threshold
            elif noise == "bernoulli":
                sharpened = prob ** (1 / tau) if prob >= 0.5 else 1 - (1 - prob) ** (1 / tau)
                decision = float(random_values[row, position]) < sharpened
            else:
                decision = prob + sigma * float(random_values[row, position]) >= threshold
            decisions[row, position] = decision
    return decisions


def straight_through_reference(probs: torch.Tensor, boundaries: torch.Tensor) -> torch.Tensor:
    """c + (1 − c).detach() with c = p where b = 1, else 1 − p (ConceptMoE appendix B)."""
    chosen_probs = torch.where(boundaries, probs, 1 - probs)
    return chosen_probs + (1 - chosen_probs).detach()


def decision_confidence_reference(
    relaxed: torch.Tensor, ends: torch.Tensor, free: torch.Tensor
) -> torch.Tensor:
    """1 + c − c.detach() with c = ẑ where z = 1, else 1 − ẑ, at free positions; 1 (constant) elsewhere."""
    chosen = torch.where(ends, relaxed, 1 - relaxed)
    return torch.where(free, 1 + chosen - chosen.detach(), torch.ones_like(chosen))


def bernoulli_kl_reference(logits: torch.Tensor, prior_mean: float) -> torch.Tensor:
    """The Bernoulli KL written with probabilities, in float64: q log(q/p) + (1−q) log((1−q)/(1−p))."""
    q = torch.sigmoid(logits.double())
    p = torch.tensor(prior_mean, dtype=torch.float64)
    return q * torch.log(q / p) + (1 - q) * torch.log((1 - q) / (1 - p))


def sequences_reference(
    probs: torch.Tensor,
    boundaries: torch.Tensor,
    mask: torch.Tensor,
    starts: torch.Tensor | None = None,
) -> list[tuple[torch.Tensor, list[bool]]]:
    """The real tokens of each row (each document, with `starts`): (1-D probs, boundary flags) pairs."""
    sequences: list[tuple[list[torch.Tensor], list[bool]]] = []
    for row in range(probs.shape[0]):
        current = None
        for position in range(probs.shape[1]):
            if not mask[row, position]:
                continue
            if current is None or (starts is not None and starts[row, position]):
                current = ([], [])
                sequences.append(current)
            current[0].append(probs[row, position])
            current[1].append(bool(boundaries[row, position]))
    return [(torch.stack(row_probs), flags) for row_probs, flags in sequences]


def ratio_loss_reference(
    sequences: list[tuple[torch.Tensor, list[bool]]],
    target_ratio: float,
    scope: str,
    weights: list[float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, F, G) over explicit sequences of real tokens.

    "sequence": the mean over sequences of each sequence's loss (and of its F and G), weighted by
    `weights` (default: each sequence's token count). "batch" and
    "global": F and G over every token of every sequence; for "global", pass the sequences of every
    rank and every micro-batch of the step.
    """
    ratio = float(target_ratio)
    scale = ratio / (ratio - 1)

    def loss_of(boundary_fraction, mean_prob):
        boundary_term = (ratio - 1) * boundary_fraction * mean_prob
        return scale * (boundary_term + (1 - boundary_fraction) * (1 - mean_prob)) - 1

    if scope == "sequence":
        if weights is None:
            weights = [float(len(flags)) for _, flags in sequences]
        losses, fractions, means = [], [], []
        for probs, flags in sequences:
            fractions.append(sum(1.0 for flag in flags if flag) / len(flags))
            means.append(sum(probs[index] for index in range(len(flags))) / len(flags))
            losses.append(loss_of(fractions[-1], means[-1]))
        total = sum(weights)

        def weighted(values: list) -> Any:
            return sum(weight * value for weight, value in zip(weights, values, strict=True)) / total

        return (
            weighted(losses),
            torch.tensor(weighted(fractions), dtype=torch.float64),
            weighted(means).detach(),
        )
    token_count = sum(len(flags) for _, flags in sequences)
    boundary_count = sum(1.0 for _, flags in sequences for flag in flags if flag)
    prob_total = sum(probs[index] for probs, flags in sequences for index in range(len(flags)))
    boundary_fraction, mean_prob = boundary_count / token_count, prob_total / token_count
    return (
        loss_of(boundary_fraction, mean_prob),
        torch.tensor(boundary_fraction, dtype=torch.float64),
        mean_prob.detach(),
    )


def straight_through_ends_reference(
    relaxed: torch.Tensor, ends: torch.Tensor, free: torch.Tensor
) -> torch.Tensor:
    """z + ẑ − sg(ẑ) at free positions, the constant z elsewhere (float64)."""
    relaxed = relaxed.double()
    return torch.where(free, ends.double() + relaxed - relaxed.detach(), ends.double())


def pooling_matrix_reference(
    straight_ends: torch.Tensor, mask: torch.Tensor, num_segments: int
) -> torch.Tensor:
    """Dynamic pooling's (B, T, M) matrix, entry by entry (LSLM Figure 3): V[t, m] = m − ĉ_t with
    ĉ_t = Σ_{i<t} e_i over real bytes; B[t, m] = 1 − V[t, m] where V[t, m] is 0, else 0; pads 0."""
    batch, length = mask.shape
    rows = []
    for row in range(batch):
        entries = []
        count = straight_ends.new_zeros(())
        for position in range(length):
            column = []
            for segment in range(num_segments):
                value = segment - count
                keep = bool(mask[row, position]) and float(value.detach()) == 0.0
                column.append(1 - value if keep else straight_ends.new_zeros(()))
            entries.append(torch.stack(column))
            if mask[row, position]:
                count = count + straight_ends[row, position]
        rows.append(torch.stack(entries))
    return torch.stack(rows)


def beta_binomial_reference(count: int, total: int, alpha: float, beta: float, grid: int = 200_001) -> float:
    """log P(k) of the Binomial(n, π) integrated over π ~ Beta(a, b) on a midpoint grid (float64)."""
    pi = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    log_density = (alpha - 1) * torch.log(pi) + (beta - 1) * torch.log1p(-pi)
    log_density -= math.lgamma(alpha) + math.lgamma(beta) - math.lgamma(alpha + beta)
    log_binomial = count * torch.log(pi) + (total - count) * torch.log1p(-pi)
    log_binomial += math.lgamma(total + 1) - math.lgamma(count + 1) - math.lgamma(total - count + 1)
    return float(torch.logsumexp(log_density + log_binomial, dim=0) - math.log(grid))


def straight_through_target_losses_reference(
    straight_ends: torch.Tensor, end_losses: torch.Tensor, continue_losses: torch.Tensor
) -> torch.Tensor:
    """Element by element: ℓ_end if z = 1 else ℓ_continue, plus (z − sg(z)) · (ℓ_end − ℓ_continue) for
    the decision's gradient, plus the chosen loss's own gradient."""
    values = []
    flat = (straight_ends.reshape(-1), end_losses.reshape(-1), continue_losses.reshape(-1))
    for z, end, go_on in zip(*flat, strict=True):
        chosen = end if float(z.detach()) == 1.0 else go_on
        values.append(chosen + (z - z.detach()) * (end - go_on).detach())
    return torch.stack(values).reshape(straight_ends.shape)
