"""Sequence and document starts from attention masks and position ids (hf_concept.modeling.packing)."""

import pytest
import torch

from hf_concept.modeling.packing import document_ids, document_starts, last_real_picker, token_mask


def test_token_mask_defaults_and_uses_last_columns():
    assert token_mask(None, (2, 3)).all()
    # generate passes a mask covering past tokens too: only the last L columns describe the input.
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])
    assert token_mask(mask, (2, 2)).tolist() == [[True, True], [True, False]]
    with pytest.raises(ValueError, match="attention_mask"):
        token_mask(torch.ones(1, 2, 3), (1, 3))


def test_left_padding_starts_at_first_real_token():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]).bool()
    # generate gives pads position 0: they must not count as starts.
    position_ids = torch.tensor([[0, 0, 0, 1], [0, 1, 2, 3]])
    starts = document_starts(mask, position_ids)
    assert starts.tolist() == [[False, False, True, False], [True, False, False, False]]
    assert document_ids(mask, starts).tolist() == [[-1, -1, 0, 0], [0, 0, 0, 0]]


def test_packed_documents_start_at_position_resets():
    mask = torch.ones(1, 7, dtype=torch.bool)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1]])
    starts = document_starts(mask, position_ids)
    assert starts.tolist() == [[True, False, False, True, False, True, False]]
    assert document_ids(mask, starts).tolist() == [[0, 0, 0, 1, 1, 2, 2]]


def test_cached_continuation_starts_nothing_unless_position_resets():
    mask = torch.ones(2, 2, dtype=torch.bool)
    position_ids = torch.tensor([[5, 6], [3, 0]])
    starts = document_starts(mask, position_ids, has_past=True)
    assert starts.tolist() == [[False, False], [False, True]]
    # Without position ids and without past, the first real token is still a start.
    assert document_starts(mask).tolist() == [[True, False], [True, False]]


def test_last_real_picker_takes_each_rows_last_real_token_or_keeps_the_old_value():
    mask = torch.tensor([[False, True, True, False], [False, False, False, False], [True, True, True, True]])
    values = torch.arange(12).view(3, 4, 1).float()
    pick = last_real_picker(mask)
    old = torch.full((3, 1), -1, dtype=torch.long)
    assert pick(values, old).tolist() == [[2], [-1], [11]]
    assert pick(values, old).dtype == torch.long
