"""DLCM concept replication written out: an explicit L x L mask built by loops, einsum scores, softmax.

Legend: B batch, L tokens, N concept slots, H query heads, G key/value heads, K head dim. Same contract as
`hf_concept.modeling.dlcm_replication`: position s carries slot index[b, s] (-1: nothing); query t sees the
positions s <= t of its own document that are real and carry a concept; a query that sees nothing gets 0.
"""

from __future__ import annotations

import torch


def replication_mask_loop(index: torch.Tensor, mask: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Bool (B, L, L): allowed[b, t, s]."""
    batch_size, length = mask.shape
    allowed = torch.zeros(batch_size, length, length, dtype=torch.bool)
    for row in range(batch_size):
        document, documents = -1, []
        for position in range(length):
            if mask[row, position] and starts[row, position]:
                document += 1
            documents.append(document)
        for query in range(length):
            for key in range(query + 1):
                allowed[row, query, key] = bool(
                    mask[row, query]
                    and mask[row, key]
                    and index[row, key] >= 0
                    and documents[key] == documents[query]
                )
    return allowed


def concept_attention_loop(
    query_states: torch.Tensor,
    concept_k: torch.Tensor,
    concept_v: torch.Tensor,
    index: torch.Tensor,
    mask: torch.Tensor,
    starts: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """(B, H, L, K): attention of each token over the replicated concept keys and values it may see."""
    batch_size, num_heads, _, head_dim = query_states.shape
    groups = num_heads // concept_k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    rows = []
    for row in range(batch_size):
        heads = []
        for head in range(num_heads):
            kv_head = head // groups
            keys = torch.stack([concept_k[row, kv_head, max(int(slot), 0)] for slot in index[row]])
            values = torch.stack([concept_v[row, kv_head, max(int(slot), 0)] for slot in index[row]])
            scores = torch.einsum("tk,sk->ts", query_states[row, head], keys) * scale
            allowed = replication_mask_loop(index[row : row + 1], mask[row : row + 1], starts[row : row + 1])[
                0
            ]
            scores = scores.masked_fill(~allowed, float("-inf"))
            weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
            heads.append(torch.einsum("ts,sk->tk", weights, values))
        rows.append(torch.stack(heads))
    return torch.stack(rows)
