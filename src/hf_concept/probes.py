"""Stream probes for Hidden Decoding: the shared LM head applied to every stream's hidden state.

Legend: L tokens of the prompt, S streams (the paper's n), V vocabulary.

The HD paper (§5.3, Fig. 7–8) reads what each intermediate stream "would predict": the final-normed
hidden state of stream k of token i goes through the same LM head as the final stream, giving a
next-token distribution for token i + 1. Per (token, stream) this module reports that distribution's
top-1 token, its probability and its entropy. Entropies are in nats (natural log); `entropy_bits`
converts them to the paper's bits. Stream S - 1 is the final stream, whose distribution is exactly
softmax of the model's own logits.

The probe runs one forward pass with `output_stream_states=True` (no cache, eval mode, no gradients)
on a single prompt (batch 1). It never changes the model: training mode is restored afterwards.

    probe = probe_streams(model, text="The capital of France is", tokenizer=tokenizer)
    print(probe.to_table())
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from hf_concept.tables import format_table
from hf_concept.utils import eval_mode

HIDDEN_DECODING_MODEL_TYPE = "hidden_decoding"
# Longest token text shown in a table cell before it is cut with "…".
MAX_TOKEN_CHARS = 12


@dataclass(frozen=True)
class StreamProbe:
    """Per (token, stream) top-1 prediction of the LM head; row i is the distribution over token i + 1.

    token_ids: the prompt ids (L).
    top_ids, top_probs, entropies: (L, S) tensors; entropies in nats.
    token_texts / top_texts: decoded prompt tokens (L) and top-1 tokens (L lists of S), when a
    tokenizer was given; otherwise None and the table shows ids.
    """

    token_ids: list[int]
    top_ids: torch.Tensor
    top_probs: torch.Tensor
    entropies: torch.Tensor
    token_texts: list[str] | None = None
    top_texts: list[list[str]] | None = None

    @property
    def num_streams(self) -> int:
        return self.top_ids.shape[1]

    @property
    def entropy_bits(self) -> torch.Tensor:
        """(L, S) entropies in bits, the paper's unit (Fig. 7b)."""
        return self.entropies / math.log(2.0)

    def mean_entropy(self) -> torch.Tensor:
        """(S,) mean entropy per stream over the prompt, in nats."""
        return self.entropies.mean(dim=0)

    def differs_from_final(self) -> torch.Tensor:
        """(S,) fraction of tokens whose top-1 differs from the final stream's (Fig. 7a)."""
        return (self.top_ids != self.top_ids[:, -1:]).float().mean(dim=0)

    def to_table(self) -> str:
        """Plain-text table: one row per prompt token, one column per stream, cells `'tok' 0.42 H=3.10`;
        below a rule, each stream's mean entropy and how often its top-1 differs from the final stream's."""
        header = ["token"] + [f"E{k}" for k in range(self.num_streams)]
        header[-1] += " (final)"
        rows = []
        for position, token_id in enumerate(self.token_ids):
            label = _quote(self.token_texts[position]) if self.token_texts is not None else str(token_id)
            cells = [label]
            for stream in range(self.num_streams):
                if self.top_texts is not None:
                    top = _quote(self.top_texts[position][stream])
                else:
                    top = str(int(self.top_ids[position, stream]))
                probability = float(self.top_probs[position, stream])
                entropy = float(self.entropies[position, stream])
                cells.append(f"{top} {probability:.2f} H={entropy:.2f}")
            rows.append(cells)
        footer = [
            ["mean H"] + [f"H={float(value):.2f}" for value in self.mean_entropy()],
            ["top-1 != final"] + [f"{float(value):.0%}" for value in self.differs_from_final()],
        ]
        note = "row i: the next-token distribution each stream's state gives at token i; H: entropy in nats"
        return note + "\n" + format_table(header, rows, rule="columns", footer=footer)


def _quote(text: str) -> str:
    """repr-quoted token text (so spaces and newlines show), cut to MAX_TOKEN_CHARS characters."""
    if len(text) > MAX_TOKEN_CHARS:
        text = text[: MAX_TOKEN_CHARS - 1] + "…"
    return repr(text)


def _check_model(model: Any) -> None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    # model_type, not isinstance: a remote-code load defines its own copy of the classes (transformers
    # imports a checkpoint's code as a module of its own, under `transformers_modules`).
    if model_type != HIDDEN_DECODING_MODEL_TYPE or not hasattr(model, "lm_head"):
        raise ValueError(
            f"model: probe_streams needs a Hidden Decoding causal LM (config.model_type="
            f"{HIDDEN_DECODING_MODEL_TYPE!r} with an lm_head), got {type(model).__name__} with "
            f"model_type={model_type!r}"
        )


def _prompt_ids(input_ids: torch.Tensor | None, text: str | None, tokenizer: Any) -> torch.Tensor:
    """(1, L) prompt ids from exactly one of input_ids ((L,) or (1, L)) and text (needs the tokenizer)."""
    if (input_ids is None) == (text is None):
        raise ValueError("pass exactly one of input_ids or text")
    if text is not None:
        if tokenizer is None:
            raise ValueError("text: a tokenizer is needed to encode it")
        input_ids = tokenizer(text, return_tensors="pt").input_ids
    input_ids = torch.as_tensor(input_ids)
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"input_ids: the probe takes one prompt (batch 1), shape (L,) or (1, L); got shape "
            f"{tuple(input_ids.shape)}"
        )
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids: the prompt is empty")
    return input_ids


def probe_streams(
    model: Any,
    input_ids: torch.Tensor | None = None,
    *,
    text: str | None = None,
    tokenizer: Any = None,
) -> StreamProbe:
    """Top-1 token, its probability and the entropy (nats) of every stream's LM-head distribution.

    `model` is a Hidden Decoding causal LM (`config.model_type == "hidden_decoding"`); pass the prompt
    as `input_ids` ((L,) or (1, L)) or as `text` with its `tokenizer`. The tokenizer, when given, also
    decodes the prompt and the top-1 tokens for the table. Batch 1 only: a batch would need padding
    rules that a per-prompt probe does not need (probe prompts one at a time).
    """
    _check_model(model)
    input_ids = _prompt_ids(input_ids, text, tokenizer)
    device = model.lm_head.weight.device
    with eval_mode(model), torch.no_grad():
        outputs = model(input_ids=input_ids.to(device), use_cache=False, output_stream_states=True)
        stream_states = getattr(outputs, "stream_states", None)
        if stream_states is None:
            raise ValueError(f"model: {type(model).__name__} returned no stream_states")
        # (S, L, D) for the one prompt.
        stream_states = stream_states[0]
        top_ids, top_probs, entropies = [], [], []
        # One stream at a time: the (L, V) logits of one stream, never (S, L, V), are held at once.
        for states in stream_states:
            log_probs = torch.log_softmax(model.lm_head(states).float(), dim=-1)  # (L, V)
            best_log_prob, best_id = log_probs.max(dim=-1)
            top_ids.append(best_id)
            top_probs.append(best_log_prob.exp())
            # Terms with p = 0 contribute 0 (p·log p -> 0); xlogy keeps them from giving 0·(-inf) = nan.
            probs = log_probs.exp()
            entropies.append(-torch.special.xlogy(probs, probs).sum(dim=-1))
    top = torch.stack(top_ids, dim=1).cpu()  # (L, S)
    token_ids = input_ids[0].tolist()
    token_texts = top_texts = None
    if tokenizer is not None:
        token_texts = [tokenizer.decode([token_id]) for token_id in token_ids]
        top_texts = [[tokenizer.decode([int(token_id)]) for token_id in row] for row in top]
    return StreamProbe(
        token_ids=token_ids,
        top_ids=top,
        top_probs=torch.stack(top_probs, dim=1).cpu(),
        entropies=torch.stack(entropies, dim=1).cpu(),
        token_texts=token_texts,
        top_texts=top_texts,
    )
