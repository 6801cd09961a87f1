"""Honest compression figures: besides the ratio of the boundaries a training pass
sampled, ConceptMoE and DLCM report the ratio inference's thresholded boundaries give on the same tokens,
ConceptTrainer logs both, and a run's headline ratio (summary table, model card) is the inference one."""

from __future__ import annotations

import pytest
import torch

from hf_concept.modeling.routing import boundary_decisions, expected_boundaries
from hf_concept.training.output import _inference_compression, _sampled_compression
from tests.conformance.families import _conceptmoe_class, _conceptmoe_config, _dlcm_class, _dlcm_config

FAMILIES = {
    "conceptmoe": (_conceptmoe_class, _conceptmoe_config),
    "dlcm": (_dlcm_class, _dlcm_config),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_training_reports_the_ratio_inference_would_realise(family):
    model_class, config = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class()(config())
    input_ids = torch.randint(5, 97, (3, 48))
    model.train()
    with torch.no_grad():
        trained = model(input_ids=input_ids, labels=input_ids)
    model.eval()
    with torch.no_grad():
        inferred = model(input_ids=input_ids, labels=input_ids)
    # Same router probabilities (no dropout): the training pass's inference ratio is the eval pass's ratio.
    assert float(trained.inference_compression_ratio) == pytest.approx(float(inferred.compression_ratio))
    assert float(inferred.inference_compression_ratio) == float(inferred.compression_ratio)
    # The sampled ratio is another quantity: it moves from pass to pass, the inference one does not.
    model.train()
    with torch.no_grad():
        passes = [model(input_ids=input_ids, labels=input_ids) for _ in range(4)]
    assert len({float(output.inference_compression_ratio) for output in passes}) == 1
    if model.config.boundary_noise != "none":
        assert len({float(output.compression_ratio) for output in passes}) > 1


def test_the_headline_ratio_is_the_inference_one():
    history = [{"compression_ratio": 3.9, "inference_compression_ratio": 1.7, "step": 10}]
    assert _inference_compression({}, history) == 1.7
    assert _inference_compression({"eval_compression_ratio": 1.8}, history) == 1.8
    assert _inference_compression({}, [{"compression_ratio": 2.0}]) == 2.0
    assert _inference_compression({}, []) is None


@pytest.mark.parametrize("noise", ["bernoulli", "gaussian", "none"])
def test_expected_boundaries_are_the_mean_of_the_sampled_ones(noise):
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(2, 40, generator=generator)
    starts = torch.zeros(2, 40, dtype=torch.bool)
    starts[:, 0] = starts[1, 17] = True
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, :3] = False
    probs = torch.where(starts, 1.0, probs).masked_fill(~mask, 0.0)
    settings = dict(noise=noise, threshold=0.5, tau=3.0, sigma=0.2)
    expected = expected_boundaries(probs, starts, mask, **settings)
    draws = torch.stack(
        [
            boundary_decisions(probs, starts, mask, training=True, generator=generator, **settings).float()
            for _ in range(4000)
        ]
    )
    # 4000 draws: the standard error of a frequency is at most 0.008; 0.04 is five of them.
    assert (draws.mean(0) - expected).abs().max() < 0.04
    assert (expected[starts & mask] == 1).all() and (expected[~mask] == 0).all()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_evaluation_reports_the_sampled_rate_deterministically(family):
    model_class, config = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class()(config()).eval()
    input_ids = torch.randint(5, 97, (3, 48))
    with torch.no_grad():
        outputs = model(input_ids=input_ids, labels=input_ids)
        again = model(input_ids=input_ids, labels=input_ids)
        model.train()
        sampled = [float(model(input_ids=input_ids, labels=input_ids).compression_ratio) for _ in range(200)]
    assert float(outputs.sampled_compression_ratio) == float(again.sampled_compression_ratio)
    # Tokens / expected boundaries is the training rate: the sampled passes' boundary counts average to it.
    tokens = input_ids.numel()
    mean_concepts = sum(tokens / ratio for ratio in sampled) / len(sampled)
    assert tokens / mean_concepts == pytest.approx(float(outputs.sampled_compression_ratio), rel=0.03)


def test_the_card_and_summary_carry_both_rates():
    history = [{"compression_ratio": 3.9, "inference_compression_ratio": 1.7, "step": 10}]
    assert _sampled_compression({}, history) == 3.9
    assert _sampled_compression({"eval_sampled_compression_ratio": 3.5}, history) == 3.5
    # LSLM: the inference rate is a boundary rate; the headline is bytes per segment.
    assert _inference_compression({}, [{"compression_ratio": 3.0, "inference_boundary_rate": 0.25}]) == 4.0
    assert _sampled_compression({}, [{"compression_ratio": 2.0}]) is None
