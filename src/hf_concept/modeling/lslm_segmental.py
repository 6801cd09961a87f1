"""The "segmental" boundary estimator of LSLM (`LSLMConfig.boundary_estimator`; not the paper's): the
router's gradient of the expected objective E_{Z~q}[L(Z)], from every free end decision flipped against
the rest of the training sample.

Legend: B batch, T bytes (view columns), R layouts run together, S decoder slots, V vocabulary. `model`
is an `LSLMForCausalLM` (typed as a module: modeling_lslm imports this file).

Why not a dynamic programme. A segmental LM sums over the layouts exactly with the forward algorithm,
α_t = logsumexp_s [α_s + log p(x_{s+1..t} | x_{≤s}) + the boundary log-probabilities], because there a
segment's likelihood depends on where it starts and ends only. LSLM's decoder writes segment m + 1
reading s'_{0:m}, the segment encoder's states of every earlier segment (and the latest one as its
input), so a segment's likelihood depends on the whole layout before it: the exact sum has 2^(n−1) terms
that share no sub-sums.

What it computes. q(Z) = Π_t q_t^{z_t} (1 − q_t)^{1 − z_t} factorises over the bytes (q_t reads the bytes,
never Z), so for the objective L(Z) (the decoder's cross-entropy over the scored targets, plus β · the
count prior for "binomial" and "beta_binomial"; the per-byte KL priors are functions of q and keep their
exact gradient in `lslm_loss`)

    ∂E_q[L] / ∂p̂_t = q_t (1 − q_t) · E_{Z_−t ~ q}[A_t],   A_t = L(Z_−t, z_t = 1) − L(Z_−t, z_t = 0).

The training sample gives Z_−t for every t at once: A_t is computed exactly by running the segment encoder
and decoder again on the sample with z_t flipped (the token states, which do not depend on Z, are
reused), and `lslm_estimators.local_expectation_surrogate` hands q_t (1 − q_t) A_t to the router. Each
byte's estimate is unbiased; the rest of the model gets the sampled layout's own gradient (the pooling
is the hard one, no straight-through path), so the expectation of the whole gradient over the sample is
∇E_q[L] exactly (tests/test_lslm_segmental.py enumerates every layout of short rows to check it).

Cost. Per row of n free bytes, n + 1 more passes of the segment encoder, the decoder and the LM head
(forward only, no graph; the token encoder runs once), in chunks of `FLIP_CHUNK` layouts: about n times
the forward cost of those stages. `LSLMConfig.segmental_flips` = k > 0 flips k of them per row, drawn
uniformly, and weights their advantages by n / k (`chosen_flips`): still unbiased for every byte, at
k + 1 passes per row. Nothing runs outside training, without labels, without a gradient to
take, or when the router decides nothing (`boundary_source` other than "router").
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from .lslm_estimators import local_expectation_surrogate
from .lslm_layout import ByteView, Segmentation, _previous
from .lslm_loss import count_prior_nll, label_targets, scored_targets, target_losses
from .lslm_outputs import LSLMPass
from .pooling import chunk_index

# Layouts per batched pass: bounds the (R, S, V) logits and (R, S, S) masks held at once.
FLIP_CHUNK = 256
COUNT_PRIORS = ("binomial", "beta_binomial")
Record = TypeVar("Record", ByteView, Segmentation)


def segmental_surrogate(
    model: nn.Module, layout: LSLMPass, labels: torch.Tensor, predicted: torch.Tensor
) -> torch.Tensor:
    """A scalar of value 0 whose gradient to the router's logits is q_t (1 − q_t) A_t / `predicted` at every
    free byte (module docstring): added to the loss, which is the step's sum over `predicted` bytes."""
    segmentation, view = layout.segmentation, layout.view
    free = view.mask & ~segmentation.forced
    logits = segmentation.logits
    if model.config.boundary_source != "router" or not logits.requires_grad or not bool(free.any()):
        return logits.new_zeros(())
    chosen, weights = chosen_flips(free, model.config.segmental_flips)
    advantages = flip_advantages(model, layout, labels, free, chosen) * weights[:, None]
    return local_expectation_surrogate(logits, advantages / predicted, chosen)


def chosen_flips(free: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """((B, T) bool, (B,) float) the free bytes whose decisions are flipped, and each row's weight n / k
    (n free bytes, k flipped): every free byte (weight 1) when `budget` is 0 or a row has no more free
    bytes than it; else `budget` of them drawn uniformly without replacement (torch's generator). Each
    free byte is flipped with probability k / n, so weight · A_t at the flipped bytes (0 elsewhere) is
    unbiased for every free byte's term, at k + 1 instead of n + 1 passes per row."""
    free_counts = free.sum(dim=1)
    if budget == 0 or int(free_counts.max()) <= budget:
        return free, torch.ones(free.shape[0], device=free.device)
    keys = torch.rand(free.shape, device=free.device).masked_fill(~free, 2.0)  # pads and forced last
    chosen = free & (keys.argsort(dim=1).argsort(dim=1) < budget)
    return chosen, free_counts / chosen.sum(dim=1).clamp(min=1)


@torch.no_grad()
def flip_advantages(
    model: nn.Module, layout: LSLMPass, labels: torch.Tensor, free: torch.Tensor, flips: torch.Tensor
) -> torch.Tensor:
    """(B, T) A_t = L(z_t = 1) − L(z_t = 0) at the `flips` bytes (a subset of the `free` ones, which the
    count prior counts), the rest of each row as sampled (summed objective of the row, unnormalised);
    0 elsewhere."""
    ends = layout.segmentation.ends
    batch = ends.shape[0]
    rows, columns = flips.nonzero(as_tuple=True)
    # Each row's sample first, computed as the flips are, so that the differences share the arithmetic.
    all_rows = torch.cat([torch.arange(batch, device=ends.device), rows])
    flip_at = torch.cat([torch.full((batch,), -1, device=ends.device), columns])
    values = torch.cat(
        [
            layout_objectives(
                model, layout, labels, free, all_rows[i : i + FLIP_CHUNK], flip_at[i : i + FLIP_CHUNK]
            )
            for i in range(0, len(all_rows), FLIP_CHUNK)
        ]
    )
    change = values[batch:] - values[rows]
    advantages = torch.zeros(ends.shape, dtype=values.dtype, device=values.device)
    # Flipping a byte that did not end makes z_t = 1: the change is A_t there, −A_t where it ended.
    advantages[rows, columns] = torch.where(ends[rows, columns], -change, change)
    return advantages


def layout_objectives(
    model: nn.Module,
    layout: LSLMPass,
    labels: torch.Tensor,
    free: torch.Tensor,
    rows: torch.Tensor,
    flip_at: torch.Tensor,
) -> torch.Tensor:
    """(R,) the summed objective L(Z) of the pass's rows `rows`, each with its sampled end at view column
    `flip_at` reversed (−1: none): scored cross-entropy, plus β · the count prior under a count prior."""
    config, backbone = model.config, model.model
    view = _take_rows(layout.view, rows)
    length = view.mask.shape[1]
    flips = F.one_hot(flip_at.clamp(min=0), length).bool() & (flip_at >= 0)[:, None]
    segmentation = flipped(_take_rows(layout.segmentation, rows), flips, view)
    segments, valid, documents = backbone.encode_segments(layout.token_states[rows], segmentation, view)
    slots = backbone.decoder_slots(view, segmentation)
    slot_states = backbone.decode(slots, segments, valid, documents)  # (R, S, Dd)
    record = LSLMPass(
        mask=layout.mask[rows],
        view=view,
        segmentation=segmentation,
        slots=slots,
        slot_states=slot_states,
        column_slots=None,
        boundaries=None,
        boundary_probs=None,
        hidden_states=None,
        cache=None,
    )
    targets = label_targets(record, labels[rows], config.segment_end_token_id)
    _, losses = target_losses(model.lm_head(slot_states), targets, scored_targets(targets, config))
    objective = losses.sum(dim=1)
    if config.prior_loss in COUNT_PRIORS:
        row_free = free[rows]
        counts, totals = (segmentation.ends & row_free).sum(dim=1), row_free.sum(dim=1)
        nll = count_prior_nll(counts.to(objective.dtype), totals, config)
        objective = objective + config.kl_weight * torch.where(totals > 0, nll, 0.0)
    return objective


def flipped(segmentation: Segmentation, flips: torch.Tensor, view: ByteView) -> Segmentation:
    """The segmentation with its ends at `flips` (B, T) reversed, as a hard layout (no estimator fields)."""
    ends = segmentation.ends ^ flips
    opens = (_previous(ends, False) | view.starts) & view.mask
    return dataclasses.replace(
        segmentation,
        ends=ends,
        content_ends=segmentation.content_ends ^ flips,
        opens=opens,
        index=chunk_index(opens, view.mask),
        confidence=None,
        straight_ends=None,
    )


def _take_rows(record: Record, rows: torch.Tensor) -> Record:
    """A layout dataclass (`ByteView`, `Segmentation`) with every tensor field restricted to `rows`."""
    fields = {field.name: getattr(record, field.name) for field in dataclasses.fields(record)}
    return dataclasses.replace(
        record, **{name: value[rows] for name, value in fields.items() if isinstance(value, torch.Tensor)}
    )
