"""LSLM's semantics written with loops: one input column, one segment, one document at a time.

`reference_logits(model, input_ids, position_ids)` recomputes an `LSLMForCausalLM`'s per-token logits and
decoder loss for ONE row (no padding; packed documents and `<bos>`/`<nxt>` markers allowed) with the
model's own weights and router (eval mode: decisions are deterministic, by the config's `boundary_rule`),
but none of its vectorised bookkeeping. It walks the input columns as generation does:
- markers are not bytes: the token encoder reads the row with them taken out (positions count bytes);
- a byte joins the open segment, which it closes if the router says so or it is `<BoS>`/`<eos>`; a marker
  closes the open segment; a document's last byte closes its segment for the loss only;
- each column's logits come from the decoder run alone over [`<bos>`, the open segment's bytes] with
  cross-attention to [null] + the closed segments of its document (encoded one document at a time), or,
  when nothing is open, over [`<bos>`] alone.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch

from hf_concept.modeling.packing import document_starts


def _run(layers, states: torch.Tensor, rope_module, positions: torch.Tensor, extra=None) -> torch.Tensor:
    """Layers over one (1, n, ·) sequence with an explicit causal boolean mask."""
    length = states.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    rope = rope_module(states, positions[None])
    for layer in layers:
        if extra is None:
            states, _ = layer(states, attention_mask=causal, position_embeddings=rope)
        else:
            states, _ = layer(states, *extra, attention_mask=causal, position_embeddings=rope)
    return states


def _pool(token_states: torch.Tensor, pooling: str) -> torch.Tensor:
    if pooling == "mean":
        return token_states.mean(dim=0)
    hops = int(pooling.split(":")[1])
    return token_states[-(hops + 1) :].sum(dim=0)


def _byte_states(
    backbone, ids: list[int], documents: list[int], is_byte: list[bool]
) -> dict[int, torch.Tensor]:
    """Token-encoder state of each byte column, each document's bytes run alone."""
    states: dict[int, torch.Tensor] = {}
    for document in sorted(set(documents)):
        columns = [c for c, d in enumerate(documents) if d == document and is_byte[c]]
        if not columns:
            continue
        hidden = backbone.embed_tokens(torch.tensor([[ids[c] for c in columns]]))
        hidden = _run(backbone.token_layers, hidden, backbone.token_rotary_emb, torch.arange(len(columns)))
        for index, column in enumerate(columns):
            states[column] = backbone.token_norm(hidden)[0, index]
    return states


def _encode(backbone, pooled: list[torch.Tensor]) -> list[torch.Tensor]:
    """Segment-encoder states of one document's closed segments, in order."""
    if not pooled:
        return []
    rows = torch.stack(pooled)
    if backbone.segment_in_proj is not None:
        rows = backbone.segment_in_proj(rows)
    states = _run(backbone.segment_layers, rows[None], backbone.rotary_emb, torch.arange(len(pooled)))
    return list(backbone.segment_norm(states)[0])


def _decode(model, slot_ids: list[int], encoded: list[torch.Tensor]) -> torch.Tensor:
    """(n, V) logits of the decoder over [`<bos>`, bytes] reading [null] + `encoded`."""
    backbone = model.model
    table = torch.stack([backbone.null_segment, *encoded])[None]
    states = backbone.decoder_embed_tokens(torch.tensor([slot_ids]))
    if backbone.segment_to_decoder is not None:
        # Every slot also reads the latest segment (the null segment before the first).
        states = states + backbone.segment_to_decoder(table[0, -1])
    positions = torch.arange(len(slot_ids))
    rope = backbone.decoder_rotary_emb(states, positions[None])
    causal = torch.ones(len(slot_ids), len(slot_ids), dtype=torch.bool).tril()[None, None]
    allowed = torch.ones(1, len(slot_ids), table.shape[1], dtype=torch.bool)
    for layer in backbone.decoder_layers:
        keys, values = layer.cross_attn.project_segments(table)
        states, _ = layer(states, keys, values, allowed, attention_mask=causal, position_embeddings=rope)
    return model.lm_head(backbone.decoder_norm(states))[0]


@torch.no_grad()
def reference_logits(model, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None):
    """((T, V) per-token logits, decoder cross-entropy in nats per target) for a (1, T) row."""
    config, backbone = model.config, model.model
    ids = input_ids[0].tolist()
    if position_ids is None:
        position_ids = torch.arange(len(ids))[None]
    starts = document_starts(torch.ones_like(input_ids, dtype=torch.bool), position_ids)[0].tolist()
    documents = torch.cumsum(torch.tensor(starts).long(), 0).tolist()
    markers = (config.segment_start_token_id, config.segment_end_token_id)
    is_byte = [token not in markers for token in ids]
    byte_states = _byte_states(backbone, ids, documents, is_byte)
    special = (config.bos_token_id, config.eos_token_id)
    logits, segments = [], []  # segments: (document, byte columns, closed by a boundary)
    open_columns: list[int] = []
    pooled: list[torch.Tensor] = []
    running = 0.0  # boundary_rule "rate": the document's running sum of q (in 2^-16 steps)
    rank = 0  # the byte's rank in its document (boundary_source "every" / "random")
    for column, token in enumerate(ids):
        if starts[column]:
            if open_columns:
                segments.append((documents[column - 1], open_columns, True))
            open_columns, pooled, running, rank = [], [], 0.0, 0
        if is_byte[column]:
            open_columns.append(column)
            q = float(torch.sigmoid(backbone.router(byte_states[column][None, None]))[0, 0])
            rank += 1
            if token in special:
                closes = True
            elif config.boundary_source != "router":
                closes = _source_closes(config, rank - 1)
            elif config.boundary_rule == "rate":
                step = round(q * 2**16) / 2**16
                # Closes where the running sum passes a half-integer (boundary_rules' docstring).
                closes = math.floor(running + step + 0.5) > math.floor(running + 0.5)
                running += step
            else:
                closes = q >= config.boundary_threshold
        else:
            closes = bool(open_columns)
        if closes:
            pooled.append(_pool(torch.stack([byte_states[c] for c in open_columns]), config.pooling))
            segments.append((documents[column], open_columns, True))
            open_columns = []
        encoded = _encode(backbone, pooled)
        slot_ids = [config.segment_start_token_id] + [ids[c] for c in open_columns]
        logits.append(_decode(model, slot_ids, encoded)[-1])
    if open_columns:
        segments.append((documents[-1], open_columns, False))
    return torch.stack(logits), _loss(model, ids, segments, byte_states)


def _source_closes(config, rank: int) -> bool:
    """`boundary_source` "every" / "random" for the byte of `rank` in its document, in plain integers."""
    if config.boundary_source == "every":
        return True
    mask = 0xFFFFFFFF
    mixed = (rank ^ ((config.boundary_seed * 0x27D4EB2D) & mask)) & mask
    for _ in range(3):
        mixed = (((mixed >> 16) ^ mixed) * 0x45D9F3B) & mask
    mixed = (mixed >> 16) ^ mixed
    alpha, beta = config.beta_prior()
    return mixed < int(alpha / (alpha + beta) * 2**32)


def _loss(model, ids, segments, byte_states) -> torch.Tensor:
    """Mean cross-entropy over the decoder's scored targets (the module docstring of modeling_lslm)."""
    total, count = _loss_sum(model, ids, segments, byte_states)
    return total / max(count, 1)


def _loss_sum(model, ids, segments, byte_states) -> tuple[torch.Tensor | float, int]:
    """(summed cross-entropy, number of targets) over the decoder's scored targets: every byte of a
    segment, and its `<nxt>` when it closed (not after `<eos>`) and `segment_end_loss` is on."""
    config, backbone = model.config, model.model
    total, count = 0.0, 0
    pooled: dict[int, list[torch.Tensor]] = {}
    for document, columns, closed in segments:
        encoded = _encode(backbone, pooled.get(document, []))
        pooled.setdefault(document, []).append(
            _pool(torch.stack([byte_states[c] for c in columns]), config.pooling)
        )
        if ids[columns[0]] == config.bos_token_id:
            continue
        slot_logits = _decode(model, [config.segment_start_token_id] + [ids[c] for c in columns], encoded)
        targets = [ids[c] for c in columns]
        if closed and ids[columns[-1]] != config.eos_token_id:
            targets.append(config.segment_end_token_id)
        for slot, target in enumerate(targets):
            if slot > 0 and ids[columns[slot - 1]] == config.eos_token_id:
                continue
            if target == config.segment_end_token_id and not config.segment_end_loss:
                continue
            log_probs = torch.log_softmax(
                slot_logits[slot].to(torch.promote_types(slot_logits.dtype, torch.float32)), -1
            )
            total = total - log_probs[target]
            count += 1
    return total, count


def beta_expected_kl_reference(logits: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """E_{π~Beta(a, b)}[KL(Bernoulli(q) ‖ Bernoulli(π))] written with probabilities, in float64:
    q log q + (1 − q) log(1 − q) − q E[log π] − (1 − q) E[log(1 − π)], E[log π] = ψ(a) − ψ(a + b) and
    E[log(1 − π)] = ψ(b) − ψ(a + b) (torch.digamma)."""
    q = torch.sigmoid(logits.double())
    a, b = torch.tensor(alpha, dtype=torch.float64), torch.tensor(beta, dtype=torch.float64)
    mean_log_pi = torch.digamma(a) - torch.digamma(a + b)
    mean_log_not_pi = torch.digamma(b) - torch.digamma(a + b)
    return q * torch.log(q) + (1 - q) * torch.log(1 - q) - q * mean_log_pi - (1 - q) * mean_log_not_pi


def layout_objective_reference(model, input_ids: torch.Tensor, ends: list[bool]) -> torch.Tensor:
    """The negative ELBO of one row (1, T) of bytes (`<BoS>` first, no markers, one document) under the
    given end decisions, summed (not divided by the predicted bytes): the decoder's scored cross-entropy
    + `kl_weight` · the prior's term (`prior_loss`). `ends[t]` decides byte t, used where the byte's end
    is not forced (`<BoS>` and `<eos>` always end). Gradients reach every weight but through the layout:
    the count priors score the count as a number, the KL priors are functions of the router's q."""
    config, backbone = model.config, model.model
    ids = input_ids[0].tolist()
    byte_states = _byte_states(backbone, ids, [1] * len(ids), [True] * len(ids))
    special = (config.bos_token_id, config.eos_token_id)
    segments, open_columns = [], []
    for column, token in enumerate(ids):
        open_columns.append(column)
        if token in special or ends[column]:
            segments.append((1, open_columns, True))
            open_columns = []
    if open_columns:
        segments.append((1, open_columns, False))
    total, _ = _loss_sum(model, ids, segments, byte_states)
    logits, free = router_logits_reference(model, input_ids, byte_states)
    return total + config.kl_weight * _prior_term(config, logits, sum(bool(ends[c]) for c in free))


def router_logits_reference(
    model, input_ids: torch.Tensor, byte_states: dict[int, torch.Tensor] | None = None
) -> tuple[torch.Tensor, list[int]]:
    """((n,) router logits p̂_t of the row's free bytes, their n columns) for one row (1, T) of bytes
    (`<BoS>` first, no markers): every byte but `<BoS>` and `<eos>` is decided by the router."""
    config, backbone = model.config, model.model
    ids = input_ids[0].tolist()
    if byte_states is None:
        byte_states = _byte_states(backbone, ids, [1] * len(ids), [True] * len(ids))
    free = [c for c, token in enumerate(ids) if token not in (config.bos_token_id, config.eos_token_id)]
    return torch.stack([backbone.router(byte_states[c][None, None])[0, 0] for c in free]), free


def _prior_term(config, logits: torch.Tensor, count: int) -> torch.Tensor | float:
    """The prior's term of one row: Σ of the per-byte KL over the free bytes' `logits`, or −log P(count)."""
    alpha, beta = config.beta_prior()
    if config.prior_loss == "kl":
        q, p = torch.sigmoid(logits), config.prior_mean
        return (q * torch.log(q / p) + (1 - q) * torch.log((1 - q) / (1 - p))).sum()
    if config.prior_loss == "beta_kl":
        return beta_expected_kl_reference(logits, alpha, beta).to(logits.dtype).sum()
    total = len(logits)
    log_choose = math.lgamma(total + 1) - math.lgamma(count + 1) - math.lgamma(total - count + 1)
    if config.prior_loss == "binomial":
        return -(
            log_choose
            + count * math.log(config.prior_mean)
            + (total - count) * math.log1p(-config.prior_mean)
        )
    log_beta = (
        math.lgamma(count + alpha) + math.lgamma(total - count + beta) - math.lgamma(total + alpha + beta)
    )
    return -(log_choose + log_beta - (math.lgamma(alpha) + math.lgamma(beta) - math.lgamma(alpha + beta)))


def expected_loss_reference(
    objective: Callable[[list[bool]], torch.Tensor], logits: torch.Tensor, decided: list[int], length: int
) -> torch.Tensor:
    """E_{Z~q}[objective(Z)] by enumeration: Σ over the 2^n layouts of the `decided` columns (n of them,
    the others False) of Π_t q_t^{z_t} (1 − q_t)^{1 − z_t} · objective(Z), with q = σ(`logits`) (n,).
    Its autograd gradient is the exact gradient of the expected objective."""
    probs = torch.sigmoid(logits)
    total = 0.0
    for layout in itertools.product((False, True), repeat=len(decided)):
        ends = [False] * length
        weight = 1.0
        for index, (column, end) in enumerate(zip(decided, layout, strict=True)):
            ends[column] = end
            weight = weight * (probs[index] if end else 1 - probs[index])
        total = total + weight * objective(ends)
    return total
