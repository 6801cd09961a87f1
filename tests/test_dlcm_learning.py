"""DLCM learning paths: the H-Net probability smoothing against its plain loop, the LM loss
reaching the learned router through it, the rule router staying out of the LM loss's reach, and old
configs keeping the W_s form."""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close

from hf_concept.modeling.concept_smoothing import probability_smoothing
from hf_concept.modeling.configuration_dlcm import DLCMConfig
from hf_concept.modeling.modeling_dlcm import DLCMForCausalLM
from hf_concept.reference.smoothing import probability_smoothing_reference

from .test_dlcm_model import BACKBONE, dlcm, ids


def smoothing_inputs(seed: int = 0):
    """Concepts, opening probabilities (1 at document starts), a ragged mask and a cached z̃ per row."""
    generator = torch.Generator().manual_seed(seed)
    concept_states = torch.randn(3, 9, 5, generator=generator, dtype=torch.float64)
    probs = torch.rand(3, 9, generator=generator, dtype=torch.float64)
    probs[:, 4] = 1.0
    probs[2, 0] = 1.0
    concept_mask = torch.arange(9) < torch.tensor([9, 6, 0])[:, None]
    previous = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    has_previous = torch.tensor([True, False, True])
    return concept_states, probs, concept_mask, previous, has_previous


def test_probability_smoothing_matches_the_loop_in_value_and_gradient():
    concept_states, probs, concept_mask, previous, has_previous = smoothing_inputs()
    results = []
    for function in (probability_smoothing, probability_smoothing_reference):
        states = concept_states.clone().requires_grad_(True)
        weights = probs.clone().requires_grad_(True)
        cached = previous.clone().requires_grad_(True)
        output = function(states, weights, concept_mask, cached, has_previous)
        upstream = torch.linspace(-1, 1, output.numel(), dtype=output.dtype).view_as(output)
        (output * upstream).sum().backward()
        results.append((output, states.grad, weights.grad, cached.grad))
    for fast, reference in zip(*results, strict=True):
        assert_close(fast, reference, rtol=0, atol=1e-6)
    output = results[0][0]
    # The backward rule: ∂z̃_m/∂p_m = z_m − z̃_{m−1}; row 0's first concept continues the cached z̃.
    single = torch.zeros_like(output)
    single[0, 0, 1] = 1.0
    weights = probs.clone().requires_grad_(True)
    (
        probability_smoothing(concept_states, weights, concept_mask, previous, has_previous) * single
    ).sum().backward()
    assert_close(weights.grad[0, 0], concept_states[0, 0, 1] - previous[0, 1], rtol=0, atol=1e-12)
    # p = 1 restarts the recurrence: concept 4 forgets every earlier one, in value and in gradient.
    assert_close(output[:2, 4], concept_states[:2, 4], rtol=0, atol=1e-12)
    assert (output[~concept_mask] == 0).all() and (results[0][1][~concept_mask] == 0).all()


def lm_loss_of(model, input_ids):
    """The backbone's outputs (probabilities, boundaries) and the LM cross-entropy alone (no ratio loss)."""
    outputs = model.model(input_ids=input_ids, use_cache=False)
    logits = model.lm_head(outputs.last_hidden_state)
    vocab = model.config.vocab_size
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), input_ids[:, 1:].reshape(-1))
    return outputs, loss


def test_the_lm_loss_reaches_the_learned_router_through_ema_smoothing():
    model = dlcm().train()
    assert model.config.smoothing == "ema" and model.model.smoothing is None
    input_ids = ids(2, 16)
    _, loss = lm_loss_of(model, input_ids)
    loss.backward()
    chunker = model.model.chunker
    for projection in (chunker.boundary_query, chunker.boundary_key):
        assert projection.weight.grad is not None and projection.weight.grad.abs().max() > 0


def test_the_confidence_is_exactly_one_and_every_decision_gets_a_gradient():
    model = dlcm(seed=3)
    input_ids = ids(2, 16)
    with torch.no_grad():
        plain = model(input_ids=input_ids, use_cache=False).logits
    graded = model(input_ids=input_ids, use_cache=False).logits
    # Value exactly 1: a forward that builds the straight-through factor gives the same logits bit for bit.
    assert torch.equal(plain, graded.detach())

    outputs, loss = lm_loss_of(model, input_ids)
    (grad,) = torch.autograd.grad(loss, outputs.boundary_probs)
    # Every token whose output the loss reads (all but the last) gets a gradient on its decision's
    # probability through its confidence, openings through the smoothing weight too.
    assert (grad[:, :-1] != 0).all() and (grad[:, -1] == 0).all()


@pytest.mark.parametrize("smoothing", ["ema", "linear"])
def test_the_rule_router_is_out_of_the_lm_loss_reach(smoothing):
    model = dlcm(router="rule", rule_threshold=0.3, smoothing=smoothing).train()
    input_ids = ids(2, 16)
    outputs, loss = lm_loss_of(model, input_ids)
    # §8.1: boundaries are a threshold on the dissimilarity; nothing of the LM loss flows back into it.
    assert not outputs.boundaries.requires_grad
    with torch.no_grad():
        probs = model.model(input_ids=input_ids).boundary_probs
    assert torch.equal(outputs.boundaries, ((probs > 0.3) | (torch.arange(16) == 0)))
    (grad,) = torch.autograd.grad(loss, outputs.boundary_probs, allow_unused=True)
    assert grad is None


@pytest.mark.parametrize("router", ["cosine", "rule"])
def test_ema_smoothing_decodes_with_the_cache_as_the_full_forward(router):
    model = dlcm(seed=5, router=router, rule_threshold=0.3)
    prompt = ids(2, 7, seed=4)
    greedy = model.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    recomputed = model.generate(
        prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12, use_cache=False
    )
    assert torch.equal(greedy, recomputed)
    with torch.no_grad():
        full = model(input_ids=greedy[:, :-1], use_cache=False).logits
        cache_logits = []
        output = model(input_ids=greedy[:, :7], use_cache=True)
        cache_logits.append(output.logits)
        for position in range(7, greedy.shape[1] - 1):
            output = model(
                input_ids=greedy[:, position : position + 1],
                cache=output.cache,
                use_cache=True,
            )
            cache_logits.append(output.logits)
    assert_close(torch.cat(cache_logits, dim=1), full, rtol=0, atol=2e-5)


def test_a_saved_config_without_the_field_keeps_the_w_s_form(tmp_path):
    model = dlcm(smoothing="linear")
    model.save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    values = json.loads(config_file.read_text())
    del values["smoothing"]
    config_file.write_text(json.dumps(values))
    loaded = DLCMForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.smoothing == "linear"
    input_ids = ids(1, 12)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=input_ids).logits, model(input_ids=input_ids).logits)
    # New configs default to the form the LM loss reaches the router through, and keep it when saved.
    fresh = DLCMConfig(**BACKBONE)
    fresh.save_pretrained(tmp_path / "fresh")
    assert fresh.smoothing == "ema" == DLCMConfig.from_pretrained(tmp_path / "fresh").smoothing
    with pytest.raises(ValueError, match="smoothing='mean'"):
        DLCMConfig(**BACKBONE, smoothing="mean")
