"""Honest compression figures (issue 16, point 2): besides the ratio of the boundaries a training pass
sampled, ConceptMoE and DLCM report the ratio inference's thresholded boundaries give on the same tokens,
ConceptTrainer logs both, and a run's headline ratio (summary table, model card) is the inference one."""

from __future__ import annotations

import pytest
import torch

from hf_concept.training.output import _inference_compression
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
