"""LSLM's `boundary_source`: "every" (one byte per segment) and "random" (fixed hashed ends at the prior
mean) decide the ends without the router, so that the hierarchy can be measured apart from it. The
conformance suite runs both (exact cache, padding, causality); here: what they decide, against the
column-by-column reference, and that the LM loss no longer reaches the router."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from hf_concept.modeling.lslm_boundary_rules import random_ends
from hf_concept.reference.lslm import reference_logits
from tests.test_lslm_generation import random_row
from tests.test_lslm_model import encode, lslm


def test_random_ends_hold_the_rate_depend_on_rank_and_seed_only():
    ranks = torch.arange(20000)
    ends = random_ends(ranks, seed=0, rate=0.3)
    assert abs(float(ends.float().mean()) - 0.3) < 0.01
    assert torch.equal(ends, random_ends(ranks, seed=0, rate=0.3))
    other = random_ends(ranks, seed=1, rate=0.3)
    assert 0.3 < float((ends != other).float().mean()) < 0.5  # independent draws: 2·0.3·0.7 = 0.42
    assert not random_ends(ranks, 0, 0.0).any() and random_ends(ranks, 0, 1.0).all()
    # A rank decides alone: the ends of ranks 100.. are those of the full run from 100 on.
    assert torch.equal(random_ends(ranks[100:], 0, 0.3), ends[100:])


@pytest.mark.parametrize("source", ["every", "random"])
def test_the_source_decides_and_the_loop_reference_agrees(source):
    model = lslm(attn="eager", boundary_source=source, prior_mean=0.4)
    input_ids = random_row(torch.Generator().manual_seed(4), 30)
    with torch.no_grad():
        out = model(input_ids, labels=input_ids)
    expected_logits, expected_loss = reference_logits(model, input_ids, torch.arange(30)[None])
    assert_close(out.logits[0], expected_logits, atol=1e-5, rtol=1e-5)
    assert_close(out.lm_loss, expected_loss, atol=1e-5, rtol=1e-5)
    is_byte = (input_ids != 3) & (input_ids != 4)
    opens = out.boundaries[is_byte]
    if source == "every":
        assert opens.all()
    else:
        assert 0 < float(opens.float().mean()) < 1


@pytest.mark.parametrize("source", ["every", "random"])
def test_the_logits_do_not_reach_the_router(source):
    model = lslm(boundary_source=source).train()
    batch = encode("a few words of text", "and some more of it")
    torch.manual_seed(0)
    # The logits carry everything the LM loss is built from (`lm_loss` itself is a detached figure).
    model(**batch).logits.sum().backward()
    router = [parameter.grad for parameter in model.model.router.parameters()]
    assert all(grad is None or grad.abs().sum() == 0 for grad in router)
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0
    # The same with the router deciding: its decisions get the LM loss's gradient.
    model = lslm().train()
    torch.manual_seed(0)
    model(**batch).logits.sum().backward()
    assert sum(parameter.grad.abs().sum() for parameter in model.model.router.parameters()) > 0
