"""LSLM's objective as the paper writes it (eq. 4), selectable: the per-byte KL to the Beta prior
(`prior_loss="beta_kl"`, the KL expected under the Beta) and the `<nxt>` cross-entropy as an option
(`segment_end_loss`)."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

from hf_concept.data.synthetic_words import SyntheticWords
from hf_concept.modeling.configuration_lslm import LSLMConfig
from hf_concept.modeling.lslm_estimators import beta_expected_kl
from hf_concept.modeling.lslm_loss import label_targets
from hf_concept.modeling.modeling_lslm import LSLMForCausalLM
from hf_concept.modeling.routing import bernoulli_kl_from_logits
from hf_concept.reference.lslm import beta_expected_kl_reference
from tests.benchmark_scripts import load_benchmark
from tests.test_lslm_learning import TINY, batch, tiny_lslm

SHAPES = [(25.0, 75.0), (0.7, 0.3), (2.0, 6.0), (700.0, 300.0)]


@pytest.mark.parametrize(("alpha", "beta"), SHAPES)
def test_beta_expected_kl_matches_the_reference_in_value_and_gradient(alpha, beta):
    logits = torch.linspace(-12, 12, 97, dtype=torch.float64, requires_grad=True)
    fast, reference = beta_expected_kl(logits, alpha, beta), beta_expected_kl_reference(logits, alpha, beta)
    torch.testing.assert_close(fast, reference, rtol=1e-12, atol=1e-12)
    weights = torch.randn(97, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    (gradient,) = torch.autograd.grad((fast * weights).sum(), logits)
    (expected,) = torch.autograd.grad((reference * weights).sum(), logits)
    torch.testing.assert_close(gradient, expected, rtol=1e-10, atol=1e-12)
    probe = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: beta_expected_kl(x, alpha, beta), (probe,))
    # The backward rule of the docstring: q (1 − q) (l − (ψ(a) − ψ(b))).
    q = torch.sigmoid(logits.detach())
    shift = float(torch.special.digamma(torch.tensor([alpha, beta], dtype=torch.float64)).diff().neg())
    torch.testing.assert_close(
        gradient, weights * q * (1 - q) * (logits.detach() - shift), rtol=1e-9, atol=1e-12
    )


def test_beta_expected_kl_is_the_kl_averaged_over_the_beta_and_keeps_a_gradient_when_saturated():
    """E_π[KL(q ‖ π)] integrated over the Beta(7, 3) density on a midpoint grid; it exceeds the KL to the
    marginal Bernoulli(0.7) ("kl") by Jensen, and a float32 logit of ±30 still has a finite gradient."""
    alpha, beta = 7.0, 3.0
    pi = (torch.arange(400_000, dtype=torch.float64) + 0.5) / 400_000
    density = torch.exp(
        (alpha - 1) * torch.log(pi)
        + (beta - 1) * torch.log1p(-pi)
        - (math.lgamma(alpha) + math.lgamma(beta) - math.lgamma(alpha + beta))
    )
    logits = torch.tensor([-3.0, -0.2, 0.8, 4.0], dtype=torch.float64)
    q = torch.sigmoid(logits)[:, None]
    kl = q * torch.log(q / pi) + (1 - q) * torch.log((1 - q) / (1 - pi))
    integrated = (kl * density).mean(dim=1)
    torch.testing.assert_close(beta_expected_kl(logits, alpha, beta), integrated, rtol=1e-6, atol=1e-9)
    assert bool((beta_expected_kl(logits, alpha, beta) > bernoulli_kl_from_logits(logits, 0.7)).all())
    extreme = torch.tensor([-30.0, 30.0], requires_grad=True)
    (gradient,) = torch.autograd.grad(beta_expected_kl(extreme, alpha, beta).sum(), extreme)
    assert torch.isfinite(gradient).all() and (gradient != 0).all()
    assert gradient[0] < 0 < gradient[1]


def test_the_model_adds_the_expected_kl_of_every_free_byte():
    """loss(beta_kl) − loss(prior weight 0) = β · Σ over free bytes of the expected KL / predicted bytes."""
    captured = {}
    outputs = {}
    for weight in (0.0, 2.0):
        model = tiny_lslm(prior_loss="beta_kl", kl_weight=weight, prior_mean=0.25, prior_concentration=8.0)
        segment = model.model.segment

        def keep(view, token_states, segment=segment):
            captured["segmentation"] = segmentation = segment(view, token_states)
            captured["free"] = view.mask & ~segmentation.forced
            return segmentation

        model.model.segment = keep
        ids, mask = batch()["input_ids"], batch()["attention_mask"]
        with torch.no_grad():
            outputs[weight] = model.eval()(
                input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)
            )
    kl = beta_expected_kl(captured["segmentation"].logits, 2.0, 6.0)[captured["free"]]
    predicted = int((mask[:, 1:] == 1).sum())
    difference = outputs[2.0].loss - outputs[0.0].loss
    assert float(difference) == pytest.approx(2.0 * float(kl.sum()) / predicted, rel=1e-5)
    assert float(outputs[2.0].kl_loss) == pytest.approx(float(kl.mean()), rel=1e-5)


def segment_end_term(model: LSLMForCausalLM, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The `<nxt>` markers' summed cross-entropy of one pass, computed apart from the loss."""
    layout = model.model.parallel_pass(ids, mask)
    labels = ids.masked_fill(mask == 0, -100)
    targets = label_targets(layout, labels, model.config.segment_end_token_id)
    logits = model.lm_head(layout.slot_states).double()
    ends = targets == model.config.segment_end_token_id
    assert int(ends.sum()) > 5
    return F.cross_entropy(logits[ends], targets[ends], reduction="sum")


@pytest.mark.parametrize("training", [False, True])
def test_without_the_segment_end_term_the_objective_drops_exactly_the_nxt_cross_entropy(training):
    """Same weights, same sample: loss(on) − loss(off) = the `<nxt>` cross-entropy / predicted bytes."""
    ids, mask = batch()["input_ids"], batch()["attention_mask"]
    losses = {}
    for segment_end_loss in (True, False):
        model = tiny_lslm(segment_end_loss=segment_end_loss).double().train(training)
        with torch.no_grad():
            torch.manual_seed(3)
            losses[segment_end_loss] = model(
                input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)
            )
            torch.manual_seed(3)
            term = segment_end_term(model, ids, mask)
    predicted = int((mask[:, 1:] == 1).sum())
    assert torch.equal(losses[True].boundaries, losses[False].boundaries)
    difference = losses[True].loss - losses[False].loss
    assert abs(float(difference) - float(term) / predicted) < 1e-6
    assert float(losses[True].bits_per_byte) == pytest.approx(float(losses[False].bits_per_byte), rel=1e-12)


def test_segment_end_loss_is_validated_and_a_config_saved_without_it_keeps_the_term(tmp_path):
    # Off by default (eq. 4 as written); on where a saved config says so or predates the field.
    assert LSLMConfig().segment_end_loss is False
    for value in ("no", 0, None):
        with pytest.raises(ValueError, match="segment_end_loss"):
            LSLMConfig(**TINY, segment_end_loss=value)
    for given in ({}, {"segment_end_loss": False}):
        with pytest.raises(ValueError, match=r"segment_end_loss=False.*pass segment_end_loss=True"):
            LSLMConfig(**TINY, **given, boundary_estimator="straight_through_targets")
    assert LSLMConfig(**TINY, segment_end_loss=True, boundary_estimator="straight_through_targets")
    for dropped in (("segment_end_loss",), ("segment_end_loss", "boundary_estimator", "prior_loss")):
        saved = LSLMConfig(**TINY).to_dict()
        for field in dropped:
            saved.pop(field)
        (tmp_path / "config.json").write_text(json.dumps(saved))
        assert LSLMConfig.from_pretrained(tmp_path).segment_end_loss is True
    for value in (False, True):
        LSLMConfig(**TINY, segment_end_loss=value).save_pretrained(tmp_path)
        assert LSLMConfig.from_pretrained(tmp_path).segment_end_loss is value
    LSLMConfig(**TINY).save_pretrained(tmp_path)
    assert LSLMConfig.from_pretrained(tmp_path).segment_end_loss is False
    for field, value in (("prior_loss", "beta_kl"), ("boundary_estimator", "segmental")):
        assert getattr(LSLMConfig(**TINY, **{field: value}), field) == value
    with pytest.raises(ValueError, match="prior_loss='beta'"):
        LSLMConfig(**TINY, prior_loss="beta")


@pytest.mark.slow
def test_training_under_beta_kl_keeps_the_mean_q_at_the_prior_mean():
    """600 steps on the synthetic word language (a tiny LSLM, prior mean at the word-start rate 0.25,
    concentration 100, β = 1): the mean q over held-out bytes stays within 0.05 of the prior mean, where
    the expected KL has its optimum (σ(ψ(25) − ψ(75)) = 0.247). About 10 s on one thread."""
    script = load_benchmark("lslm_synthetic")
    argv = ["--steps", "600", "--width", "32", "--layers", "1,1,1", "--context", "64", "--batch-size", "8"]
    args = script.parse_args([*argv, "--set", 'prior_loss="beta_kl"'])
    language = SyntheticWords(seed=0)
    torch.manual_seed(0)
    model = script.lslm_model(args, prior_mean=0.25)
    script.train(model, args, language, random.Random(0), model.config.update_schedule)
    heldout = script.rows_of(
        script.sample_rows(language, 32, args.context, random.Random(10_000)), args.context
    )
    with torch.no_grad():
        rate = float(model.eval()(input_ids=heldout, labels=heldout).expected_boundary_rate)
    assert abs(rate - 0.25) <= 0.05, rate
