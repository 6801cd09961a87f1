"""The LSLM ELBO's parts that are not the decoder's cross-entropy: the boundary prior's term, the boundary
rates, and the decoder targets that HF-style `labels` give (modeling_lslm's module docstring, step 6)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .configuration_lslm import LSLMConfig
from .lslm_estimators import beta_binomial_prior_nll, beta_expected_kl, straight_through_target_losses
from .lslm_layout import ByteView, DecoderSlots, Segmentation
from .routing import bernoulli_kl_from_logits, binomial_prior_nll
from .tokenization_lslm import BYTE_OFFSET

if TYPE_CHECKING:
    from .lslm_outputs import LSLMPass


def prior_loss_sum(segmentation: Segmentation, free: torch.Tensor, config: LSLMConfig) -> torch.Tensor:
    """The boundary prior's term of the negative ELBO, summed over the batch (the caller normalises):
    "beta_binomial": Σ over rows of −log BetaBinomial(k; n, a, b) (`LSLMConfig.beta_prior`);
    "binomial": Σ over rows of −log Binomial(k; n, prior_mean); k the row's sampled ends among its n free
    bytes, counted straight-through (Σ z_t + ẑ_t − sg(ẑ_t)) so that each sample gets the count's
    gradient, or as the plain count under the "segmental" estimator, whose flips score the count prior
    (`lslm_segmental`). "kl": Σ over free bytes of KL(Bernoulli(q_t) ‖ Bernoulli(prior_mean)); "beta_kl":
    Σ over free bytes of the KL expected under the Beta(a, b) (`lslm_estimators.beta_expected_kl`)."""
    if config.prior_loss == "kl":
        kl = bernoulli_kl_from_logits(segmentation.logits, config.prior_mean)
        return kl[free].sum()
    if config.prior_loss == "beta_kl":
        return beta_expected_kl(segmentation.logits, *config.beta_prior())[free].sum()
    if config.boundary_estimator == "segmental":
        counts = (segmentation.ends & free).sum(dim=1).to(segmentation.probs.dtype)
    else:
        relaxed = segmentation.relaxed if segmentation.relaxed is not None else segmentation.probs
        straight = segmentation.ends.float() + relaxed - relaxed.detach()
        counts = (straight * free).sum(dim=1)
    totals = free.sum(dim=1)
    return count_prior_nll(counts, totals, config)[totals > 0].sum()


def count_prior_nll(counts: torch.Tensor, totals: torch.Tensor, config: LSLMConfig) -> torch.Tensor:
    """(B,) −log P(k ends among n free bytes) under the count priors ("binomial", "beta_binomial")."""
    if config.prior_loss == "binomial":
        return binomial_prior_nll(counts, totals, config.prior_mean)
    return beta_binomial_prior_nll(counts, totals, *config.beta_prior())


def boundary_metrics(segmentation: Segmentation, free: torch.Tensor) -> dict:
    """Detached boundary rates over the `free` bytes (no forced end): `boundary_rate`, the ends this pass
    used (sampled in training, the inference rule in eval); `expected_boundary_rate`, the mean q_t (the
    rate training samples at); `inference_boundary_rate`, the share the inference rule (`boundary_rule`)
    closes on the same bytes. None when no byte is free."""
    if not bool(free.any()):
        return dict(boundary_rate=None, expected_boundary_rate=None, inference_boundary_rate=None)
    return dict(
        boundary_rate=segmentation.ends[free].float().mean(),
        expected_boundary_rate=segmentation.probs.detach()[free].mean(),
        inference_boundary_rate=segmentation.inferred[free].float().mean(),
    )


def label_targets(layout: LSLMPass, labels: torch.Tensor, end_id: int) -> torch.Tensor:
    """(B, S) decoder targets under causal-LM `labels` (B, T): the label at input column c is the target
    of the prediction made at column c - 1 (HF's shift, done here), -100 ignored.

    A byte x_{t+1} is produced by the target at byte t's slot when t leaves its segment open, else by
    `<nxt>` at t's slot plus the target at the next segment's `<bos>` slot. So the label of a byte
    target sits at the next byte's column, that of a `<bos>` slot at its segment's first byte, that of
    `<nxt>` at the input column after the closing byte (a marker's, if one follows); -100 there drops
    the target, and byte targets take the label's value (`<nxt>` stays `<nxt>`). A `<nxt>` with no real
    column after it (the row's end) has no label and is kept. Markers are not bytes: only a `<nxt>`
    reads a marker's label. With `labels` equal to `input_ids` the result is `layout.slots.targets`.
    """
    view, segmentation, targets = layout.view, layout.segmentation, layout.slots.targets
    batch, length = labels.shape
    sink = targets.shape[1]  # scatter index of the view columns that have no such slot; dropped
    columns = view.order  # (B, T) input column of each view column
    # A segment's bytes are adjacent in the view, so an open byte's successor is the next view column.
    next_byte = F.pad(columns, (0, 1), value=length)[:, 1:]
    governing = torch.where(segmentation.ends, columns + 1, next_byte)
    real = view.mask & (governing < length)
    governing = governing.clamp(max=length - 1)
    real = real & torch.gather(layout.mask, 1, governing)
    own_slot = layout.slots.token_slot.masked_fill(~view.mask, sink)
    bos_slot = (layout.slots.token_slot - 1).masked_fill(~segmentation.opens, sink)
    slot_labels = labels.new_full((batch, sink + 1), -100)
    governed = torch.zeros_like(slot_labels, dtype=torch.bool)
    for slot, label, has_label in (
        (own_slot, torch.gather(labels, 1, governing), real),
        (bos_slot, torch.gather(labels, 1, columns), segmentation.opens),
    ):
        slot_labels.scatter_(1, slot, label)
        governed.scatter_(1, slot, has_label)
    slot_labels, governed = slot_labels[:, :sink], governed[:, :sink]
    byte_target = (targets != -100) & (targets != end_id)
    targets = torch.where(governed & byte_target, slot_labels, targets)
    return targets.masked_fill(governed & (slot_labels == -100), -100)


def labels_from_shift_labels(shift_labels: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' pre-shifted labels (B, T) (`shift_labels[:, c]` labels the token after column c, as
    sequence-parallel trainers pass them) -> the causal-LM `labels` (B, T) they shift, -100 at column 0.

    The last column's label would name a token after the input. LSLM has no target for it (whether that
    token opens a segment is decided by bytes it has not seen), so only -100 is accepted there: a
    sequence cut into shards (context or sequence parallelism) cannot be segmented shard by shard."""
    if shift_labels.shape != input_ids.shape:
        raise ValueError(
            f"shift_labels of shape {tuple(shift_labels.shape)} do not match input_ids of shape "
            f"{tuple(input_ids.shape)}: shift_labels[:, c] is the label of the token after column c"
        )
    if shift_labels.shape[1] and bool((shift_labels[:, -1] != -100).any()):
        raise ValueError(
            "shift_labels[:, -1] holds a label other than -100, a token after the input: LSLM segments "
            "whole rows and cannot predict across a cut (context/sequence parallelism is not supported); "
            "pass -100 there, or pass `labels` aligned with input_ids"
        )
    return F.pad(shift_labels[:, :-1], (1, 0), value=-100)


def elbo_fields(
    config: LSLMConfig,
    slot_logits: torch.Tensor,
    slots: DecoderSlots,
    segmentation: Segmentation,
    view: ByteView,
    targets: torch.Tensor | None,
    predicted: torch.Tensor | None,
) -> dict:
    """The metrics, and with `targets` (B, S) (`label_targets`) the loss: the negative ELBO's sums over
    this batch divided by `predicted`, the bytes the whole step predicts (see `LSLMForCausalLM`)."""
    mask = view.mask
    free = mask & ~segmentation.forced
    fields = boundary_metrics(segmentation, free)
    segments = int((segmentation.index.max(dim=1).values + 1).clamp(min=0).sum())
    fields["compression_ratio"] = (mask.sum() / max(segments, 1)).detach().float()
    if targets is None:
        return fields
    counted = scored_targets(targets, config)
    log_probs, losses = target_losses(slot_logits, targets, counted)
    if segmentation.straight_ends is not None and config.boundary_estimator == "straight_through_targets":
        losses = straight_through_slot_losses(config, log_probs, losses, targets, segmentation, view, slots)
    lm_sum = losses[counted].sum()
    lm_loss = lm_sum / counted.sum().clamp(min=1)
    byte_targets = targets >= BYTE_OFFSET
    bits = losses[byte_targets].sum() / byte_targets.sum().clamp(min=1) / math.log(2.0)
    # Sums over the batch, normalised by the step's predicted bytes: micro-batches and ranks add up.
    prior_sum = prior_loss_sum(segmentation, free, config)
    fields.update(
        loss=(lm_sum + config.kl_weight * prior_sum) / predicted,
        lm_loss=lm_loss.detach(),
        # The prior term per free byte (the KL's mean, or the count prior's share).
        kl_loss=(prior_sum / free.sum().clamp(min=1)).detach(),
        bits_per_byte=bits.detach(),
    )
    return fields


def scored_targets(targets: torch.Tensor, config: LSLMConfig) -> torch.Tensor:
    """(B, S) bool: the decoder targets the objective scores, every kept one (not -100), less the `<nxt>`
    markers when `segment_end_loss` is off (`LSLMConfig`'s docstring: LSLM eq. 4 has no such term)."""
    counted = targets != -100
    if not config.segment_end_loss:
        counted = counted & (targets != config.segment_end_token_id)
    return counted


def target_losses(
    slot_logits: torch.Tensor, targets: torch.Tensor, counted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """((B, S, V) log-probabilities, (B, S) cross-entropy of each slot's target, 0 where not `counted`),
    in float32 at least (float64 logits stay float64)."""
    log_probs = F.log_softmax(slot_logits.to(torch.promote_types(slot_logits.dtype, torch.float32)), dim=-1)
    losses = -torch.gather(log_probs, 2, targets.clamp(min=0)[..., None])[..., 0] * counted
    return log_probs, losses


def straight_through_slot_losses(
    config: LSLMConfig,
    log_probs: torch.Tensor,
    losses: torch.Tensor,
    targets: torch.Tensor,
    segmentation: Segmentation,
    view: ByteView,
    slots: DecoderSlots,
) -> torch.Tensor:
    """(B, S) slot losses with each free byte's end decision passed straight through its slot's target
    (`lslm_estimators.straight_through_target_losses`): same values, a gradient to the decision from
    the slot's `<nxt>` and next-byte log-probabilities. Bytes whose slot target a label changed, and a
    document's last byte, keep their loss as it is."""
    end_id = config.segment_end_token_id
    next_ids = F.pad(view.ids, (0, 1), value=config.pad_token_id)[:, 1:]
    next_documents = F.pad(view.documents, (0, 1), value=-1)[:, 1:]
    has_next = view.mask & (next_documents == view.documents)
    slot = slots.token_slot.clamp(min=0)  # (B, T)
    slot_targets = torch.gather(targets, 1, slot)
    expected = torch.where(segmentation.ends, slot_targets == end_id, slot_targets == next_ids)
    usable = has_next & ~segmentation.forced & expected
    at_bytes = torch.gather(log_probs, 1, slot[..., None].expand(-1, -1, log_probs.shape[-1]))  # (B, T, V)
    end_losses = -at_bytes[..., end_id]
    continue_losses = -torch.gather(at_bytes, 2, next_ids[..., None])[..., 0]
    mixed = straight_through_target_losses(segmentation.straight_ends, end_losses, continue_losses)
    sink = losses.shape[1]  # scatter index of the bytes that keep their loss; dropped
    extended = F.pad(losses, (0, 1)).scatter(
        1, torch.where(usable, slot, sink), torch.where(usable, mixed, 0.0)
    )
    return extended[:, :sink]
