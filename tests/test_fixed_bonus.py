"""`boundary_fixed_bonus`: a learned router held near fixed chunks — what the bonus opens, that the ratio
hold measures the same scores the forward decides on, that a cached continuation decides as a full
forward does, and the configs it cannot mean."""

from __future__ import annotations

import pytest
import torch

from hf_concept.modeling.concept_chunking import fixed_boundaries
from hf_concept.modeling.configuration_conceptmoe import ConceptMoEConfig
from hf_concept.training.ratio_hold import RatioHold, router_inputs
from tests.test_concept_ranking import language_batches, tokens_per_concept, two_language_model


def fixed_opens(input_ids: torch.Tensor, ratio: int = 2) -> torch.Tensor:
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    real = torch.ones_like(input_ids, dtype=torch.bool)
    return fixed_boundaries(positions, positions == 0, real, ratio)


def opens_of(bonus: float, input_ids: torch.Tensor) -> torch.Tensor:
    model = two_language_model(32)
    model.config.boundary_fixed_bonus = bonus
    model.config.boundary_threshold = 0.5
    with torch.no_grad():
        return model.model(input_ids=input_ids).boundaries


def test_a_large_bonus_opens_every_fixed_chunk_and_none_moves_the_router_alone():
    """Bonus 10 (above any probability gap): every token fixed chunks open opens, and at most a few
    others; bonus 0: the router's own layout, about half of it off the fixed one (language B)."""
    batch = language_batches()["B"]
    fixed = fixed_opens(batch)
    held = opens_of(10.0, batch)
    assert bool((held | ~fixed).all())
    assert float((held & ~fixed).float().mean()) < 0.02
    free = opens_of(0.0, batch)
    assert float((free == fixed).float().mean()) < 0.8
    # A small bonus lies between: closer to fixed chunks than the router alone, not equal to them.
    nudged = opens_of(0.1, batch)
    agreement = float((nudged == fixed).float().mean())
    assert float((free == fixed).float().mean()) < agreement < 1.0


def test_the_ratio_hold_measures_the_scores_the_forward_decides_on():
    model = two_language_model(32)
    model.config.boundary_fixed_bonus = 0.1
    batch = torch.cat(list(language_batches().values()))
    model.train()
    with torch.no_grad():
        scores = model.model(input_ids=batch).boundary_scores
    measured, _, _ = router_inputs(model.model, input_ids=batch)
    assert torch.equal(measured, scores)
    hold = RatioHold(model, 2.0)
    model(input_ids=batch, labels=batch)
    hold.update()
    hold.remove()
    model.eval()
    assert abs(tokens_per_concept(model, batch) / 2.0 - 1) < 0.05


@pytest.mark.parametrize("cut", [1, 7, 40])
def test_a_cached_continuation_decides_as_the_full_forward(cut: int):
    """The bonus reads absolute positions: a row split over two cached calls opens the same tokens."""
    model = two_language_model(16)
    model.config.boundary_fixed_bonus = 0.1
    batch = language_batches()["B"][:2, :64]
    with torch.no_grad():
        full = model.model(input_ids=batch).boundaries
        first = model.model(input_ids=batch[:, :cut], use_cache=True)
        rest = model.model(input_ids=batch[:, cut:], cache=first.cache, use_cache=True)
    assert torch.equal(torch.cat([first.boundaries, rest.boundaries], dim=1), full)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"boundary_fixed_bonus": -0.1}, "boundary_fixed_bonus"),
        ({"boundary_fixed_bonus": 0.1}, "boundary_rank_window"),
        (
            {"boundary_fixed_bonus": 0.1, "boundary_rank_window": 8, "boundary_noise": "none",
             "compression_ratio": 1.5},
            "integer compression_ratio",
        ),
    ],
)  # fmt: skip
def test_config_refuses_what_the_bonus_cannot_mean(overrides: dict, field: str):
    with pytest.raises(ValueError, match=field):
        ConceptMoEConfig(**overrides)
