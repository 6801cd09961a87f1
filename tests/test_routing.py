"""Router probabilities, sharpening, decisions and the straight-through factor
(hf_concept.modeling.routing) against the loop references (hf_concept.reference.routing)."""

import math

import pytest
import torch

from hf_concept.modeling.packing import document_starts
from hf_concept.modeling.routing import (
    boundary_decisions,
    boundary_decisions_from_noise,
    cosine_boundary_probs,
    gumbel_sigmoid,
    linear_boundary_probs,
    rule_boundaries,
    rule_boundary_probs,
    sample_gumbel_noise,
    sharpen_probs,
    straight_through,
)
from hf_concept.reference.routing import (
    boundary_decisions_reference,
    cosine_boundary_probs_reference,
    gumbel_sigmoid_reference,
    linear_boundary_probs_reference,
    rule_boundary_probs_reference,
    sharpen_probs_reference,
    straight_through_reference,
)

F64 = dict(rtol=1e-12, atol=1e-12)


def token_layout():
    """Row 0 left-padded, row 1 plain, row 2 packed with three documents (positions restart at 0)."""
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7, [1] * 7])
    position_ids = torch.tensor([[0, 0, 0, 1, 2, 3, 4], list(range(7)), [0, 1, 2, 0, 1, 0, 1]])
    mask = attention_mask.bool()
    return mask, document_starts(mask, position_ids)


def cosine_from_states(token_states, starts, mask):
    generator = torch.Generator().manual_seed(11)
    width = token_states.shape[-1]
    query_weight = torch.randn(width, 4, generator=generator, dtype=token_states.dtype)
    key_weight = torch.randn(width, 4, generator=generator, dtype=token_states.dtype)
    return cosine_boundary_probs(token_states @ query_weight, token_states @ key_weight, starts, mask)


def linear_from_states(token_states, starts, mask):
    weight = torch.randn(token_states.shape[-1], generator=torch.Generator().manual_seed(12))
    return linear_boundary_probs(token_states @ weight.to(token_states.dtype), starts, mask)


ROUTERS = {"cosine": cosine_from_states, "rule": rule_boundary_probs, "linear": linear_from_states}


def test_cosine_probs_match_reference_values_and_gradients_float64():
    mask, starts = token_layout()
    generator = torch.Generator().manual_seed(0)
    queries = torch.randn(3, 7, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    keys = torch.randn(3, 7, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(3, 7, generator=generator, dtype=torch.float64)

    fast = cosine_boundary_probs(queries, keys, starts, mask)
    fast_grads = torch.autograd.grad((fast * weights).sum(), (queries, keys))
    reference = cosine_boundary_probs_reference(queries, keys, starts, mask)
    reference_grads = torch.autograd.grad((reference * weights).sum(), (queries, keys))

    torch.testing.assert_close(fast, reference, **F64)
    for fast_grad, reference_grad in zip(fast_grads, reference_grads, strict=True):
        torch.testing.assert_close(fast_grad, reference_grad, **F64)
    assert fast[starts].eq(1).all() and fast[~mask].eq(0).all()
    # Starts and pads are constants: no gradient reaches their own query.
    assert fast_grads[0][starts | ~mask].eq(0).all()


def test_cosine_probs_float32_match_reference():
    mask, starts = token_layout()
    generator = torch.Generator().manual_seed(1)
    queries, keys = torch.randn(2, 3, 7, 5, generator=generator)
    fast = cosine_boundary_probs(queries, keys, starts, mask)
    assert fast.dtype == torch.float32
    torch.testing.assert_close(
        fast, cosine_boundary_probs_reference(queries, keys, starts, mask), rtol=0, atol=1e-6
    )


def test_rule_and_linear_probs_match_reference_values_and_gradients():
    mask, starts = token_layout()
    generator = torch.Generator().manual_seed(2)
    token_states = torch.randn(3, 7, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    logits = torch.randn(3, 7, generator=generator, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(3, 7, generator=generator, dtype=torch.float64)
    pairs = [
        (rule_boundary_probs, rule_boundary_probs_reference, token_states),
        (linear_boundary_probs, linear_boundary_probs_reference, logits),
    ]
    for fast_fn, reference_fn, inputs in pairs:
        fast = fast_fn(inputs, starts, mask)
        reference = reference_fn(inputs, starts, mask)
        torch.testing.assert_close(fast, reference, **F64)
        fast_grad = torch.autograd.grad((fast * weights).sum(), inputs)[0]
        reference_grad = torch.autograd.grad((reference * weights).sum(), inputs)[0]
        torch.testing.assert_close(fast_grad, reference_grad, **F64)


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_left_padded_row_equals_row_alone(router):
    mask, starts = token_layout()
    token_states = torch.randn(3, 7, 6, generator=torch.Generator().manual_seed(3))
    batched = ROUTERS[router](token_states, starts, mask)
    alone_states = token_states[0:1, 2:]
    alone_mask = torch.ones(1, 5, dtype=torch.bool)
    alone = ROUTERS[router](alone_states, document_starts(alone_mask), alone_mask)
    torch.testing.assert_close(batched[0:1, 2:], alone, rtol=0, atol=1e-7)


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_packed_row_equals_documents_apart(router):
    mask, starts = token_layout()
    token_states = torch.randn(3, 7, 6, generator=torch.Generator().manual_seed(4))
    packed = ROUTERS[router](token_states, starts, mask)[2]
    for begin, end in [(0, 3), (3, 5), (5, 7)]:
        document_mask = torch.ones(1, end - begin, dtype=torch.bool)
        apart = ROUTERS[router](token_states[2:3, begin:end], document_starts(document_mask), document_mask)
        torch.testing.assert_close(packed[begin:end], apart[0], rtol=0, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_zero_vectors_in_half_precision_are_finite(dtype):
    mask, starts = token_layout()
    generator = torch.Generator().manual_seed(5)
    queries = torch.randn(3, 7, 8, generator=generator).to(dtype)
    keys = torch.randn(3, 7, 8, generator=generator).to(dtype)
    queries[1, 3] = 0
    keys[1, 4] = 0
    queries[2, 6] = 0
    keys[2, 5] = 0
    # Large entries too: their squares overflow fp16 unless computed in float32.
    queries[0, 4] = 6e4
    queries.requires_grad_(True)
    keys.requires_grad_(True)

    probs = cosine_boundary_probs(queries, keys, starts, mask)
    assert probs.dtype == torch.float32 and torch.isfinite(probs).all()
    # Rule: cos with a zero vector is 0, so p = ½ (query (1, 3), previous key (1, 4), both at (2, 6)).
    assert probs[1, 3] == 0.5 and probs[1, 5] == 0.5 and probs[2, 6] == 0.5
    weights = torch.randn(3, 7, generator=generator)
    query_grad, key_grad = torch.autograd.grad((probs * weights).sum(), (queries, keys))
    assert query_grad.dtype == dtype and torch.isfinite(query_grad).all() and torch.isfinite(key_grad).all()

    token_states = torch.zeros(3, 7, 8, dtype=dtype, requires_grad=True)
    rule_probs = rule_boundary_probs(token_states, starts, mask)
    assert torch.isfinite(rule_probs).all() and rule_probs[mask & ~starts].eq(0.5).all()
    assert torch.isfinite(torch.autograd.grad(rule_probs.sum(), token_states)[0]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_are_computed_in_float32(dtype):
    mask, starts = token_layout()
    generator = torch.Generator().manual_seed(6)
    queries = torch.randn(3, 7, 8, generator=generator).to(dtype)
    keys = torch.randn(3, 7, 8, generator=generator).to(dtype)
    # The same values upcast first: identical results, so nothing ran in half precision.
    torch.testing.assert_close(
        cosine_boundary_probs(queries, keys, starts, mask),
        cosine_boundary_probs(queries.float(), keys.float(), starts, mask),
        rtol=0,
        atol=0,
    )


def test_past_keys_continue_a_cached_row():
    mask = torch.ones(2, 6, dtype=torch.bool)
    position_ids = torch.tensor([list(range(6)), [0, 1, 2, 3, 0, 1]])
    starts = document_starts(mask, position_ids)
    generator = torch.Generator().manual_seed(7)
    queries, keys = torch.randn(2, 2, 6, 4, generator=generator)
    full = cosine_boundary_probs(queries, keys, starts, mask)
    full_rule = rule_boundary_probs(queries, starts, mask)
    split = 4
    tail_mask = mask[:, split:]
    tail_starts = document_starts(tail_mask, position_ids[:, split:], has_past=True)
    tail = cosine_boundary_probs(
        queries[:, split:], keys[:, split:], tail_starts, tail_mask, past_keys=keys[:, split - 1]
    )
    tail_rule = rule_boundary_probs(
        queries[:, split:], tail_starts, tail_mask, past_token_states=queries[:, split - 1]
    )
    torch.testing.assert_close(tail, full[:, split:], rtol=0, atol=1e-7)
    torch.testing.assert_close(tail_rule, full_rule[:, split:], rtol=0, atol=1e-7)
    reference = cosine_boundary_probs_reference(
        queries[:, split:], keys[:, split:], tail_starts, tail_mask, past_keys=keys[:, split - 1]
    )
    torch.testing.assert_close(tail, reference, rtol=0, atol=1e-6)


def test_cosine_rejects_mismatched_shapes():
    mask, starts = token_layout()
    with pytest.raises(ValueError, match="queries and keys"):
        cosine_boundary_probs(torch.zeros(3, 7, 4), torch.zeros(3, 7, 5), starts, mask)
    with pytest.raises(ValueError, match="starts and mask"):
        cosine_boundary_probs(torch.zeros(3, 6, 4), torch.zeros(3, 6, 4), starts, mask)


def test_rule_boundaries_are_strict_and_threshold_is_checked():
    probs = torch.tensor([[1.0, 0.3, 0.30001, 0.0]])
    assert rule_boundaries(probs, 0.3).tolist() == [[True, False, True, False]]
    for threshold in (1.0, -0.1):
        with pytest.raises(ValueError, match="threshold"):
            rule_boundaries(probs, threshold)


def test_gumbel_sigmoid_matches_reference():
    generator = torch.Generator().manual_seed(8)
    logits = torch.randn(3, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    noise_a, noise_b = sample_gumbel_noise((3, 5), generator=generator, dtype=torch.float64)
    fast = gumbel_sigmoid(logits, noise_a, noise_b)
    reference = gumbel_sigmoid_reference(logits, noise_a, noise_b)
    torch.testing.assert_close(fast, reference, **F64)
    weights = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    torch.testing.assert_close(
        torch.autograd.grad((fast * weights).sum(), logits)[0],
        torch.autograd.grad((reference * weights).sum(), logits)[0],
        **F64,
    )
    with pytest.raises(ValueError, match="gumbel noises"):
        gumbel_sigmoid(logits, noise_a[:2], noise_b)


def test_gumbel_noise_is_reproducible_and_calibrated():
    first = sample_gumbel_noise((4, 3), generator=torch.Generator().manual_seed(9))
    second = sample_gumbel_noise((4, 3), generator=torch.Generator().manual_seed(9))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))

    samples = 20000
    logits = torch.tensor([-2.0, -0.5, 0.0, 1.0, 3.0])
    noise_a, noise_b = sample_gumbel_noise((samples, 5), generator=torch.Generator().manual_seed(10))
    assert torch.isfinite(noise_a).all() and torch.isfinite(noise_b).all()
    # A standard Gumbel has mean γ (Euler) and standard deviation π/√6.
    gumbel_std_error = math.pi / math.sqrt(6) / math.sqrt(noise_a.numel())
    assert abs(noise_a.mean().item() - 0.5772156649) < 5 * gumbel_std_error
    # Thresholding the sample at ½ draws Bernoulli(σ(logit)) (LSLM eq. 5–6).
    fractions = (gumbel_sigmoid(logits.expand(samples, 5), noise_a, noise_b) >= 0.5).double().mean(0)
    expected = torch.sigmoid(logits.double())
    tolerance = 5 * torch.sqrt(expected * (1 - expected) / samples)
    assert ((fractions - expected).abs() < tolerance).all(), (fractions, expected)


def test_sharpen_matches_reference_and_is_safe_at_the_edges():
    probs = torch.cat([torch.tensor([0.0, 0.25, 0.4999, 0.5, 0.75, 1.0]), torch.rand(20)]).double()
    probs.requires_grad_(True)
    for tau in (1.0, 2.0, 6.0):
        fast = sharpen_probs(probs, tau)
        reference = sharpen_probs_reference(probs, tau)
        torch.testing.assert_close(fast, reference, **F64)
        fast_grad = torch.autograd.grad(fast.sum(), probs)[0]
        assert torch.isfinite(fast_grad).all()
        inner = (probs > 0) & (probs < 1)
        reference_grad = torch.autograd.grad(reference.sum(), probs)[0]
        torch.testing.assert_close(fast_grad[inner], reference_grad[inner], **F64)
        # τ ≥ 1 moves every probability away from ½ (or keeps it).
        assert ((fast - 0.5).abs() >= (probs - 0.5).abs() - 1e-15).all()
    assert sharpen_probs(probs, 1.0).detach().equal(probs.detach())
    with pytest.raises(ValueError, match="tau"):
        sharpen_probs(probs, 0.0)


@pytest.mark.parametrize("noise", ["bernoulli", "gaussian", "none"])
@pytest.mark.parametrize("training", [True, False])
def test_decisions_match_reference_with_given_noise(noise, training):
    mask, starts = token_layout()
    generator = torch.Generator().manual_seed(13)
    probs = torch.rand(3, 7, generator=generator, dtype=torch.float64)
    # Adversarial values at starts and pads: decisions must still be True and False there.
    probs = probs.masked_fill(starts, 0.0).masked_fill(~mask, 1.0)
    probs[1, 3] = 0.5
    random_values = torch.rand(3, 7, generator=generator) if noise == "bernoulli" else torch.randn(3, 7)
    kwargs = dict(noise=noise, training=training, threshold=0.5, tau=3.0, sigma=0.2)
    fast = boundary_decisions_from_noise(probs, starts, mask, random_values, **kwargs)
    reference = boundary_decisions_reference(probs, starts, mask, random_values, **kwargs)
    assert fast.dtype == torch.bool and torch.equal(fast, reference)
    assert fast[starts].all() and not fast[~mask].any()
    if not training or noise == "none":
        # The inference threshold is inclusive.
        assert fast[1, 3]


def test_boundary_decisions_draw_from_the_generator():
    mask, starts = token_layout()
    probs = torch.rand(3, 7, generator=torch.Generator().manual_seed(14))
    for noise, draw in (("bernoulli", torch.rand), ("gaussian", torch.randn)):
        drawn = boundary_decisions(
            probs, starts, mask, noise=noise, training=True, generator=torch.Generator().manual_seed(15)
        )
        random_values = draw(3, 7, generator=torch.Generator().manual_seed(15))
        given = boundary_decisions_from_noise(probs, starts, mask, random_values, noise=noise, training=True)
        assert torch.equal(drawn, given)
    inference = boundary_decisions(probs, starts, mask, training=False)
    assert torch.equal(inference, ((probs >= 0.5) | starts) & mask)


def test_decision_arguments_are_checked():
    mask, starts = token_layout()
    probs = torch.rand(3, 7)
    bad = [({"noise": "uniform"}, "noise"), ({"tau": 0.0}, "tau"), ({"sigma": -1.0}, "sigma")]
    bad.append(({"threshold": 1.5}, "threshold"))
    for kwargs, name in bad:
        with pytest.raises(ValueError, match=name):
            boundary_decisions(probs, starts, mask, training=True, **kwargs)
    with pytest.raises(ValueError, match="random_values"):
        boundary_decisions_from_noise(probs, starts, mask, None, noise="bernoulli", training=True)


def test_straight_through_is_one_and_routes_the_chosen_gradient():
    generator = torch.Generator().manual_seed(16)
    probs = torch.rand(3, 7, generator=generator, dtype=torch.float64, requires_grad=True)
    boundaries = torch.rand(3, 7, generator=generator) < 0.5
    weights = torch.randn(3, 7, generator=generator, dtype=torch.float64)

    fast = straight_through(probs, boundaries)
    reference = straight_through_reference(probs, boundaries)
    assert torch.equal(fast, torch.ones_like(fast))
    torch.testing.assert_close(fast, reference, rtol=0, atol=1e-15)
    fast_grad = torch.autograd.grad((fast * weights).sum(), probs)[0]
    reference_grad = torch.autograd.grad((reference * weights).sum(), probs)[0]
    torch.testing.assert_close(fast_grad, reference_grad, rtol=0, atol=0)
    # d p / d p = 1 where chosen, d (1 − p) / d p = −1 otherwise.
    torch.testing.assert_close(fast_grad, torch.where(boundaries, weights, -weights), rtol=0, atol=0)
