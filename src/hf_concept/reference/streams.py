"""Hidden Decoding's stream layout written out with loops (token i's stream k at position i·S + k).

Legend: B batch, L tokens, S streams, D width. Same contract as `hf_concept.modeling.hidden_decoding_streams`.
"""

from __future__ import annotations

import torch


def interleave_streams_loop(stream_states: torch.Tensor) -> torch.Tensor:
    """(B, S·L, D) from (B, S, L, D), one expanded position at a time."""
    batch_size, num_streams, length, _ = stream_states.shape
    rows = []
    for row in range(batch_size):
        positions = []
        for token in range(length):
            for stream in range(num_streams):
                positions.append(stream_states[row, stream, token])
        rows.append(torch.stack(positions))
    return torch.stack(rows)


def deinterleave_streams_loop(expanded_states: torch.Tensor, num_streams: int) -> torch.Tensor:
    """(B, S, L, D) from (B, S·L, D): stream k of token i is expanded position i·S + k."""
    batch_size, expanded_length, _ = expanded_states.shape
    length = expanded_length // num_streams
    rows = []
    for row in range(batch_size):
        streams = []
        for stream in range(num_streams):
            streams.append(
                torch.stack([expanded_states[row, token * num_streams + stream] for token in range(length)])
            )
        rows.append(torch.stack(streams))
    return torch.stack(rows)


def expand_per_token_loop(values: torch.Tensor, num_streams: int, positions: bool = False) -> torch.Tensor:
    """(B, S·L) from (B, L): each token's value for its S streams; as positions p·S + k when `positions`."""
    batch_size, length = values.shape
    expanded = torch.zeros(batch_size, length * num_streams, dtype=values.dtype)
    for row in range(batch_size):
        for token in range(length):
            for stream in range(num_streams):
                value = values[row, token]
                expanded[row, token * num_streams + stream] = (
                    value * num_streams + stream if positions else value
                )
    return expanded
