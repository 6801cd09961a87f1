"""ConceptMoE's dechunk EMA weight (`dechunk_ema`): the paper's p_m, or 1 in value with p_m's gradient."""

from __future__ import annotations

import pytest
import torch

from hf_concept.modeling import modeling_conceptmoe
from hf_concept.modeling.configuration_conceptmoe import ConceptMoEConfig
from tests.conformance.families import _conceptmoe_config


def spied_weights(model, input_ids, monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weights, valid) of each call of the dechunk EMA in one forward."""
    seen = []
    original = modeling_conceptmoe.probability_smoothing

    def spy(concepts, weights, valid, *rest):
        seen.append((weights, valid))
        return original(concepts, weights, valid, *rest)

    monkeypatch.setattr(modeling_conceptmoe, "probability_smoothing", spy)
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    return seen


def test_straight_through_weights_are_one_in_value_and_carry_the_router_gradient(monkeypatch):
    torch.manual_seed(0)
    ids = torch.randint(3, 97, (2, 24))
    results = {}
    for form in ("probability", "straight_through"):
        torch.manual_seed(1)
        model = modeling_conceptmoe.ConceptMoEForCausalLM(_conceptmoe_config(dechunk_ema=form)).train()
        torch.manual_seed(2)
        ((weights, valid),) = spied_weights(model, ids, monkeypatch)
        router = [p.grad for name, p in model.named_parameters() if ".chunker." in f".{name}."]
        results[form] = (weights.detach(), valid, router)
    probs, valid, _ = results["probability"]
    weights, same_valid, router = results["straight_through"]
    assert torch.equal(valid, same_valid)
    # The paper's weights are the openings' probabilities (below 1 for a random router's free openings).
    assert bool((probs[valid] < 1).any())
    assert torch.equal(weights[valid], torch.ones_like(weights[valid]))
    assert any(grad is not None and bool(grad.abs().sum() > 0) for grad in router)


def test_the_straight_through_weight_passes_the_probabilitys_gradient():
    probs = torch.tensor([[0.3, 0.7, 0.9]], requires_grad=True)
    valid = torch.tensor([[True, True, False]])
    weights = modeling_conceptmoe.straight_through(probs, valid)
    assert torch.equal(weights, torch.ones_like(weights))
    (weights * torch.tensor([[2.0, 3.0, 5.0]])).sum().backward()
    # d/dp of the weight is +1 where the concept is real (its opening's probability), −1 elsewhere.
    assert torch.equal(probs.grad, torch.tensor([[2.0, 3.0, -5.0]]))


def test_dechunk_ema_is_validated():
    assert ConceptMoEConfig().dechunk_ema == "probability"
    with pytest.raises(ValueError, match="dechunk_ema"):
        _conceptmoe_config(dechunk_ema="none")


def test_straight_through_ema_keeps_cached_decoding_and_padding_exact():
    """The conversion's form (ranked decisions, straight-through EMA): token-by-token cached logits equal
    one full forward, and a left-padded row equals the row alone."""
    from hf_concept.modeling.transformers_compat import cache_kwarg
    from tests.conformance.families import _conceptmoe_rank_window_config

    torch.manual_seed(0)
    model = modeling_conceptmoe.ConceptMoEForCausalLM(
        _conceptmoe_rank_window_config(dechunk_ema="straight_through")
    ).eval()
    ids = torch.randint(3, 97, (1, 14))
    with torch.no_grad():
        full = model(input_ids=ids).logits
        cache = model.model.new_cache()
        steps = [model(input_ids=ids[:, :5], use_cache=True, **cache_kwarg(cache)).logits]
        for column in range(5, ids.shape[1]):
            steps.append(
                model(input_ids=ids[:, column : column + 1], use_cache=True, **cache_kwarg(cache)).logits
            )
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
        padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], dim=1)
        mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones_like(ids)], dim=1)
        alone = model(input_ids=padded, attention_mask=mask).logits[:, 4:]
        torch.testing.assert_close(alone, full, atol=1e-5, rtol=0)
