"""Hidden Decoding's masks, one pure function per layer kind (`modeling.hidden_decoding_masks`), each
against a plain boolean reference: a left-padded batch of two rows, eager (additive) masks read back as
allowed / not allowed on the real query rows."""

from __future__ import annotations

import pytest
import torch

from hf_concept.modeling.configuration_hidden_decoding import HiddenDecodingConfig
from hf_concept.modeling.hidden_decoding_masks import (
    interleaved_masks,
    intra_mask,
    stream_masks,
    token_block_masks,
)
from tests.test_hidden_decoding_model import BACKBONE

STREAMS, LENGTH = 3, 7
LAYOUT = ["intra", "local", "intra", "full"]


def config_of(**overrides) -> HiddenDecodingConfig:
    values = dict(BACKBONE, num_streams=STREAMS, stream_attention_layout=LAYOUT, local_window=2)
    config = HiddenDecodingConfig(**{**values, **overrides})
    config._attn_implementation = "eager"
    return config


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) attention mask (row 1 left-padded by 3) and position ids."""
    attention_mask = torch.ones(2, LENGTH, dtype=torch.long)
    attention_mask[1, :3] = 0
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return attention_mask, position_ids


def allowed(mask: torch.Tensor) -> torch.Tensor:
    """(rows, 1, Q, K) eager or boolean mask -> (rows, Q, K) bool."""
    return (mask if mask.dtype == torch.bool else mask == 0)[:, 0]


def check(mask: torch.Tensor, expected: torch.Tensor, real_queries: torch.Tensor) -> None:
    """Equal on every real query row: (rows, Q, K) expected, (rows, Q) real."""
    got = allowed(mask)
    assert got.shape == expected.shape
    assert torch.equal(got[real_queries], expected[real_queries])


def slot_reference(real: torch.Tensor, keep) -> torch.Tensor:
    """(B, L·S, L·S) token-major slots: key real and keep(query slot, key slot) (index tensors)."""
    slots = torch.arange(LENGTH * STREAMS)
    query, key = slots[:, None], slots[None, :]
    real_slots = real.repeat_interleave(STREAMS, dim=1)  # (B, L·S)
    return keep(query, key)[None] & real_slots[:, None, :]


def test_interleaved_full_and_local_are_slot_causal_with_a_slot_window():
    config = config_of()
    attention_mask, position_ids = batch()
    full, local = interleaved_masks(config, torch.zeros(1), attention_mask, position_ids, None)
    real = attention_mask.bool()
    real_slots = real.repeat_interleave(STREAMS, dim=1)
    check(full, slot_reference(real, lambda q, k: k <= q), real_slots)
    window = config.sliding_window  # local_window tokens × S slots
    assert window == 2 * STREAMS
    check(local, slot_reference(real, lambda q, k: (k <= q) & (q - k < window)), real_slots)


def test_token_blocks_let_every_stream_see_whole_tokens():
    config = config_of(
        cross_stream_mask="token_block", cross_stream_positions="token", intra_stream_positions="token"
    )
    attention_mask, position_ids = batch()
    full, local = token_block_masks(config, torch.zeros(1), attention_mask, position_ids, None)
    real = attention_mask.bool()
    real_slots = real.repeat_interleave(STREAMS, dim=1)
    token_of = lambda slot: torch.div(slot, STREAMS, rounding_mode="floor")  # noqa: E731
    check(full, slot_reference(real, lambda q, k: token_of(k) <= token_of(q)), real_slots)
    tokens = config.local_window_tokens
    within = lambda q, k: (token_of(k) <= token_of(q)) & (token_of(q) - token_of(k) < tokens)  # noqa: E731
    check(local, slot_reference(real, within), real_slots)


@pytest.mark.parametrize("intra_window", [None, 3])
def test_intra_masks_keep_each_stream_on_its_own_tokens(intra_window):
    config = config_of(intra_window=intra_window)
    attention_mask, position_ids = batch()
    mask = intra_mask(config, torch.zeros(1), attention_mask, position_ids, None)
    real = attention_mask.bool().repeat_interleave(STREAMS, dim=0)  # (B·S, L), stream-major per row
    tokens = torch.arange(LENGTH)
    keep = tokens[None, :] <= tokens[:, None]
    if intra_window is not None:
        keep = keep & (tokens[:, None] - tokens[None, :] < intra_window)
    check(mask, keep[None] & real[:, None, :], real)


def test_shared_kv_intra_mask_is_one_boolean_mask_over_tokens():
    config = config_of(stream_kv="shared")
    attention_mask, position_ids = batch()
    mask = intra_mask(config, torch.zeros(1), attention_mask, position_ids, None)
    assert mask.dtype == torch.bool and mask.shape == (2, 1, LENGTH, LENGTH)
    real = attention_mask.bool()
    tokens = torch.arange(LENGTH)
    check(mask, (tokens[None, :] <= tokens[:, None])[None] & real[:, None, :], real)


def test_stream_masks_builds_what_the_layout_has():
    attention_mask, position_ids = batch()
    masks = stream_masks(config_of(), torch.zeros(1), attention_mask, position_ids, None)
    assert masks.intra is not None and masks.local is not None and masks.full is not None
    only_intra = config_of(stream_attention_layout=["intra"] * 4)
    masks = stream_masks(only_intra, torch.zeros(1), attention_mask, position_ids, None)
    assert masks.intra is not None and masks.local is None and masks.full is None
