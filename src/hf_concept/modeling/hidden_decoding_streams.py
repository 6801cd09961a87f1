"""Hidden Decoding's expanded sequence: n streams per token, interleaved (HD §2.1, eq. 1 and 3).

Legend: B batch, L tokens, S streams (the paper's n), D width; "expanded" length is S·L.

Layout (0-based): token i's stream k sits at expanded position i·S + k, so the S streams of a token are
contiguous and in stream order, and the last one, i·S + S - 1, is the token's final stream (the only one
that carries the next-token loss). Per-token tensors expand by repeating each token S times.

Positions: a token with position id p has streams at positions p·S + k. Packed documents (position ids
restarting at 0) therefore restart at 0 in the expanded sequence too, and a cached continuation (ids
starting at p > 0) continues at p·S. Pads map the same way from whatever position id the caller gave them
(a defined, finite value; the expanded attention mask hides them).

Causality: expansion reorders nothing across tokens; all streams of token i come before those of i + 1.
"""

from __future__ import annotations

import torch


def _check_streams(num_streams: int) -> None:
    if not isinstance(num_streams, int) or num_streams < 1:
        raise ValueError(f"num_streams must be a positive integer, got {num_streams!r}")


def interleave_streams(stream_states: torch.Tensor) -> torch.Tensor:
    """(B, S·L, D) expanded sequence from (B, S, L, D) per-stream states."""
    if stream_states.dim() != 4:
        raise ValueError(f"stream_states must be (B, S, L, D), got shape {tuple(stream_states.shape)}")
    batch_size, num_streams, length, width = stream_states.shape
    # (B, L, S, D) -> (B, S·L, D): token-major, stream-minor.
    return stream_states.transpose(1, 2).reshape(batch_size, length * num_streams, width)


def deinterleave_streams(expanded_states: torch.Tensor, num_streams: int) -> torch.Tensor:
    """(B, S, L, D) per-stream states from the (B, S·L, D) expanded sequence; inverse of interleave."""
    _check_streams(num_streams)
    batch_size, expanded_length, width = expanded_states.shape
    if expanded_length % num_streams:
        raise ValueError(f"expanded length {expanded_length} is not a multiple of num_streams={num_streams}")
    length = expanded_length // num_streams
    # (B, L, S, D) -> (B, S, L, D)
    return expanded_states.view(batch_size, length, num_streams, width).transpose(1, 2)


def expand_attention_mask(attention_mask: torch.Tensor, num_streams: int) -> torch.Tensor:
    """(B, S·L): each token's mask value repeated for its S streams."""
    _check_streams(num_streams)
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be (B, L), got shape {tuple(attention_mask.shape)}")
    return attention_mask.repeat_interleave(num_streams, dim=1)


def stream_index(length: int, num_streams: int, device: torch.device | None = None) -> torch.Tensor:
    """Long (S·L,): the stream k of each expanded position."""
    _check_streams(num_streams)
    return torch.arange(num_streams, device=device).repeat(length)


def token_index(length: int, num_streams: int, device: torch.device | None = None) -> torch.Tensor:
    """Long (S·L,): the token i of each expanded position."""
    _check_streams(num_streams)
    return torch.arange(length, device=device).repeat_interleave(num_streams)


def expand_position_ids(position_ids: torch.Tensor, num_streams: int) -> torch.Tensor:
    """(B, S·L) (or (1, S·L)) expanded positions p·S + k for position ids p of shape (B, L) or (1, L)."""
    _check_streams(num_streams)
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be (B, L), got shape {tuple(position_ids.shape)}")
    length = position_ids.shape[1]
    streams = stream_index(length, num_streams, position_ids.device)
    return position_ids.repeat_interleave(num_streams, dim=1) * num_streams + streams


def final_stream_positions(length: int, num_streams: int, device: torch.device | None = None) -> torch.Tensor:
    """Long (L,): expanded position i·S + S - 1 of each token's final stream."""
    _check_streams(num_streams)
    return torch.arange(length, device=device) * num_streams + (num_streams - 1)


def select_final_stream(expanded_states: torch.Tensor, num_streams: int) -> torch.Tensor:
    """(B, L, D): the final-stream states (those that predict the next token) of the expanded sequence."""
    # (B, S, L, D) -> (B, L, D)
    return deinterleave_streams(expanded_states, num_streams)[:, -1]


def token_aligned_weights(weights: torch.Tensor, num_streams: int) -> torch.Tensor:
    """(B·S, H·S, L, T) from an interleaved layer's (B, H, S·L, S·T') attention weights: row b·S + k is
    query stream k of sample b (as the intra layers' folding), "head" h·S + j the key stream j, and the
    last two dims run over query and key *tokens*, as every token-level map does (transformers splits a
    verification pass per token by slicing them). A windowed cache that keeps S·T' keys not ending a
    whole token's worth at the front gets zero weights there (those keys are out of every query's window).
    """
    _check_streams(num_streams)
    batch, heads, queries, keys = weights.shape
    front = -keys % num_streams
    weights = torch.nn.functional.pad(weights, (front, 0))
    length, key_tokens = queries // num_streams, (keys + front) // num_streams
    # (B, H, L, Sq, T, Sk) -> (B, Sq, H, Sk, L, T)
    grouped = weights.view(batch, heads, length, num_streams, key_tokens, num_streams)
    grouped = grouped.permute(0, 3, 1, 5, 2, 4)
    return grouped.reshape(batch * num_streams, heads * num_streams, length, key_tokens)
