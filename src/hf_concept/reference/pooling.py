"""Plain loop versions of `hf_concept.modeling.pooling`, written for obviousness, not speed.

Legend: B batch, L tokens, C concepts, D width. Same conventions as the fast module: `boundaries` True
where a token opens a chunk, pads in no chunk, concepts left-aligned per row.
"""

from __future__ import annotations

import torch


def chunks_loop(boundaries: torch.Tensor, mask: torch.Tensor) -> list[list[list[int]]]:
    """For each row, the list of chunks, each the list of its real token positions."""
    rows = []
    for row in range(mask.shape[0]):
        chunks: list[list[int]] = []
        for position in range(mask.shape[1]):
            if not mask[row, position]:
                continue
            if boundaries[row, position]:
                chunks.append([])
            if chunks:
                chunks[-1].append(position)
        rows.append(chunks)
    return rows


def _hops_states_loop(token_states: torch.Tensor, positions: list[int], ends: list[bool], hops: int):
    """LSLM eq. 3 taken literally over a row's real tokens.

    H^n_t = z_t H^{n-1}_t + (1 - z_{t-1}) H^{n-1}_{t-1}, with H^0_t = h_t and z_t = 1 at a chunk's last token.
    """
    states = [token_states[position] for position in positions]
    for _ in range(hops):
        updated = []
        for step in range(len(positions)):
            # Nothing lies before the first token, which behaves as if a segment ended just before it.
            previous_end = ends[step - 1] if step > 0 else True
            value = states[step] * float(ends[step])
            if not previous_end:
                value = value + states[step - 1]
            updated.append(value)
        states = updated
    return states


def pool_concepts_loop(
    token_states: torch.Tensor, boundaries: torch.Tensor, mask: torch.Tensor, method: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference pooling. "hops:N" follows LSLM eq. 3 literally, with z_t = 1 at each chunk's last token."""
    rows = chunks_loop(boundaries, mask)
    num_concepts = max((len(chunks) for chunks in rows), default=0)
    batch_size, _, width = token_states.shape
    concept_states = token_states.new_zeros(batch_size, num_concepts, width)
    concept_mask = torch.zeros(batch_size, num_concepts, dtype=torch.bool)
    concept_states = [
        [concept_states[row, slot] for slot in range(num_concepts)] for row in range(batch_size)
    ]
    for row, chunks in enumerate(rows):
        positions = [position for chunk in chunks for position in chunk]
        ends = [index == len(chunk) - 1 for chunk in chunks for index in range(len(chunk))]
        if method.startswith("hops:"):
            hops_states = dict(
                zip(
                    positions,
                    _hops_states_loop(token_states[row], positions, ends, int(method[5:])),
                    strict=True,
                )
            )
        for slot, chunk in enumerate(chunks):
            concept_mask[row, slot] = True
            if method == "first":
                value = token_states[row, chunk[0]]
            elif method in ("sum", "mean"):
                value = sum(token_states[row, position] for position in chunk)
                value = value / len(chunk) if method == "mean" else value
            else:
                value = hops_states[chunk[-1]]
            concept_states[row][slot] = value
    stacked = [
        torch.stack(row_states) if row_states else token_states.new_zeros(0, width)
        for row_states in concept_states
    ]
    return torch.stack(stacked), concept_mask


def readable_concept_index_loop(
    boundaries: torch.Tensor, mask: torch.Tensor, starts: torch.Tensor, method: str
) -> torch.Tensor:
    """Reference: the chunk each token may read.

    "first": the chunk it is in; otherwise the previous chunk when it lies in the same document.
    """
    readable = torch.full(mask.shape, -1, dtype=torch.long)
    for row in range(mask.shape[0]):
        chunk, chunk_document, document = -1, {}, -1
        for position in range(mask.shape[1]):
            if not mask[row, position]:
                continue
            if starts[row, position]:
                document += 1
            if boundaries[row, position]:
                chunk += 1
                chunk_document[chunk] = document
            if method == "first":
                readable[row, position] = chunk
            elif chunk >= 1 and chunk_document[chunk - 1] == chunk_document[chunk]:
                readable[row, position] = chunk - 1
    return readable


def gather_concepts_loop(
    concept_states: torch.Tensor, index: torch.Tensor, null_state: torch.Tensor | None = None
) -> torch.Tensor:
    """Reference: token (b, t) takes concept index[b, t], or the null state / zeros for -1."""
    batch_size, length = index.shape
    width = concept_states.shape[-1]
    null = null_state if null_state is not None else concept_states.new_zeros(width)
    rows = []
    for row in range(batch_size):
        tokens = []
        for position in range(length):
            slot = int(index[row, position])
            tokens.append(null if slot < 0 else concept_states[row, slot])
        rows.append(torch.stack(tokens) if tokens else concept_states.new_zeros(0, width))
    return torch.stack(rows)
