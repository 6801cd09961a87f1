"""LSLM learns to segment: the LM loss reaches every boundary decision through the confidence
estimator, the KL is computed in log space, and inference thresholds at the rate training samples.

Each estimator is checked against its plain reference (`hf_concept.reference.routing`); the model's router
gradient is checked against the same pass with the reference estimator substituted."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from hf_concept.modeling import modeling_lslm
from hf_concept.modeling.configuration_lslm import LSLMConfig
from hf_concept.modeling.lslm_boundary_rules import crosses, rate_matched_ends, rate_units
from hf_concept.modeling.modeling_lslm import LSLMForCausalLM
from hf_concept.modeling.routing import bernoulli_kl_from_logits, binomial_prior_nll, decision_confidence
from hf_concept.modeling.tokenization_lslm import ByteTokenizer
from hf_concept.reference.routing import bernoulli_kl_reference, decision_confidence_reference

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    token_encoder_layers=1,
    segment_encoder_layers=1,
    decoder_layers=1,
    token_hidden_size=16,
    token_num_attention_heads=2,
    decoder_hidden_size=24,
    decoder_num_attention_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
)
TEXT = ["the cat sat on the mat, and the dog ran off.", "猫が座った。"]


def tiny_lslm(seed: int = 0, **overrides) -> LSLMForCausalLM:
    torch.manual_seed(seed)
    return LSLMForCausalLM(LSLMConfig(**{**TINY, **overrides}))


def batch() -> dict[str, torch.Tensor]:
    encoded = ByteTokenizer()(TEXT, padding=True, return_tensors="pt")
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


@pytest.fixture
def fixed_noise(monkeypatch):
    """Gumbel noises drawn once per shape from a fixed seed, so two passes take the same decisions."""
    drawn: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    original = modeling_lslm.sample_gumbel_noise

    def noise(shape, generator=None, device=None, dtype=torch.float32):
        if shape not in drawn:
            drawn[shape] = original(shape, torch.Generator().manual_seed(7), device, dtype)
        return drawn[shape]

    monkeypatch.setattr(modeling_lslm, "sample_gumbel_noise", noise)


def test_decision_confidence_is_one_and_its_gradient_follows_the_decision():
    torch.manual_seed(0)
    relaxed = torch.rand(3, 11, requires_grad=True)
    ends = torch.rand(3, 11) < 0.4
    free = torch.rand(3, 11) < 0.8
    weights = torch.randn(3, 11)
    confidence = decision_confidence(relaxed, ends, free)
    assert torch.equal(confidence, torch.ones(3, 11))
    (gradient,) = torch.autograd.grad((confidence * weights).sum(), relaxed)
    reference = decision_confidence_reference(relaxed, ends, free)
    (expected,) = torch.autograd.grad((reference * weights).sum(), relaxed)
    torch.testing.assert_close(gradient, expected, atol=1e-6, rtol=0)
    sign = torch.where(ends, 1.0, -1.0) * free
    torch.testing.assert_close(gradient, sign * weights, atol=0, rtol=0)


def test_kl_matches_the_probability_form_and_keeps_a_gradient_at_saturated_logits():
    logits = torch.linspace(-12, 12, 97)
    for prior in (0.2, 0.7):
        torch.testing.assert_close(
            bernoulli_kl_from_logits(logits, prior).double(),
            bernoulli_kl_reference(logits, prior),
            atol=1e-5,
            rtol=1e-5,
        )
    extreme = torch.tensor([-30.0, 30.0], requires_grad=True)
    (gradient,) = torch.autograd.grad(bernoulli_kl_from_logits(extreme, 0.7).sum(), extreme)
    # d KL / d l = q (1 − q) (l − logit p): tiny at |l| = 30, but finite and of the right sign.
    q = torch.sigmoid(extreme.detach().double())
    analytic = q * (1 - q) * (extreme.detach().double() - torch.logit(torch.tensor(0.7).double()))
    assert torch.isfinite(gradient).all() and (gradient != 0).all()
    torch.testing.assert_close(gradient.double(), analytic, rtol=1e-2, atol=0)


def router_logit_gradients(model: LSLMForCausalLM) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(gradient of the LM loss w.r.t. the router's logits (B, T) in view order, free-byte mask,
    parameter gradients of the router) for one training pass with kl_weight 0."""
    captured = {}
    router = model.model.router
    handle = router.register_forward_hook(
        lambda module, inputs, output: captured.update(logits=output) or output.retain_grad()
    )
    original_segment = model.model.segment

    def segment(view, token_states):
        segmentation = original_segment(view, token_states)
        captured["free"] = view.mask & ~segmentation.forced
        return segmentation

    model.model.segment = segment
    try:
        model.train()
        model.zero_grad()
        output = model(**batch(), labels=batch()["input_ids"])
        output.loss.backward()
    finally:
        handle.remove()
        del model.model.segment
    grads = {name: parameter.grad.clone() for name, parameter in router.named_parameters()}
    return captured["logits"].grad, captured["free"], grads


def test_the_lm_loss_reaches_the_router_at_every_free_byte(fixed_noise):
    model = tiny_lslm(kl_weight=0.0, boundary_estimator="confidence")
    logit_grad, free, parameter_grads = router_logit_gradients(model)
    assert free.sum() > 20
    # Every free byte's decision, closing or not, has a gradient from the LM loss alone.
    assert (logit_grad[free] != 0).all(), f"{int((logit_grad[free] == 0).sum())} free bytes got none"
    assert all(bool(gradient.abs().sum() > 0) for gradient in parameter_grads.values())


def test_router_gradients_match_the_reference_estimator(fixed_noise, monkeypatch):
    model = tiny_lslm(kl_weight=0.0, boundary_estimator="confidence")
    _, _, fast = router_logit_gradients(model)
    monkeypatch.setattr(modeling_lslm, "decision_confidence", decision_confidence_reference)
    _, _, reference = router_logit_gradients(model)
    for name in fast:
        torch.testing.assert_close(fast[name], reference[name], atol=1e-6, rtol=0)


def test_the_estimator_leaves_the_forward_value_unchanged(fixed_noise, monkeypatch):
    model = tiny_lslm(boundary_estimator="confidence").train()
    with torch.no_grad():
        with_estimator = model(**batch(), labels=batch()["input_ids"])
        monkeypatch.setattr(
            modeling_lslm, "decision_confidence", lambda relaxed, ends, free: torch.ones_like(relaxed)
        )
        plain = model(**batch(), labels=batch()["input_ids"])
    assert torch.equal(with_estimator.logits, plain.logits)
    assert torch.equal(with_estimator.loss, plain.loss)


def test_the_rate_rule_closes_as_many_bytes_as_training_samples_on_any_text():
    torch.manual_seed(0)
    probs = torch.rand(4, 300) ** torch.tensor([[0.2], [1.0], [3.0], [8.0]])  # four rates
    counted = torch.rand(4, 300) < 0.9
    starts = torch.zeros(4, 300, dtype=torch.bool)
    starts[:, 0] = True
    ends = rate_matched_ends(probs, counted, starts)
    expected = (probs * counted).sum(dim=1)
    assert ((ends.sum(dim=1) - expected).abs() <= 1).all(), (ends.sum(dim=1), expected)
    assert not (ends & ~counted).any()
    # A sure router keeps its decisions.
    sure = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0, 0.0]])
    assert torch.equal(rate_matched_ends(sure, sure >= 0, starts[:1, :6]), sure.bool())


def test_the_rate_rule_restarts_per_document_and_steps_as_the_parallel_pass():
    torch.manual_seed(1)
    probs = torch.rand(3, 40)
    counted = torch.ones(3, 40, dtype=torch.bool)
    starts = torch.zeros(3, 40, dtype=torch.bool)
    starts[:, 0] = True
    starts[1, 17] = True
    parallel = rate_matched_ends(probs, counted, starts)
    first_only = torch.zeros(1, 23, dtype=torch.bool)
    first_only[0, 0] = True
    alone = rate_matched_ends(probs[1:2, 17:], counted[1:2, 17:], first_only)
    assert torch.equal(parallel[1:2, 17:], alone)
    running, stepped = torch.zeros(1, dtype=torch.long), []
    for column in range(40):  # row 0, one column at a time as generation does
        units = rate_units(probs[0:1, column], counted[0:1, column])
        stepped.append(crosses(running, running + units))
        running = running + units
    assert torch.equal(torch.cat(stepped), parallel[0])


def test_inference_closes_at_the_rate_training_samples():
    model = tiny_lslm()
    model.train()
    with torch.no_grad():
        trained = model(**batch())
    # Training draws Bernoulli(q_t): its rate tracks the mean q.
    assert abs(float(trained.boundary_rate) - float(trained.expected_boundary_rate)) < 0.2
    assert abs(float(trained.inference_boundary_rate) - float(trained.expected_boundary_rate)) < 0.05
    model.eval()
    with torch.no_grad():
        evaluated = model(**batch())
    assert float(evaluated.boundary_rate) == pytest.approx(float(evaluated.expected_boundary_rate), abs=0.05)
    threshold = tiny_lslm(boundary_rule="threshold", boundary_threshold=0.99).eval()
    with torch.no_grad():
        assert float(threshold(**batch()).boundary_rate) == 0.0


def test_defaults_follow_the_paper_and_an_unreachable_threshold_warns(caplog):
    config = LSLMConfig()
    # Joint updates (0) are the project's default, not the paper's k = 1 interleaving.
    assert (config.prior_mean, config.kl_weight, config.update_schedule) == (0.7, 1.0, 0)
    assert (config.boundary_rule, config.prior_loss) == ("rate", "beta_binomial")
    with caplog.at_level(logging.WARNING):
        LSLMConfig(prior_mean=0.2, boundary_threshold=0.5, boundary_rule="threshold")
    assert "inference would close almost no segment" in caplog.text
    assert "prior_mean=0.2" in caplog.text
    with pytest.raises(ValueError, match="boundary_rule='sample'"):
        LSLMConfig(boundary_rule="sample")
    with pytest.raises(ValueError, match="prior_loss='binomal'"):
        LSLMConfig(prior_loss="binomal")


def test_binomial_prior_is_dtps_count_likelihood_with_a_digamma_gradient():
    counts = torch.tensor([0.0, 3.0, 7.0, 10.0], requires_grad=True)
    totals = torch.tensor([10.0, 10.0, 10.0, 10.0])
    nll = binomial_prior_nll(counts, totals, 0.7)
    expected = -torch.distributions.Binomial(10, probs=torch.tensor(0.7)).log_prob(counts.detach())
    torch.testing.assert_close(nll, expected, atol=1e-5, rtol=1e-5)
    (gradient,) = torch.autograd.grad(nll.sum(), counts)
    k = counts.detach()
    analytic = torch.digamma(k + 1) - torch.digamma(totals - k + 1) - math.log(0.7 / 0.3)
    torch.testing.assert_close(gradient, analytic, atol=1e-5, rtol=1e-5)
    # The most likely count, p·n = 7, is where the gradient changes sign.
    assert gradient[1] < 0 < gradient[3]
