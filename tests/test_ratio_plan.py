"""The planned optimizer step of the global ratio scope (modeling/ratio_step.py): the planning pass stops
at the router, the training forwards replay the decisions it drew, every micro-batch sees the step's
boundary fraction from the first one on, and a plan used out of order is refused by name."""

from __future__ import annotations

import pytest
import torch

from hf_concept.modeling.ratio_step import RatioAccumulator, plan_ratio_step
from hf_concept.modeling.routing import ratio_loss_from_fractions
from tests.test_ratio_scopes import build

FAMILIES = ("conceptmoe", "dlcm")


def micro_batches(count: int = 3, rows: int = 2, length: int = 20) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(count):
        input_ids = torch.randint(3, 200, (rows, length), generator=generator)
        batches.append({"input_ids": input_ids, "labels": input_ids})
    return batches


def planned_model(family: str, batches: list[dict], **overrides):
    model = build(
        family, ratio_scope="global", compression_ratio=4.0, boundary_noise="bernoulli", **overrides
    )
    model.train()
    model.ratio_accumulator = RatioAccumulator(len(batches))
    model.ratio_accumulator.reset(step_token_count=sum(batch["input_ids"].numel() for batch in batches))
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_the_planning_pass_stops_at_the_router(family):
    batches = micro_batches()
    model = planned_model(family, batches)
    calls = []
    for layer in model.model.decoder_layers:
        layer.register_forward_hook(lambda *args: calls.append(1))
    assert plan_ratio_step(model, batches)
    assert not calls, "the planning pass ran the decoder: it must end at the boundary decisions"
    assert len(model.ratio_accumulator.planned_boundaries) == len(batches)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_forwards_replay_the_planned_decisions_and_see_the_step_fraction(family):
    batches = micro_batches()
    model = planned_model(family, batches)
    torch.manual_seed(0)
    plan_ratio_step(model, batches)
    accumulator = model.ratio_accumulator
    planned = [decisions.clone() for decisions in accumulator.planned_boundaries]
    boundaries, probs_total, tokens = accumulator.planned_counts.tolist()
    # Sampled decisions: a fresh draw would differ (the generator moved on), the replay must not.
    shares = []
    for batch, decisions in zip(batches, planned, strict=True):
        outputs = model(**batch, num_items_in_batch=torch.tensor(1))
        shares.append(outputs.aux_loss)
        opens = round(batch["input_ids"].numel() / float(outputs.compression_ratio))
        assert opens == int(decisions.sum())
    assert not accumulator.planned_boundaries, "every planned micro-batch was used"
    # A fresh draw differs from the plan somewhere: the equality above is the replay, not chance.
    model.ratio_accumulator = None
    fresh = [model.model(input_ids=batch["input_ids"]).boundaries for batch in batches]
    assert any(not torch.equal(draw, decisions) for draw, decisions in zip(fresh, planned, strict=True))
    # The step's counts over the micro-batches equal the plan's, and the shares add up to the step's loss.
    torch.testing.assert_close(
        accumulator.running_counts[[0, 2]], torch.tensor([boundaries, tokens], dtype=torch.float64)
    )
    expected = ratio_loss_from_fractions(
        torch.tensor(boundaries / tokens), torch.tensor(probs_total / tokens), 4.0
    )
    torch.testing.assert_close(sum(shares).double(), expected.double(), rtol=1e-5, atol=1e-6)


def test_a_micro_batch_beyond_the_plan_or_of_another_shape_is_refused():
    batches = micro_batches(count=2)
    model = planned_model("conceptmoe", batches)
    plan_ratio_step(model, batches)
    other = torch.randint(3, 200, (2, 12))
    with pytest.raises(ValueError, match=r"shape \(2, 12\) but the plan has \(2, 20\)"):
        model(input_ids=other, labels=other)

    model = planned_model("conceptmoe", batches)
    model.ratio_accumulator.num_micro_batches = 3
    plan_ratio_step(model, batches)
    for batch in batches:
        model(**batch)
    with pytest.raises(ValueError, match="planned micro-batches were used up"):
        model(**batches[0])


def test_fixed_chunking_makes_no_plan_and_a_new_step_drops_the_old_one():
    batches = micro_batches(count=1)
    model = planned_model("conceptmoe", batches, chunking="fixed")
    assert plan_ratio_step(model, batches) is False
    assert model.ratio_accumulator.planned_boundaries is None

    model = planned_model("conceptmoe", batches)
    assert plan_ratio_step(model, batches)
    model.ratio_accumulator.reset()
    assert (
        model.ratio_accumulator.planned_boundaries is None and model.ratio_accumulator.planned_counts is None
    )
    # Without a plan the step draws as before: a forward runs.
    assert model(**batches[0]).loss.isfinite()
