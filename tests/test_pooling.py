"""Pooling tokens into concepts and reading them back (hf_concept.modeling.pooling) against plain loops."""

import re

import pytest
import torch
from torch.testing import assert_close

from hf_concept.modeling.packing import document_starts
from hf_concept.modeling.pooling import (
    chunk_index,
    chunk_lengths,
    concept_counts,
    concept_mask_from_counts,
    gather_concepts_to_tokens,
    parse_pooling_method,
    pool_concepts,
    readable_concept_index,
)
from hf_concept.reference.pooling import (
    chunks_loop,
    gather_concepts_loop,
    pool_concepts_loop,
    readable_concept_index_loop,
)
from tests.layouts import make_layout

METHODS = ["first", "sum", "mean", "hops:0", "hops:1", "hops:3"]


def layout_and_states(rows, width=5, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    mask, boundaries, position_ids = make_layout(rows, generator)
    token_states = torch.randn(*mask.shape, width, generator=generator, dtype=dtype)
    # Pad states are NaN: any path that reads them poisons the result.
    token_states = token_states.masked_fill(~mask.unsqueeze(-1), float("nan"))
    return token_states, mask, boundaries, position_ids


ROWS = [(0, [9, 4, 6]), (3, [16]), (7, [2, 1, 9]), (19, [])]


def test_parse_pooling_method():
    assert parse_pooling_method("first") == ("first", 0)
    assert parse_pooling_method("mean") == ("mean", 0)
    assert parse_pooling_method("hops:3") == ("hops", 3)
    for bad in ["max", "hops:", "hops:-1", "hops:x", "Mean"]:
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            parse_pooling_method(bad)


def test_chunk_layout_matches_loop():
    _, mask, boundaries, _ = layout_and_states(ROWS)
    rows = chunks_loop(boundaries, mask)
    index = chunk_index(boundaries, mask)
    lengths = chunk_lengths(boundaries, mask)
    counts = concept_counts(boundaries, mask)
    for row, chunks in enumerate(rows):
        assert counts[row] == len(chunks)
        assert lengths[row, : len(chunks)].tolist() == [len(chunk) for chunk in chunks]
        assert (lengths[row, len(chunks) :] == 0).all()
        expected = torch.full((mask.shape[1],), -1)
        for slot, chunk in enumerate(chunks):
            expected[chunk] = slot
        assert torch.equal(index[row], expected)
    assert concept_mask_from_counts(counts).tolist() == [
        [slot < len(chunks) for slot in range(int(counts.max()))] for chunks in rows
    ]


@pytest.mark.parametrize("method", METHODS)
def test_pool_concepts_matches_loop_outputs_and_gradients(method):
    token_states, mask, boundaries, _ = layout_and_states(ROWS)
    fast_input = token_states.clone().requires_grad_(True)
    loop_input = token_states.clone().requires_grad_(True)
    fast_states, fast_mask = pool_concepts(fast_input, boundaries, mask, method)
    loop_states, loop_mask = pool_concepts_loop(loop_input, boundaries, mask, method)
    assert torch.equal(fast_mask, loop_mask)
    torch.testing.assert_close(fast_states, loop_states, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(fast_states).all()
    upstream = torch.randn_like(fast_states)
    (fast_states * upstream).sum().backward()
    (loop_states * upstream).sum().backward()
    # Loop gradients at pads are None-summed zeros; fast ones must be zero too, never NaN.
    torch.testing.assert_close(fast_input.grad, torch.nan_to_num(loop_input.grad), rtol=1e-12, atol=1e-12)
    assert (fast_input.grad[~mask] == 0).all()


def test_hops_zero_is_last_token_and_many_hops_is_sum():
    token_states, mask, boundaries, _ = layout_and_states(ROWS)
    index = chunk_index(boundaries, mask)
    last_tokens, _ = pool_concepts(token_states, boundaries, mask, "hops:0")
    sums, _ = pool_concepts(token_states, boundaries, mask, "sum")
    longest = int(chunk_lengths(boundaries, mask).max())
    many_hops, _ = pool_concepts(token_states, boundaries, mask, f"hops:{longest - 1}")
    torch.testing.assert_close(many_hops, sums)
    for row, chunks in enumerate(chunks_loop(boundaries, mask)):
        for slot, chunk in enumerate(chunks):
            assert index[row, chunk[-1]] == slot
            torch.testing.assert_close(last_tokens[row, slot], token_states[row, chunk[-1]])
            # N hops sums the chunk's last N + 1 tokens: check N = 1 by hand.
            two_last = token_states[row, chunk[-2:]].sum(0)
            torch.testing.assert_close(
                pool_concepts(token_states, boundaries, mask, "hops:1")[0][row, slot], two_last
            )


def test_pool_half_precision_accumulates_in_float32():
    token_states, mask, boundaries, _ = layout_and_states(ROWS, width=64, dtype=torch.float32)
    token_states = token_states.nan_to_num(0.0) + 10.0
    full, _ = pool_concepts(token_states, boundaries, mask, "mean")
    half, _ = pool_concepts(token_states.bfloat16(), boundaries, mask, "mean")
    assert half.dtype == torch.bfloat16
    # bf16 inputs differ from fp32 by their own rounding (~0.4% near 10), not by a bf16-accumulated sum.
    torch.testing.assert_close(half.float(), full, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("method", ["first", "mean", "hops:2"])
def test_readable_index_matches_loop(method):
    _, mask, boundaries, position_ids = layout_and_states(ROWS)
    starts = document_starts(mask, position_ids)
    fast = readable_concept_index(boundaries, mask, starts, method)
    assert torch.equal(fast, readable_concept_index_loop(boundaries, mask, starts, method))
    index = chunk_index(boundaries, mask)
    if method == "first":
        assert torch.equal(fast, index)
    else:
        # Every document's first chunk reads nothing, whatever came before it in the row.
        assert (fast[starts] == -1).all()
        assert ((fast == index - 1) | (fast == -1)).all()


def test_readable_index_requires_starts_to_be_boundaries():
    _, mask, boundaries, position_ids = layout_and_states(ROWS)
    starts = document_starts(mask, position_ids)
    broken = boundaries & ~starts
    with pytest.raises(ValueError, match="starts"):
        readable_concept_index(broken, mask, starts, "mean")
    with pytest.raises(ValueError, match="starts"):
        readable_concept_index(boundaries, mask, starts[:, 1:], "mean")
    with pytest.raises(ValueError, match="boundaries"):
        chunk_index(boundaries[:, 1:], mask)
    with pytest.raises(ValueError, match="mask"):
        chunk_index(boundaries, mask.long())


def test_gather_matches_loop_with_null_state_and_gradients():
    generator = torch.Generator().manual_seed(3)
    concept_states = torch.randn(3, 4, 6, generator=generator, dtype=torch.float64)
    index = torch.randint(-1, 4, (3, 11), generator=generator)
    null_state = torch.randn(6, generator=generator, dtype=torch.float64)
    for null in (None, null_state):
        fast_concepts = concept_states.clone().requires_grad_(True)
        loop_concepts = concept_states.clone().requires_grad_(True)
        fast_null = null.clone().requires_grad_(True) if null is not None else None
        loop_null = null.clone().requires_grad_(True) if null is not None else None
        fast = gather_concepts_to_tokens(fast_concepts, index, fast_null)
        loop = gather_concepts_loop(loop_concepts, index, loop_null)
        torch.testing.assert_close(fast, loop)
        upstream = torch.randn_like(fast)
        (fast * upstream).sum().backward()
        (loop * upstream).sum().backward()
        torch.testing.assert_close(fast_concepts.grad, loop_concepts.grad)
        if null is not None:
            torch.testing.assert_close(fast_null.grad, loop_null.grad)
    with pytest.raises(ValueError, match="index"):
        gather_concepts_to_tokens(concept_states, index + 1)
    with pytest.raises(ValueError, match="null_state"):
        gather_concepts_to_tokens(concept_states, index, null_state[:3])


def concepts_seen_by_tokens(token_states, boundaries, mask, starts, method, naive=False):
    """The per-token concept each token reads: pooling, then the readable index, then the gather."""
    concept_states, _ = pool_concepts(token_states, boundaries, mask, method)
    if naive:
        # DLCM's literal reading: a token reads the concept of its own chunk.
        index = chunk_index(boundaries, mask)
    else:
        index = readable_concept_index(boundaries, mask, starts, method)
    null_state = torch.full((token_states.shape[-1],), 0.5, dtype=token_states.dtype)
    return gather_concepts_to_tokens(concept_states, index, null_state)


def perturb_after(token_states, boundaries, mask, position, seed):
    """New token states and boundary flags strictly after `position` (document starts kept)."""
    generator = torch.Generator().manual_seed(seed)
    later = torch.zeros_like(mask)
    later[:, position + 1 :] = True
    noise = torch.randn(token_states.shape, generator=generator, dtype=token_states.dtype)
    new_states = torch.where(later.unsqueeze(-1) & mask.unsqueeze(-1), noise, token_states)
    flips = torch.rand(mask.shape, generator=generator) < 0.5
    new_boundaries = torch.where(later, boundaries ^ flips, boundaries)
    return new_states, new_boundaries


@pytest.mark.parametrize("method", METHODS)
def test_causality_probe_every_method(method):
    token_states, mask, boundaries, position_ids = layout_and_states(ROWS)
    starts = document_starts(mask, position_ids)
    reference = concepts_seen_by_tokens(token_states, boundaries, mask, starts, method)
    for position in range(mask.shape[1]):
        for seed in range(2):
            new_states, new_boundaries = perturb_after(token_states, boundaries, mask, position, seed)
            new_boundaries = new_boundaries | starts
            seen = concepts_seen_by_tokens(new_states, new_boundaries, mask, starts, method)
            torch.testing.assert_close(seen[:, : position + 1], reference[:, : position + 1], rtol=0, atol=0)


def test_causality_probe_catches_the_naive_mean():
    """Reading the mean of one's own chunk leaks later tokens: the probe above would fail on it."""
    token_states, mask, boundaries, position_ids = layout_and_states(ROWS)
    starts = document_starts(mask, position_ids)
    reference = concepts_seen_by_tokens(token_states, boundaries, mask, starts, "mean", naive=True)
    leaks = 0
    for position in range(mask.shape[1]):
        new_states, new_boundaries = perturb_after(token_states, boundaries, mask, position, 0)
        new_boundaries = new_boundaries | starts
        seen = concepts_seen_by_tokens(new_states, new_boundaries, mask, starts, "mean", naive=True)
        leaks += int(not torch.equal(seen[:, : position + 1], reference[:, : position + 1]))
    assert leaks > 0


@pytest.mark.parametrize("method", ["first", "mean", "hops:1"])
def test_left_padded_row_equals_row_alone_and_packed_equals_apart(method):
    token_states, mask, boundaries, position_ids = layout_and_states([(5, [6, 3, 7])])
    starts = document_starts(mask, position_ids)
    packed = concepts_seen_by_tokens(token_states, boundaries, mask, starts, method)
    alone = slice(5, None)
    unpadded = concepts_seen_by_tokens(
        token_states[:, alone], boundaries[:, alone], mask[:, alone], starts[:, alone], method
    )
    torch.testing.assert_close(packed[:, alone], unpadded)
    assert torch.equal(packed[:, :5], torch.full_like(packed[:, :5], 0.5))
    for begin, end in [(5, 11), (11, 14), (14, 21)]:
        piece = slice(begin, end)
        apart = concepts_seen_by_tokens(
            token_states[:, piece], boundaries[:, piece], mask[:, piece], starts[:, piece], method
        )
        torch.testing.assert_close(packed[:, piece], apart)


@pytest.mark.parametrize("method", ["first", "sum", "mean", "hops:0", "hops:2"])
def test_pool_open_chunk_equals_pool_concepts_outputs_and_gradients(method):
    """The decoding shortcut (one left-aligned chunk per row) against the general pooling."""
    from hf_concept.modeling.pooling import pool_open_chunk

    generator = torch.Generator().manual_seed(0)
    states = torch.randn(4, 6, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    counts = torch.tensor([6, 3, 1, 0])
    mask = torch.arange(6)[None, :] < counts[:, None]
    opens = mask & (torch.arange(6) == 0)[None, :]
    weights = torch.randn(4, 1, 5, generator=generator, dtype=torch.float64)

    shortcut = pool_open_chunk(states, counts, method)
    expected, concept_mask = pool_concepts(states, opens, mask, method)
    expected = torch.cat([expected, expected.new_zeros(4, 1, 5)], dim=1)[:, :1]  # the empty row: zeros
    assert_close(shortcut, expected, atol=1e-12, rtol=0)
    (grad_shortcut,) = torch.autograd.grad((shortcut * weights).sum(), states)
    (grad_expected,) = torch.autograd.grad((expected * weights).sum(), states)
    assert_close(grad_shortcut, grad_expected, atol=1e-12, rtol=0)
    assert shortcut[3].abs().sum() == 0 and not concept_mask[3].any()
