"""LSLM's "segmental" boundary estimator (`lslm_segmental`, not the paper's): its gradient, averaged over the
training sample, is the exact gradient of the expected objective E_{Z~q}[L(Z)], checked against an
enumeration of every segment layout of short rows by the loop reference, in float64."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from hf_concept.modeling import lslm_segmental, modeling_lslm
from hf_concept.modeling.lslm_estimators import local_expectation_surrogate
from hf_concept.modeling.tokenization_lslm import BYTE_OFFSET, SEQUENCE_START_ID
from hf_concept.reference.lslm import (
    expected_loss_reference,
    layout_objective_reference,
    router_logits_reference,
)
from tests.test_lslm_learning import tiny_lslm

TEXT = b"thecatsat"


def row(length: int) -> torch.Tensor:
    """(1, 1 + length) ids: `<BoS>`, then the first `length` bytes of `TEXT`."""
    return torch.tensor([[SEQUENCE_START_ID, *(BYTE_OFFSET + byte for byte in TEXT[:length])]])


def layouts(decided: list[int], length: int):
    """Every end layout of the `decided` columns of a row of `length` columns (the others False)."""
    for choice in itertools.product((False, True), repeat=len(decided)):
        ends = [False] * length
        for column, end in zip(decided, choice, strict=True):
            ends[column] = end
        yield ends


def test_the_surrogate_is_zero_and_averages_to_the_expected_loss_gradient():
    """A toy objective over 4 decisions: Σ_Z q(Z) · (gradient of the surrogate with A from Z's rest) is
    the autograd gradient of Σ_Z q(Z) L(Z)."""
    torch.manual_seed(0)
    logits = torch.randn(4, dtype=torch.float64, requires_grad=True)
    table = {
        ends: torch.randn((), dtype=torch.float64) for ends in itertools.product((False, True), repeat=4)
    }
    exact = torch.autograd.grad(
        expected_loss_reference(lambda ends: table[tuple(ends)], logits, [0, 1, 2, 3], 4), logits
    )[0]
    probs = torch.sigmoid(logits.detach())
    average = torch.zeros(4, dtype=torch.float64)
    for ends in table:
        advantages = torch.stack(
            [
                table[(*ends[:t], True, *ends[t + 1 :])] - table[(*ends[:t], False, *ends[t + 1 :])]
                for t in range(4)
            ]
        )
        surrogate = local_expectation_surrogate(
            logits[None], advantages[None], torch.ones(1, 4, dtype=torch.bool)
        )
        assert surrogate.item() == 0.0
        weight = math.prod(float(p if end else 1 - p) for p, end in zip(probs, ends, strict=True))
        average += weight * torch.autograd.grad(surrogate, logits)[0]
    torch.testing.assert_close(average, exact, rtol=1e-12, atol=1e-14)


def forced_noise(monkeypatch, ends: list[bool]) -> None:
    """Gumbel noises that make the training sample take `ends` (g′ − g″ = ±1000 against |p̂| ≪ 1000)."""
    wanted = torch.tensor([ends])

    def noise(shape, generator=None, device=None, dtype=torch.float32):
        assert tuple(shape) == tuple(wanted.shape)
        return torch.where(wanted, 1000.0, -1000.0).double(), torch.zeros(shape, dtype=torch.float64)

    monkeypatch.setattr(modeling_lslm, "sample_gumbel_noise", noise)


def enumerated_gradients(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """{name: the gradient of E_q[L] / predicted bytes}, E_q[L] enumerated by the loop reference."""
    logits, decided = router_logits_reference(model, ids)
    expected = expected_loss_reference(
        lambda ends: layout_objective_reference(model, ids, ends), logits, decided, ids.shape[1]
    )
    parameters = dict(model.named_parameters())
    gradients = torch.autograd.grad(expected / (ids.shape[1] - 1), list(parameters.values()))
    return dict(zip(parameters, gradients, strict=True))


def expected_gradients(model, ids: torch.Tensor, monkeypatch) -> dict[str, torch.Tensor]:
    """{name: Σ_Z q(Z) · the model's gradient with the training sample forced to Z}: the estimator's
    expectation over the sample, computed exactly."""
    with torch.no_grad():
        logits, decided = router_logits_reference(model, ids)
    probs = torch.sigmoid(logits)
    parameters = dict(model.named_parameters())
    averaged = {name: torch.zeros_like(parameter) for name, parameter in parameters.items()}
    model.train()
    for ends in layouts(decided, ids.shape[1]):
        forced_noise(monkeypatch, ends)
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        weight = math.prod(float(p if ends[c] else 1 - p) for p, c in zip(probs, decided, strict=True))
        for name, parameter in parameters.items():
            if parameter.grad is not None:
                averaged[name] += weight * parameter.grad
    return averaged


def assert_gradients_match(averaged: dict, reference: dict) -> None:
    """The router's gradient to 1e-9 relative (it is float64 end to end); the other weights' to 1e-5:
    the shared RMSNorm and attention softmax compute in float32 inside a float64 model, and the loop
    reference sums their gradients in another order."""
    router = [name for name in reference if ".router." in f".{name}"]
    assert router and all(bool(reference[name].abs().sum() > 0) for name in router)
    for name in reference:
        rtol = 1e-9 if name in router else 1e-5
        scale = float(reference[name].abs().max())
        torch.testing.assert_close(
            averaged[name], reference[name], rtol=rtol, atol=rtol * scale + 1e-15, msg=name
        )


@pytest.mark.parametrize(
    "overrides",
    [
        dict(prior_loss="beta_binomial", prior_mean=0.3, prior_concentration=4.0),
        dict(prior_loss="beta_kl", segment_end_loss=False),
    ],
)
def test_the_expected_gradient_is_the_enumerated_one_on_short_rows(overrides, monkeypatch):
    """Five bytes after `<BoS>` (2^5 layouts): every parameter's gradient, averaged over the sample
    exactly, equals the enumeration's to 1e-6 relative."""
    model = tiny_lslm(boundary_estimator="segmental", **overrides).double()
    assert_gradients_match(
        expected_gradients(model, row(5), monkeypatch), enumerated_gradients(model, row(5))
    )


@pytest.mark.slow
@pytest.mark.parametrize("prior_loss", ["beta_binomial", "binomial", "kl", "beta_kl"])
def test_the_expected_gradient_is_the_enumerated_one_at_ten_bytes(prior_loss, monkeypatch):
    """`<BoS>` and nine bytes (2^9 layouts of the router's decisions)."""
    model = tiny_lslm(boundary_estimator="segmental", prior_loss=prior_loss, prior_mean=0.4).double()
    assert_gradients_match(
        expected_gradients(model, row(9), monkeypatch), enumerated_gradients(model, row(9))
    )


def test_sampled_router_gradients_average_to_the_enumerated_one():
    """With real Gumbel noise: the mean of 300 single-sample router gradients lies within 5 standard
    errors of the exact gradient in every coordinate (the Monte Carlo tolerance of one fixed seed)."""
    model = tiny_lslm(boundary_estimator="segmental", prior_mean=0.4, prior_concentration=4.0).double()
    ids = row(5)
    router = dict(model.model.router.named_parameters())
    exact = torch.cat(
        [
            gradient.flatten()
            for name, gradient in enumerated_gradients(model, ids).items()
            if ".router." in name
        ]
    )
    model.train()
    torch.manual_seed(0)
    samples = []
    for _ in range(300):
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        samples.append(torch.cat([parameter.grad.flatten() for parameter in router.values()]))
    samples = torch.stack(samples)
    error = (samples.mean(0) - exact).abs()
    standard_error = samples.std(0) / math.sqrt(len(samples))
    assert bool((error <= 5 * standard_error + 1e-12).all()), float((error / standard_error).max())
    # Not trivially: single samples scatter widely around the mean.
    assert float(standard_error.max()) > 1e-3 * float(exact.abs().max())


def test_the_estimator_changes_no_value_and_runs_only_where_it_can_matter(monkeypatch):
    """The loss, logits and metrics are those of the plain pass over the same sample; in eval mode, without
    labels or without gradients no flip is run."""
    ids = torch.cat([row(9), row(9).flip(1)])
    outputs = {}
    for estimator in ("straight_through", "segmental"):
        model = tiny_lslm(boundary_estimator=estimator).train()
        torch.manual_seed(4)
        outputs[estimator] = model(input_ids=ids, labels=ids)
    for field in ("loss", "logits", "lm_loss", "kl_loss", "boundary_rate"):
        assert torch.equal(
            getattr(outputs["segmental"], field), getattr(outputs["straight_through"], field)
        ), field
    calls = []
    monkeypatch.setattr(lslm_segmental, "flip_advantages", lambda *args: calls.append(args))
    model.eval()
    model(input_ids=ids, labels=ids)
    model.train()
    model(input_ids=ids)
    with torch.no_grad():
        model(input_ids=ids, labels=ids)
    assert not calls


def test_the_advantages_of_a_left_padded_batch_are_the_loop_references(monkeypatch):
    """Every free byte's A_t = L(z_t = 1) − L(z_t = 0) (summed objective, count prior included), the rest as
    sampled, equals the loop reference's difference for each row alone."""
    model = tiny_lslm(boundary_estimator="segmental", prior_mean=0.4, prior_concentration=4.0).double()
    rows = [row(9)[0], row(6)[0]]
    width = max(len(ids) for ids in rows)
    ids = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), r]) for r in rows])
    mask = torch.stack([torch.arange(width) >= width - len(r) for r in rows])
    captured = []
    original = lslm_segmental.flip_advantages

    def keep(model, layout, labels, free, flips):
        captured.append((layout.segmentation.ends, free, original(model, layout, labels, free, flips)))
        return captured[-1][-1]

    monkeypatch.setattr(lslm_segmental, "flip_advantages", keep)
    model.train()
    torch.manual_seed(1)
    model(input_ids=ids, attention_mask=mask.long(), labels=ids.masked_fill(~mask, -100))
    ((ends, free, advantages),) = captured
    assert torch.equal(advantages != 0, free)
    for index, alone in enumerate(rows):
        offset = width - len(alone)
        sampled = ends[index, offset:].tolist()
        for column in range(1, len(alone)):
            with_end, without = list(sampled), list(sampled)
            with_end[column], without[column] = True, False
            with torch.no_grad():
                expected = layout_objective_reference(
                    model, alone[None], with_end
                ) - layout_objective_reference(model, alone[None], without)
            assert float(advantages[index, offset + column]) == pytest.approx(
                float(expected), rel=1e-6, abs=1e-9
            )


def test_a_flip_budget_weights_the_flipped_bytes_and_leaves_the_others_out(monkeypatch):
    """`segmental_flips` = k: k free bytes per row are flipped, each advantage weighted by n / k, the
    other bytes get no router gradient; k at or above a row's free bytes is the exact estimator."""
    ids = torch.cat([row(9), row(9).flip(1)])
    captured = []
    original = lslm_segmental.local_expectation_surrogate

    def keep(logits, advantages, decided):
        captured.append((advantages, decided))
        return original(logits, advantages, decided)

    monkeypatch.setattr(lslm_segmental, "local_expectation_surrogate", keep)
    for budget in (0, 9, 3):
        model = tiny_lslm(boundary_estimator="segmental", segmental_flips=budget).double().train()
        torch.manual_seed(2)
        model(input_ids=ids, labels=ids).loss.backward()
    (exact, free), (same, same_free), (sampled, chosen) = captured
    assert torch.equal(same_free, free) and torch.allclose(same, exact)
    assert torch.equal(chosen.sum(dim=1), torch.tensor([3, 3])) and not bool((chosen & ~free).any())
    # Same sample (same seed): the flipped bytes' advantages are the exact ones × n / k.
    weights = (free.sum(dim=1) / 3.0)[:, None]
    assert torch.allclose(sampled[chosen], (exact * weights)[chosen]) and not bool(sampled[~chosen].any())


def test_drawn_flips_are_uniform_and_unbiased():
    free = torch.tensor([[False, True, True, True, True, False], [True, True, False, False, False, False]])
    torch.manual_seed(0)
    draws = [lslm_segmental.chosen_flips(free, 2) for _ in range(4000)]
    # Row 0: 2 of its 4 free bytes each time (weight 2); row 1 has only 2: both, weight 1.
    assert all(chosen.sum(dim=1).tolist() == [2, 2] for chosen, _ in draws)
    assert all(weights.tolist() == [2.0, 1.0] for _, weights in draws)
    frequency = torch.stack([chosen.double() * weights[:, None] for chosen, weights in draws]).mean(0)
    assert torch.allclose(frequency, free.double(), atol=0.05)
    with pytest.raises(ValueError, match="segmental_flips=-1"):
        tiny_lslm(segmental_flips=-1)
