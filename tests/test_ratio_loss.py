"""Ratio loss scopes and the aux-loss scaling (hf_concept.modeling.routing) against the loop reference.

The "global" scope across ranks and accumulated micro-batches is in test_distributed_ratio.py.
"""

import pytest
import torch

from hf_concept.modeling.packing import document_starts
from hf_concept.modeling.routing import (
    RatioAccumulator,
    boundary_decisions_from_noise,
    linear_boundary_probs,
    ratio_loss,
    ratio_loss_coefficients,
    ratio_loss_from_fractions,
    scale_aux_loss,
)
from hf_concept.reference.routing import ratio_loss_reference, sequences_reference

F64 = dict(rtol=1e-12, atol=1e-12)


def token_layout():
    """Left-padded, plain, packed (three documents) and fully padded rows."""
    attention_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8, [1] * 8, [0] * 8])
    position_ids = torch.tensor([[0, 0, 0, 0, 1, 2, 3, 4], list(range(8)), [0, 1, 2, 0, 1, 2, 0, 1], [0] * 8])
    mask = attention_mask.bool()
    return mask, document_starts(mask, position_ids)


def sampled_routing(mask, starts, seed):
    """float64 leaf logits, their probabilities, and Bernoulli decisions from fixed uniforms."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(mask.shape, generator=generator, dtype=torch.float64, requires_grad=True)
    probs = linear_boundary_probs(logits, starts, mask)
    uniforms = torch.rand(mask.shape, generator=generator, dtype=torch.float64)
    boundaries = boundary_decisions_from_noise(
        probs, starts, mask, uniforms, noise="bernoulli", training=True
    )
    return logits, probs, boundaries


def test_formula_is_zero_at_target_and_linear_in_mean_prob():
    for ratio in (1.5, 2.0, 4.0):
        target = torch.tensor(1 / ratio, dtype=torch.float64)
        assert abs(ratio_loss_from_fractions(target, target, ratio).item()) < 1e-15
    fractions, means = torch.rand(2, 50, dtype=torch.float64)
    slope, intercept = ratio_loss_coefficients(fractions, 3.0)
    torch.testing.assert_close(
        slope * means + intercept, ratio_loss_from_fractions(fractions, means, 3.0), **F64
    )
    for ratio in (1.0, 0.5):
        with pytest.raises(ValueError, match="target_ratio"):
            ratio_loss_from_fractions(fractions, means, ratio)


@pytest.mark.parametrize(
    ("scope", "per_document"), [("sequence", False), ("sequence", True), ("batch", False), ("global", False)]
)
def test_scopes_match_reference_values_and_gradients(scope, per_document):
    mask, starts = token_layout()
    logits, probs, boundaries = sampled_routing(mask, starts, seed=0)
    fast = ratio_loss(
        probs, boundaries, mask, target_ratio=3.0, scope=scope, starts=starts if per_document else None
    )
    sequences = sequences_reference(probs, boundaries, mask, starts if per_document else None)
    reference_loss, reference_fraction, reference_mean = ratio_loss_reference(sequences, 3.0, scope)

    torch.testing.assert_close(fast.loss, reference_loss, **F64)
    torch.testing.assert_close(fast.value, reference_loss.detach(), **F64)
    torch.testing.assert_close(fast.boundary_fraction, reference_fraction, **F64)
    torch.testing.assert_close(fast.mean_prob, reference_mean, **F64)
    assert fast.token_count.item() == mask.sum().item()
    assert not fast.value.requires_grad and not fast.mean_prob.requires_grad
    fast_grad = torch.autograd.grad(fast.loss, logits, retain_graph=True)[0]
    reference_grad = torch.autograd.grad(reference_loss, logits)[0]
    torch.testing.assert_close(fast_grad, reference_grad, **F64)
    assert fast_grad.abs().sum() > 0


def test_sequence_scope_averages_sequences_not_tokens():
    mask, starts = token_layout()
    _, probs, boundaries = sampled_routing(mask, starts, seed=1)
    per_row = ratio_loss(probs, boundaries, mask, target_ratio=3.0, scope="sequence")
    per_document = ratio_loss(probs, boundaries, mask, target_ratio=3.0, scope="sequence", starts=starts)
    pooled = ratio_loss(probs, boundaries, mask, target_ratio=3.0, scope="batch")
    # Three different definitions on uneven sequences: they must not coincide by accident.
    assert (per_row.value - pooled.value).abs() > 1e-3
    assert (per_row.value - per_document.value).abs() > 1e-3


@pytest.mark.parametrize("scope", ["sequence", "batch"])
def test_packed_row_equals_documents_apart(scope):
    mask, starts = token_layout()
    _, probs, boundaries = sampled_routing(mask, starts, seed=2)
    packed = ratio_loss(
        probs[2:3], boundaries[2:3], mask[2:3], target_ratio=2.0, scope=scope, starts=starts[2:3]
    )
    # The same three documents as separate, left-padded rows.
    spans = [(0, 3), (3, 6), (6, 8)]
    apart_probs = torch.zeros(3, 3, dtype=probs.dtype)
    apart_boundaries = torch.zeros(3, 3, dtype=torch.bool)
    apart_mask = torch.zeros(3, 3, dtype=torch.bool)
    for row, (begin, end) in enumerate(spans):
        apart_probs[row, 3 - (end - begin) :] = probs[2, begin:end]
        apart_boundaries[row, 3 - (end - begin) :] = boundaries[2, begin:end]
        apart_mask[row, 3 - (end - begin) :] = True
    apart_starts = document_starts(apart_mask)
    apart = ratio_loss(
        apart_probs, apart_boundaries, apart_mask, target_ratio=2.0, scope=scope, starts=apart_starts
    )
    torch.testing.assert_close(packed.loss, apart.loss, **F64)
    torch.testing.assert_close(packed.boundary_fraction, apart.boundary_fraction, **F64)


@pytest.mark.parametrize("scope", ["sequence", "batch"])
def test_left_padded_row_equals_row_alone(scope):
    mask, starts = token_layout()
    _, probs, boundaries = sampled_routing(mask, starts, seed=3)
    padded = ratio_loss(probs[0:1], boundaries[0:1], mask[0:1], target_ratio=4.0, scope=scope)
    alone = ratio_loss(
        probs[0:1, 3:], boundaries[0:1, 3:], torch.ones(1, 5, dtype=torch.bool), target_ratio=4.0, scope=scope
    )
    torch.testing.assert_close(padded.loss, alone.loss, **F64)
    torch.testing.assert_close(padded.mean_prob, alone.mean_prob, **F64)


def test_global_scope_in_one_process_equals_batch_scope():
    mask, starts = token_layout()
    logits, probs, boundaries = sampled_routing(mask, starts, seed=4)
    batch = ratio_loss(probs, boundaries, mask, target_ratio=3.0, scope="batch")
    global_ = ratio_loss(probs, boundaries, mask, target_ratio=3.0, scope="global")
    for field in ("loss", "value", "boundary_fraction", "mean_prob"):
        torch.testing.assert_close(getattr(global_, field), getattr(batch, field), **F64)
    torch.testing.assert_close(
        torch.autograd.grad(global_.loss, logits, retain_graph=True)[0],
        torch.autograd.grad(batch.loss, logits)[0],
        **F64,
    )


@pytest.mark.parametrize("scope", ["sequence", "batch", "global"])
def test_all_pad_batch_gives_zero_loss_and_zero_gradient(scope):
    mask = torch.zeros(2, 4, dtype=torch.bool)
    logits = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    probs = linear_boundary_probs(logits, mask, mask)
    out = ratio_loss(probs, mask, mask, target_ratio=2.0, scope=scope, starts=mask)
    assert out.loss.item() == 0 and out.value.item() == 0 and out.token_count.item() == 0
    assert torch.autograd.grad(out.loss, logits)[0].eq(0).all()


def test_bad_arguments_raise_value_errors():
    mask, starts = token_layout()
    _, probs, boundaries = sampled_routing(mask, starts, seed=5)
    with pytest.raises(ValueError, match="scope"):
        ratio_loss(probs, boundaries, mask, target_ratio=2.0, scope="step")
    with pytest.raises(ValueError, match="target_ratio"):
        ratio_loss(probs, boundaries, mask, target_ratio=1.0)
    with pytest.raises(ValueError, match="accumulator"):
        ratio_loss(probs, boundaries, mask, target_ratio=2.0, scope="batch", accumulator=RatioAccumulator(2))
    with pytest.raises(ValueError, match="boundaries"):
        ratio_loss(probs, boundaries[:, :3], mask, target_ratio=2.0)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        scale_aux_loss(torch.tensor(1.0), 3, 0)


def make_router_batches():
    """A linear router and two micro-batches: the second holds the first's rows twice (same F and G,
    twice the tokens), so the full batch has exactly the micro-batches' F and G."""
    generator = torch.Generator().manual_seed(6)
    router_weight = torch.randn(5, generator=generator, dtype=torch.float64, requires_grad=True)
    token_states = torch.randn(2, 6, 5, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6]).bool()
    first = (token_states, mask)
    second = (token_states.repeat(2, 1, 1), mask.repeat(2, 1))
    return router_weight, [first, second]


def batch_ratio_loss(router_weight, token_states, mask):
    starts = document_starts(mask)
    probs = linear_boundary_probs(token_states @ router_weight, starts, mask)
    boundaries = boundary_decisions_from_noise(probs, starts, mask, None, noise="none", training=False)
    return ratio_loss(probs, boundaries, mask, target_ratio=3.0, scope="batch")


def test_scaled_aux_loss_under_accumulation_matches_the_full_batch():
    router_weight, micro_batches = make_router_batches()
    full_states = torch.cat([states for states, _ in micro_batches])
    full_mask = torch.cat([mask for _, mask in micro_batches])
    full = batch_ratio_loss(router_weight, full_states, full_mask)
    full_grad = torch.autograd.grad(full.loss, router_weight)[0]

    # Trainer: every micro-batch's term is added, none divided by the accumulation steps.
    num_items = int(full_mask.sum())
    scaled_total, unscaled_total = 0.0, 0.0
    for states, mask in micro_batches:
        term = batch_ratio_loss(router_weight, states, mask)
        torch.testing.assert_close(term.boundary_fraction, full.boundary_fraction, **F64)
        scaled_total = scaled_total + scale_aux_loss(term.loss, int(mask.sum()), num_items)
        unscaled_total = unscaled_total + term.loss
    torch.testing.assert_close(scaled_total, full.loss, **F64)
    scaled_grad = torch.autograd.grad(scaled_total, router_weight, retain_graph=True)[0]
    torch.testing.assert_close(scaled_grad, full_grad, **F64)
    # The unscaled sum (transformers #48690) counts the term once per micro-batch.
    torch.testing.assert_close(torch.autograd.grad(unscaled_total, router_weight)[0], 2 * full_grad, **F64)
    assert full_grad.abs().sum() > 1e-6


def test_scaled_aux_loss_is_the_token_weighted_mean():
    terms = torch.tensor([0.3, -0.1, 0.8], dtype=torch.float64)
    items = torch.tensor([5, 9, 2])
    total = sum(scale_aux_loss(term, count, items.sum()) for term, count in zip(terms, items, strict=True))
    torch.testing.assert_close(total, (terms * items).sum() / items.sum(), **F64)
    term = terms[0]
    assert scale_aux_loss(term, 5, None) is term
