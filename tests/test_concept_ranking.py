"""`boundary_rank_window`: local-rank decision scores (`concept_ranking`) — a plain reference, the split of
a sequence over cached calls, the rate they open, and the per-language ratio on a two-language text that
one threshold over the mix does not give."""

from __future__ import annotations

import pytest
import torch

from hf_concept.modeling.concept_ranking import local_rank_scores, recent_after
from hf_concept.modeling.configuration_conceptmoe import ConceptMoEConfig
from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM
from hf_concept.training.ratio_hold import RatioHold, calibrate_threshold, threshold_for_ratio


def reference_scores(
    probs: torch.Tensor, starts: torch.Tensor, mask: torch.Tensor, window: int
) -> torch.Tensor:
    """r_t = 1 − (g + ½)/n over the free tokens of t's document among positions t − W + 1 .. t, by loops."""
    scores = torch.zeros_like(probs)
    for row in range(probs.shape[0]):
        document, owner = -1, []
        for t in range(probs.shape[1]):
            if mask[row, t] and starts[row, t]:
                document += 1
            owner.append(document if mask[row, t] and not starts[row, t] else -1)
            if not mask[row, t]:
                continue
            if starts[row, t]:
                scores[row, t] = 1.0
                continue
            counted = [j for j in range(max(0, t - window + 1), t + 1) if owner[j] == owner[t]]
            higher = sum(1 for j in counted if probs[row, j] > probs[row, t])
            scores[row, t] = 1.0 - (higher + 0.5) / len(counted)
    return scores


def layout(
    batch: int, length: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs, starts, mask, documents): probabilities with ties, left padding in row 0, packed documents
    in row 1."""
    generator = torch.Generator().manual_seed(seed)
    probs = torch.randint(0, 12, (batch, length), generator=generator).float() / 11  # ties on purpose
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[0, :5] = False
    starts = torch.zeros_like(mask)
    starts[0, 5] = True
    starts[1, [0, 9, 10, 23]] = True
    starts[2:, 0] = True
    probs = probs.masked_fill(starts, 1.0).masked_fill(~mask, 0.0)
    documents = (torch.cumsum(starts.long(), dim=1) - 1).masked_fill(~mask, -1)
    return probs, starts, mask, documents


def empty_history(batch: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(batch, window - 1), torch.full((batch, window - 1), -1, dtype=torch.long)


@pytest.mark.parametrize("window", [2, 5, 16, 64])
def test_scores_equal_the_reference(window: int) -> None:
    probs, starts, mask, documents = layout(3, 40, seed=window)
    scores = local_rank_scores(probs, starts, mask, documents, *empty_history(3, window))
    torch.testing.assert_close(scores, reference_scores(probs, starts, mask, window), rtol=0, atol=1e-7)


@pytest.mark.parametrize("cut", [1, 6, 11, 39])
def test_scores_continue_over_calls(cut: int) -> None:
    """A sequence split into calls, each continuing from `recent_after` of the one before, scores exactly
    as the whole sequence does: what the cache carries is enough."""
    window = 7
    probs, starts, mask, documents = layout(3, 40, seed=cut)
    whole = local_rank_scores(probs, starts, mask, documents, *empty_history(3, window))
    history = empty_history(3, window)
    parts = []
    for piece in (slice(0, cut), slice(cut, 40)):
        arguments = (probs[:, piece], starts[:, piece], mask[:, piece], documents[:, piece], *history)
        parts.append(local_rank_scores(*arguments))
        history = recent_after(*arguments)
    assert torch.equal(torch.cat(parts, dim=1), whole)


@pytest.mark.parametrize("ratio", [1.5, 2.0, 3.0])
def test_rate_is_one_in_ratio_whatever_the_level(ratio: float) -> None:
    """Two texts whose probabilities sit at different levels open the same share of tokens at 1 − 1/R."""
    generator = torch.Generator().manual_seed(0)
    low = 0.05 * torch.rand(1, 4000, generator=generator)
    high = 0.6 + 0.4 * torch.rand(1, 4000, generator=generator)
    for probs in (low, high):
        starts = torch.zeros_like(probs, dtype=torch.bool)
        starts[:, 0] = True
        probs = probs.masked_fill(starts, 1.0)
        mask, documents = torch.ones_like(starts), torch.zeros_like(probs, dtype=torch.long)
        scores = local_rank_scores(probs, starts, mask, documents, *empty_history(1, 64))
        tokens_per_concept = mask.sum() / (scores >= 1 - 1 / ratio).sum()
        assert abs(float(tokens_per_concept) / ratio - 1) < 0.03


def two_language_model(rank_window: int | None) -> ConceptMoEForCausalLM:
    """A router that reads the embeddings directly (no encoder layer, identity projections): "language A"
    (ids 3–49) has nearly parallel embeddings, so p ≈ 0 between its tokens; "language B" (ids 50–96)
    random ones, so p ≈ ½. One threshold must then spend the ratio on B."""
    torch.manual_seed(0)
    noise = "none"
    config = ConceptMoEConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3, encoder_layers=0,
        decoder_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2, compression_ratio=2.0,
        router_init="identity", boundary_noise=noise, boundary_rank_window=rank_window,
    )  # fmt: skip
    model = ConceptMoEForCausalLM(config).eval()
    with torch.no_grad():
        table = model.model.embed_tokens.weight
        table[3:50] = torch.randn(32) + 0.02 * torch.randn(47, 32)
    return model


def language_batches() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {
        "A": torch.randint(3, 50, (4, 256), generator=generator),
        "B": torch.randint(50, 97, (4, 256), generator=generator),
    }


def tokens_per_concept(model: ConceptMoEForCausalLM, input_ids: torch.Tensor) -> float:
    with torch.no_grad():
        opens = model.model(input_ids=input_ids).boundaries
    return input_ids.numel() / int(opens.sum())


@pytest.mark.parametrize("rank_window", [None, 32])
def test_every_language_keeps_its_share_of_concepts(rank_window: int | None) -> None:
    """The threshold set on the pooled mix (as `--hold-ratio` and `calibrate_threshold` set it) realises R
    on the mix in both cases; each language realises tokens per concept within [R/1.5, 1.5R] only with
    the rank window — without it language A gets almost no concept (the test's failing case)."""
    model, ratio = two_language_model(rank_window), 2.0
    batches = language_batches()
    threshold = calibrate_threshold(model, list(batches.values()), ratio)
    assert model.config.boundary_threshold == threshold
    pooled = tokens_per_concept(model, torch.cat(list(batches.values())))
    assert abs(pooled / ratio - 1) < 0.05
    per_language = {name: tokens_per_concept(model, ids) for name, ids in batches.items()}
    within = all(ratio / 1.5 <= value <= 1.5 * ratio for value in per_language.values())
    assert within == (rank_window is not None), per_language


def test_ratio_hold_reads_the_rank_scores() -> None:
    """`RatioHold` sets the threshold on what the decisions read: after its update the step's batch
    realises R at inference, and the threshold lies on the rank scale (a probability threshold would
    not, since language B's probabilities sit near ½ and A's near 0)."""
    model, ratio = two_language_model(32), 1.5
    hold = RatioHold(model, ratio)
    batch = torch.cat(list(language_batches().values()))
    model.train()
    model(input_ids=batch, labels=batch)
    threshold = hold.update()
    hold.remove()
    model.eval()
    scores = model.model(input_ids=batch).boundary_scores
    starts = torch.zeros_like(batch, dtype=torch.bool)
    starts[:, 0] = True
    assert threshold == threshold_for_ratio(scores, starts, torch.ones_like(starts), ratio)
    assert abs(tokens_per_concept(model, batch) / ratio - 1) < 0.05


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"boundary_rank_window": 1}, "boundary_rank_window"),
        ({"boundary_rank_window": 2.5}, "boundary_rank_window"),
        ({"boundary_rank_window": 8}, "boundary_noise"),
        ({"boundary_rank_window": 8, "boundary_noise": "none", "chunking": "fixed"}, "chunking"),
    ],
)
def test_config_refuses_what_a_rank_cannot_mean(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ConceptMoEConfig(**overrides)
