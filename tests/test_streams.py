"""Hidden Decoding's stream layout (hf_concept.modeling.hidden_decoding_streams) against loops, with pads
and packing."""

import pytest
import torch

from hf_concept.modeling.hidden_decoding_streams import (
    deinterleave_streams,
    expand_attention_mask,
    expand_position_ids,
    final_stream_positions,
    interleave_streams,
    select_final_stream,
    stream_index,
    token_index,
)
from hf_concept.modeling.packing import document_ids, document_starts
from hf_concept.reference.streams import (
    deinterleave_streams_loop,
    expand_per_token_loop,
    interleave_streams_loop,
)


@pytest.mark.parametrize("num_streams", [1, 2, 3, 4])
def test_interleave_matches_loop_round_trips_and_gradients(num_streams):
    generator = torch.Generator().manual_seed(num_streams)
    stream_states = torch.randn(2, num_streams, 5, 3, generator=generator, dtype=torch.float64)
    fast_input = stream_states.clone().requires_grad_(True)
    loop_input = stream_states.clone().requires_grad_(True)
    expanded = interleave_streams(fast_input)
    expected = interleave_streams_loop(loop_input)
    assert expanded.shape == (2, 5 * num_streams, 3)
    torch.testing.assert_close(expanded, expected, rtol=0, atol=0)
    torch.testing.assert_close(deinterleave_streams(expanded, num_streams), stream_states, rtol=0, atol=0)
    torch.testing.assert_close(
        deinterleave_streams(expanded, num_streams), deinterleave_streams_loop(expected, num_streams)
    )
    upstream = torch.randn_like(expanded)
    (expanded * upstream).sum().backward()
    (expected * upstream).sum().backward()
    torch.testing.assert_close(fast_input.grad, loop_input.grad, rtol=0, atol=0)
    # The paper's layout, 1-based: token i's stream k at (i - 1)·n + k.
    for token in range(5):
        for stream in range(num_streams):
            torch.testing.assert_close(
                expanded[:, token * num_streams + stream], stream_states[:, stream, token]
            )


def test_deinterleave_gradients_and_final_stream():
    generator = torch.Generator().manual_seed(7)
    expanded = torch.randn(2, 12, 3, generator=generator, dtype=torch.float64)
    fast_input = expanded.clone().requires_grad_(True)
    loop_input = expanded.clone().requires_grad_(True)
    fast, loop = deinterleave_streams(fast_input, 4), deinterleave_streams_loop(loop_input, 4)
    upstream = torch.randn_like(fast)
    (fast * upstream).sum().backward()
    (loop * upstream).sum().backward()
    torch.testing.assert_close(fast_input.grad, loop_input.grad)
    final = select_final_stream(expanded, 4)
    torch.testing.assert_close(final, expanded[:, final_stream_positions(3, 4)])
    torch.testing.assert_close(final, expanded[:, 3::4])
    with pytest.raises(ValueError, match="multiple"):
        deinterleave_streams(expanded, 5)
    with pytest.raises(ValueError, match="num_streams"):
        deinterleave_streams(expanded, 0)


def test_index_helpers():
    assert stream_index(3, 2).tolist() == [0, 1, 0, 1, 0, 1]
    assert token_index(3, 2).tolist() == [0, 0, 1, 1, 2, 2]
    assert final_stream_positions(3, 2).tolist() == [1, 3, 5]
    positions = torch.arange(6)
    assert torch.equal(token_index(3, 2) * 2 + stream_index(3, 2), positions)


def test_masks_and_positions_match_loops_with_left_padding_and_packing():
    # Row 0 left-padded (generate gives pads position 0); row 1 packs two documents.
    attention_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    position_ids = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 0, 1]])
    for num_streams in (1, 3):
        expanded_mask = expand_attention_mask(attention_mask, num_streams)
        expanded_positions = expand_position_ids(position_ids, num_streams)
        assert torch.equal(expanded_mask, expand_per_token_loop(attention_mask, num_streams))
        assert torch.equal(
            expanded_positions, expand_per_token_loop(position_ids, num_streams, positions=True)
        )
        # The real tokens of each document read 0..S·len - 1, contiguous, as the paper's RoPE positions.
        assert expanded_positions[0, 2 * num_streams :].tolist() == list(range(3 * num_streams))
        assert expanded_positions[1, : 3 * num_streams].tolist() == list(range(3 * num_streams))
        assert expanded_positions[1, 3 * num_streams :].tolist() == list(range(2 * num_streams))
        # Document starts found on the expanded sequence are each document's first token, stream 0.
        mask = expanded_mask.bool()
        starts = document_starts(mask, expanded_positions)
        expected_starts = torch.zeros_like(mask)
        expected_starts[0, 2 * num_streams] = True
        expected_starts[1, [0, 3 * num_streams]] = True
        assert torch.equal(starts, expected_starts)
        expected_ids = document_ids(
            mask[:, ::num_streams], document_starts(mask[:, ::num_streams], position_ids)
        )
        assert torch.equal(document_ids(mask, starts), expected_ids.repeat_interleave(num_streams, dim=1))


def test_left_padded_row_equals_row_alone_and_packed_equals_apart():
    generator = torch.Generator().manual_seed(9)
    stream_states = torch.randn(1, 3, 7, 2, generator=generator)
    position_ids = torch.tensor([[0, 0, 0, 1, 2, 0, 1]])
    expanded = interleave_streams(stream_states)
    positions = expand_position_ids(position_ids, 3)
    # Tokens 2..6 alone (the row without its two pads), then the two packed documents apart.
    for begin, end in [(2, 7), (2, 5), (5, 7)]:
        alone = interleave_streams(stream_states[:, :, begin:end])
        torch.testing.assert_close(expanded[:, begin * 3 : end * 3], alone)
        alone_positions = expand_position_ids(position_ids[:, begin:end], 3)
        assert torch.equal(positions[:, begin * 3 : end * 3], alone_positions)
    assert torch.equal(positions[:, 6:15], expand_position_ids(torch.tensor([[0, 1, 2]]), 3))


def test_cached_continuation_positions_continue():
    full = expand_position_ids(torch.arange(6).unsqueeze(0), 2)
    continued = expand_position_ids(torch.tensor([[4, 5]]), 2)
    assert torch.equal(continued, full[:, 8:])
    broadcast = expand_position_ids(torch.arange(3).unsqueeze(0), 2)
    assert broadcast.shape == (1, 6)
