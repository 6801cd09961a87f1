"""Test inputs shared by the pure-function tests: left-padded rows of packed documents."""

import torch


def make_layout(rows: list[tuple[int, list[int]]], generator: torch.Generator, boundary_rate: float = 0.35):
    """Left-padded rows of packed documents: each row is (pads, [document lengths]).

    Returns mask, boundaries and position ids (B, L); every document start is a boundary.
    """
    length = max(pads + sum(documents) for pads, documents in rows)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    boundaries = torch.rand(len(rows), length, generator=generator) < boundary_rate
    # Pads get position 0 (as generate does) and random boundary flags, both of which must be ignored.
    position_ids = torch.zeros(len(rows), length, dtype=torch.long)
    for row, (pads, documents) in enumerate(rows):
        position = pads
        for document_length in documents:
            mask[row, position : position + document_length] = True
            position_ids[row, position : position + document_length] = torch.arange(document_length)
            boundaries[row, position] = True
            position += document_length
    return mask, boundaries, position_ids
