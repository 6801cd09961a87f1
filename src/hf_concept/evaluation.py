"""Bits per byte of a causal language model over the LSLM byte vocabulary, and a matched GPT-2 baseline.

What `bits_per_byte` counts. The text becomes the token sequence `<BoS> b_1 … b_N` (ids from
`ByteTokenizer`: byte b is id b + 5). Every byte b_i of the text is predicted exactly once, from the tokens
before it, and its negative log-probability (natural log, normalised over the model's whole output
vocabulary, special ids included) is added to the total. Hence:

- `<BoS>` is context only: it is never predicted, and it opens the first window only (later windows start
  inside the text, as a model trained on random crops sees them).
- `<eos>` is neither appended nor counted: held-out text is a slice of a longer document, so "the text
  ends here" is not an event of the text, and counting it would make short texts look worse.
- `<pad>`, `<bos>` and `<nxt>` are not part of the text and are never counted. An LSLM's decoder also
  writes segment markers; `lslm_code_length` (below) reports those bits separately. This function
  scores only a model that predicts the next byte from the bytes before it.

bits/byte = total nats / (N · ln 2). A model that puts probability 1/V on every id scores exactly log2 V.

Sliding windows (`context` C tokens per forward pass, `stride` S new predictions per window): window k
scores the bytes b_i with i in [1 + kS, e), e = min(1 + (k+1)S, N + 1), running the model on tokens
max(0, e − C) … e − 1; so b_i is predicted from tokens max(0, e − C) … i − 1, which is at least C − S
tokens (or all earlier ones, near the start). With S = C − 1 and N < C one window scores everything, the
same sum as one full-sequence cross-entropy. Windows are batched with right padding and an attention
mask; a causal model's logits at real positions do not depend on the padding after them.

lm-eval's definition (`convention="lm-eval"`): lm-evaluation-harness (`loglikelihood_rolling`, then its
`bits_per_byte` metric) counts differently, so the two figures differ for the same model and text
(docs/benchmarks.md, "Our bits per byte and lm-eval's"). The text is encoded with the tokenizer's default
special tokens (for the ByteTokenizer `<BoS> b_1 … b_N <eos>`) and every one of those tokens is predicted, the
first from a prefix token (the tokenizer's bos id, else its eos id): so `<BoS>` and `<eos>` are scored
too, while the divisor is still the text's N UTF-8 bytes. Windows are disjoint blocks of L = `context`
predictions (lm-eval's `max_length`; by default the model's positions): block k predicts tokens
kL … kL + L − 1 in one pass over the L tokens that end just before its last one, so a block's first
token sees one token of context and its last sees L; the last, shorter block reads the L tokens before
its end too. In the terms above these are windows of L + 1 tokens with stride L over `<prefix>` + the
encoded text, the model reading each window without its last token.

An LSLM (`LSLMForCausalLM`) goes through `bits_per_byte` like any causal LM: its per-token logits predict
the next input token, and on plain text (no `<bos>`/`<nxt>` in the input) in eval mode the router closes
segments deterministically from the bytes up to each position, so the per-token logits give a proper
code for the bytes. Inside a segment they are the distribution of the byte's own decoder slot, whose
mass on `<nxt>` (and on the other special ids) is simply lost; after a byte that closes its segment
they are the distribution of the next segment's `<bos>` slot. Nothing else is counted.

`lslm_code_length` is the ELBO's view of the same windows: the decoder writes the bytes AND a `<nxt>`
after every byte that closes its segment. Per scored byte b_i it reads, from one forward pass:
- byte nats: -log p(b_i) at the slot before b_i's slot (the `<bos>` slot when b_i opens a segment, else
  the previous byte's slot): the very distribution the per-token logits give, so the byte total equals
  `bits_per_byte`'s on the same windows;
- boundary nats: -log p(`<nxt>`) at b_i's own slot when the router closes the segment at b_i (zero
  otherwise), i.e. a boundary is charged to the byte that closes it, in the window that scores that
  byte; the boundary after `<BoS>` (forced) is never charged, the one after the text's last byte is when
  the router closes there;
- segments: a scored byte that opens a segment counts one (the first byte of the text included), so
  bytes per segment = scored bytes / segments.
The KL term of the training loss is not a code length and is left out: at evaluation the boundaries are
a deterministic function of the prefix. As with any model here, each window is a fresh document: its
first byte opens a segment and reads no segment before the window. `lslm_code_length` also sums the
router's q_t over the scored bytes (`lslm_boundary_probabilities` gives q_t per column): its mean is the
rate at which training, which samples z_t ~ Bernoulli(q_t), would place boundaries, against the realised
rate of the thresholded inference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerBase

from hf_concept.modeling.configuration_lslm import LSLMConfig
from hf_concept.modeling.configuration_plain import PlainDecoderConfig
from hf_concept.modeling.layers import default_position_ids
from hf_concept.modeling.modeling_lslm import byte_view
from hf_concept.modeling.modeling_plain import PlainDecoderForCausalLM
from hf_concept.modeling.packing import document_starts
from hf_concept.modeling.tokenization_lslm import (
    BYTE_OFFSET,
    EOS_ID,
    PAD_ID,
    SEGMENT_END_ID,
    SEQUENCE_START_ID,
    VOCAB_SIZE,
    utf8_bytes,
)
from hf_concept.utils import eval_mode

DEFAULT_CONTEXT = 256
CONVENTIONS = ("sliding", "lm-eval")
NORMALIZATIONS = ("all", "bytes")


@dataclass(frozen=True)
class BitsPerByte:
    """Total negative log-likelihood `nats` of the `num_bytes` bytes of a text (see the module docstring)."""

    nats: float
    num_bytes: int

    @property
    def bits_per_byte(self) -> float:
        return self.nats / (self.num_bytes * math.log(2))


def _model_context_limit(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for field in ("n_positions", "max_position_embeddings"):
        limit = getattr(config, field, None)
        if isinstance(limit, int):
            return limit
    return None


def _check_window(model: nn.Module, context: int, stride: int | None, batch_size: int) -> int:
    """Validate the window arguments and return the stride (default: half the context)."""
    if not isinstance(context, int) or context < 2:
        raise ValueError(
            f"context={context!r} must be an int >= 2 (one token of context plus one prediction)"
        )
    limit = _model_context_limit(model)
    if limit is not None and context > limit:
        raise ValueError(f"context={context} exceeds the model's {limit} positions")
    stride = max(1, context // 2) if stride is None else stride
    if not isinstance(stride, int) or not 1 <= stride <= context - 1:
        # The first prediction of a window needs context - stride >= 1 tokens before it.
        raise ValueError(f"stride={stride!r} must be an int in [1, context - 1] = [1, {context - 1}]")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be an int >= 1")
    return stride


def _byte_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """`text` as byte ids through `tokenizer`, checked to be one id per UTF-8 byte."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"text={text!r:.40} must be a non-empty str: bits per byte of no bytes is undefined")
    # Special-token spellings in the text stay bytes: they are text here, not markers.
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    expected = [BYTE_OFFSET + value for value in utf8_bytes(text)]
    if ids != expected:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} does not map byte b to id b + {BYTE_OFFSET}; "
            "bits_per_byte needs the LSLM ByteTokenizer's layout"
        )
    return ids


def scoring_windows(num_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(window start, first scored position, window end) over token positions 0..num_tokens-1."""
    windows = []
    for first in range(1, num_tokens, stride):
        end = min(first + stride, num_tokens)
        windows.append((max(0, end - context), first, end))
    return windows


def padded_windows(
    tokens: torch.Tensor, batch: list[tuple[int, int, int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), each (len(batch), longest window): the windows, right-padded."""
    width = max(end - start for start, _, end in batch)
    input_ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (start, _, end) in enumerate(batch):
        input_ids[row, : end - start] = tokens[start:end]
        attention_mask[row, : end - start] = 1
    return input_ids, attention_mask


def _score_batch(
    model: nn.Module,
    tokens: torch.Tensor,
    batch: list[tuple[int, int, int]],
    read_last: bool = True,
    renormalize: bool = False,
) -> float:
    """Sum of -log p over the scored positions of `batch`'s windows, run as one right-padded forward pass.
    `read_last=False` runs the model on each window without its last token, whose logits score nothing.
    `renormalize=True` takes the softmax over the 256 byte ids only (`normalization="bytes"`)."""
    inputs = batch if read_last else [(start, first, end - 1) for start, first, end in batch]
    input_ids, attention_mask = padded_windows(tokens, inputs)
    device = next(model.parameters()).device
    logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
    if logits.shape[-1] < VOCAB_SIZE:
        raise ValueError(
            f"model outputs {logits.shape[-1]} logits per position; the byte vocabulary needs {VOCAB_SIZE}"
        )
    # float64, so that summing thousands of terms keeps the total exact to ~1e-12 (a uniform model
    # scores log2 V to that precision).
    offset = BYTE_OFFSET if renormalize else 0
    if renormalize:
        logits = logits[..., BYTE_OFFSET : BYTE_OFFSET + 256]
    log_probs = F.log_softmax(logits.double(), dim=-1).cpu()  # (B, T, V or 256)
    total = 0.0
    for row, (start, first, end) in enumerate(batch):
        # Position p's logits predict token p + 1; the scored tokens are first..end-1.
        predicted = log_probs[row, first - start - 1 : end - start - 1]  # (n, V)
        targets = tokens[first:end].unsqueeze(-1) - offset  # (n, 1)
        total -= predicted.gather(-1, targets).sum().item()
    return total


def _lm_eval_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """`<prefix>` + `text` encoded as lm-eval's Hugging Face model encodes a rolling request: with the
    tokenizer's default special tokens, unless the text already starts with the prefix token's text."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"text={text!r:.40} must be a non-empty str: bits per byte of no bytes is undefined")
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if prefix is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has neither a bos nor an eos token")
    specials = not text.startswith(tokenizer.decode(prefix))
    return [prefix, *tokenizer.encode(text, add_special_tokens=specials)]


def _lm_eval_window(model: nn.Module, context: int | None, stride: int | None, batch_size: int) -> int:
    """Validate the arguments for convention="lm-eval"; return its max_length L (default: the model's
    positions)."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be an int >= 1")
    if stride is not None:
        raise ValueError(
            f"stride={stride!r} must be None with convention='lm-eval' (its blocks are disjoint)"
        )
    limit = _model_context_limit(model)
    if context is None and limit is None:
        raise ValueError("context=None: the model names no positions limit; pass lm-eval's max_length")
    context = limit if context is None else context
    if not isinstance(context, int) or context < 1:
        raise ValueError(f"context={context!r} must be an int >= 1")
    if limit is not None and context > limit:
        raise ValueError(f"context={context} exceeds the model's {limit} positions")
    return context


def _check_convention(convention: str, normalization: str) -> None:
    if convention not in CONVENTIONS:
        raise ValueError(f"convention={convention!r} must be one of {CONVENTIONS}")
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r} must be one of {NORMALIZATIONS}")
    if normalization == "bytes" and convention != "sliding":
        raise ValueError("normalization='bytes' scores bytes only: use it with convention='sliding'")


def _sliding_windows(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    context: int,
    stride: int | None,
    batch_size: int,
) -> tuple[torch.Tensor, list[tuple[int, int, int]], int]:
    """(tokens `<BoS>` + the text's byte ids, the overlapping windows that score each byte once, bytes)."""
    stride = _check_window(model, context, stride, batch_size)
    tokens = torch.tensor([SEQUENCE_START_ID, *_byte_ids(tokenizer, text)], dtype=torch.long)
    return tokens, scoring_windows(len(tokens), context, stride), len(tokens) - 1


def _lm_eval_windows(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    context: int | None,
    stride: int | None,
    batch_size: int,
) -> tuple[torch.Tensor, list[tuple[int, int, int]], int]:
    """(tokens `<prefix>` + the encoded text, lm-eval's disjoint blocks as windows, the text's bytes)."""
    length = _lm_eval_window(model, context, stride, batch_size)
    tokens = torch.tensor(_lm_eval_tokens(tokenizer, text), dtype=torch.long)
    return tokens, scoring_windows(len(tokens), length + 1, length), len(text.encode("utf-8"))


@torch.no_grad()
def bits_per_byte(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    *,
    context: int | None = None,
    stride: int | None = None,
    batch_size: int = 8,
    convention: str = "sliding",
    normalization: str = "all",
) -> BitsPerByte:
    """Bits per byte of `text` under the causal LM `model` (counting rules in the module docstring).

    Args:
        model: called as `model(input_ids=..., attention_mask=...)`, returning `.logits` of shape (B, T, V)
            with V >= 261; run in eval mode (its training flag is restored afterwards).
        tokenizer: a `ByteTokenizer` (or any tokenizer with its byte layout: byte b is id b + 5); with
            convention="lm-eval", any tokenizer with a bos or eos token.
        text: non-empty text; its UTF-8 bytes are scored.
        context: tokens per window, at most the model's `n_positions`/`max_position_embeddings`; default
            256. With convention="lm-eval", lm-eval's `max_length`; default the model's positions.
        stride: new bytes scored per window, 1..context-1; default context // 2. None for "lm-eval".
        batch_size: windows per forward pass.
        convention: "sliding" (ours: bytes only, overlapping windows) or "lm-eval" (lm-evaluation-harness's
            rolling loglikelihood and `bits_per_byte`: specials scored too, disjoint blocks).
        normalization: "all" (the softmax over every output id, special ids included) or "bytes" (the
            softmax over the 256 byte ids only, "sliding" only). "bytes" is the code length of a coder
            that knows the next token is a byte. It is a valid code whenever each position's logits are a
            function of the tokens before it alone, as for an LSLM in eval mode, whose segmentation is a
            deterministic, causal function of the bytes read: the probability mass its decoder puts on
            `<nxt>`, `<bos>` and the other specials, which no byte of the text can take, goes back to the
            bytes instead of being lost.
    """
    _check_convention(convention, normalization)
    if convention == "lm-eval":
        tokens, windows, num_bytes = _lm_eval_windows(model, tokenizer, text, context, stride, batch_size)
    else:
        context = DEFAULT_CONTEXT if context is None else context
        tokens, windows, num_bytes = _sliding_windows(model, tokenizer, text, context, stride, batch_size)
    with eval_mode(model):
        nats = sum(
            _score_batch(
                model,
                tokens,
                windows[index : index + batch_size],
                convention == "sliding",
                normalization == "bytes",
            )
            for index in range(0, len(windows), batch_size)
        )
    return BitsPerByte(nats=nats, num_bytes=num_bytes)


@dataclass(frozen=True)
class LSLMCodeLength:
    """An LSLM's code length for the `num_bytes` bytes of a text, split as the ELBO sees it (see the module
    docstring): `byte_nats` for the bytes, `boundary_nats` for the `<nxt>` markers, `num_segments`
    segments opened among the scored bytes, and the sum of the router's q over them."""

    byte_nats: float
    boundary_nats: float
    num_bytes: int
    num_segments: int
    boundary_probability_sum: float = 0.0

    @property
    def byte_bits_per_byte(self) -> float:
        return self.byte_nats / (self.num_bytes * math.log(2))

    @property
    def boundary_bits_per_byte(self) -> float:
        return self.boundary_nats / (self.num_bytes * math.log(2))

    @property
    def bits_per_byte(self) -> float:
        """Bytes and boundaries together: the decoder's cross-entropy per byte of text, in bits."""
        return self.byte_bits_per_byte + self.boundary_bits_per_byte

    @property
    def bytes_per_segment(self) -> float:
        return self.num_bytes / max(self.num_segments, 1)

    @property
    def mean_boundary_probability(self) -> float:
        """Mean of the router's q over the scored bytes: the boundary rate that training would sample."""
        return self.boundary_probability_sum / self.num_bytes


def _lslm_byte_view(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    """The LSLM's `ByteView` of rows of bytes (right or left padding; no markers) and its token states."""
    config = model.config
    batch, length = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    mask = attention_mask.bool()
    markers = (input_ids == config.segment_start_token_id) | (input_ids == config.segment_end_token_id)
    if bool((markers & mask).any()):
        raise ValueError("the LSLM evaluation scores plain bytes: input_ids hold <bos>/<nxt> markers")
    position_ids = default_position_ids(attention_mask, length, 0, input_ids.device)
    view = byte_view(input_ids, mask, document_starts(mask, position_ids.expand(batch, -1)), config)
    return view, model.model.encode_tokens(view)


def _to_input_columns(values: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """(B, T) values of a `ByteView`'s columns (bytes at the right end) back at their input columns."""
    return torch.zeros_like(values).scatter_(1, order, values)


@torch.no_grad()
def lslm_boundary_probabilities(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, T) float32: the router's q_t (probability that the column's byte ends its segment, LSLM eq. 2)
    at each real input column of an `LSLMForCausalLM`, 0 at pads; `<BoS>` gets its q too, though it
    always ends its segment. Rows hold no markers."""
    view, token_states = _lslm_byte_view(model, input_ids, attention_mask)
    probs = torch.sigmoid(model.model.router(token_states)).masked_fill(~view.mask, 0.0)
    return _to_input_columns(probs, view.order)


def lslm_column_costs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Per input column of a batch of byte rows (no markers), from one pass of an LSLM's stages (in the
    model's current mode; `lslm_code_length` runs it in eval mode): (byte nats, boundary nats, opens,
    q), each (B, T). Byte nats: -log p of the column's byte at the slot before its own; boundary nats:
    -log p(`<nxt>`) at its own slot where the router (or `<BoS>`) closes the segment there, else 0;
    opens: the byte opens a segment; q: the router's boundary probability. Pads get zeros."""
    backbone = model.model
    view, token_states = _lslm_byte_view(model, input_ids, attention_mask)
    segmentation = backbone.segment(view, token_states)
    segments, valid, documents = backbone.encode_segments(token_states, segmentation, view)
    slots = backbone.decoder_slots(view, segmentation)
    slot_states = backbone.decode(slots, segments, valid, documents)
    log_probs = F.log_softmax(model.lm_head(slot_states).double(), dim=-1)  # (B, S, V)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)[:, None]
    own = slots.token_slot.clamp(min=1)  # (B, T) slot of each view byte; the slot before predicts it
    byte_nats = -log_probs[rows, own - 1, view.ids].masked_fill(~view.mask, 0.0)
    closes = view.mask & segmentation.content_ends
    boundary_nats = -log_probs[rows, own, SEGMENT_END_ID].masked_fill(~closes, 0.0)
    opens = (segmentation.opens & view.mask).double()
    probs = segmentation.probs.double().masked_fill(~view.mask, 0.0)
    return tuple(_to_input_columns(values, view.order) for values in (byte_nats, boundary_nats, opens, probs))


@torch.no_grad()
def lslm_code_length(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    *,
    context: int = DEFAULT_CONTEXT,
    stride: int | None = None,
    batch_size: int = 8,
) -> LSLMCodeLength:
    """The ELBO view of an LSLM on `text`: byte and boundary nats and segments over the same windows as
    `bits_per_byte` (arguments alike; counting rules in the module docstring). `model` is an
    `LSLMForCausalLM`; it runs in eval mode (its training flag is restored afterwards)."""
    tokens, windows, num_bytes = _sliding_windows(model, tokenizer, text, context, stride, batch_size)
    totals = torch.zeros(4, dtype=torch.float64)
    with eval_mode(model):
        for index in range(0, len(windows), batch_size):
            batch = windows[index : index + batch_size]
            input_ids, attention_mask = padded_windows(tokens, batch)
            device = next(model.parameters()).device
            costs = lslm_column_costs(model, input_ids.to(device), attention_mask.to(device))
            for row, (start, first, end) in enumerate(batch):
                scored = slice(first - start, end - start)
                totals += torch.stack([cost[row, scored].double().sum().cpu() for cost in costs])
    byte_nats, boundary_nats, segments, probabilities = totals.tolist()
    return LSLMCodeLength(byte_nats, boundary_nats, num_bytes, round(segments), probabilities)


@dataclass(frozen=True)
class GPT2Shape:
    """Depth, width and heads of a GPT-2 byte model, with its exact parameter count."""

    n_layer: int
    n_embd: int
    n_head: int
    num_parameters: int


def gpt2_num_parameters(n_layer: int, n_embd: int, n_positions: int, vocab_size: int = VOCAB_SIZE) -> int:
    """Parameters of `GPT2LMHeadModel` with tied input/output embeddings and a 4x MLP.

    Token and position embeddings, then per layer two LayerNorms (4D), the fused QKV projection
    (3D² + 3D), the attention output (D² + D) and the MLP (8D² + 5D), then the final LayerNorm (2D).
    """
    per_layer = 12 * n_embd * n_embd + 13 * n_embd
    return (vocab_size + n_positions) * n_embd + n_layer * per_layer + 2 * n_embd


def _heads_for(n_embd: int, head_dim: int) -> int:
    """The head count dividing `n_embd` whose head size is closest to `head_dim` (fewer heads on a tie)."""
    divisors = [heads for heads in range(1, n_embd + 1) if n_embd % heads == 0]
    return min(divisors, key=lambda heads: (abs(math.log(n_embd / heads / head_dim)), heads))


def _shape_candidates(
    num_parameters: int, depths: range | list[int], multiple: int, n_positions: int
) -> list[tuple[float, int, int, int]]:
    """(relative error, depth, width, count) of the two widths (multiples of `multiple`) nearest target."""
    candidates = []
    for depth in depths:
        # The count is increasing in width, so the best width is next to the root of the quadratic.
        a, b = 12 * depth, 13 * depth + 2 + VOCAB_SIZE + n_positions
        root = (-b + math.sqrt(b * b + 4 * a * num_parameters)) / (2 * a)
        for steps in {max(1, math.floor(root / multiple)), max(1, math.ceil(root / multiple))}:
            count = gpt2_num_parameters(depth, steps * multiple, n_positions)
            candidates.append((abs(count - num_parameters) / num_parameters, depth, steps * multiple, count))
    return candidates


def match_gpt2_to(
    num_parameters: int,
    *,
    n_positions: int = 1024,
    n_layer: int | None = None,
    max_layers: int = 48,
    width_multiple: int = 16,
    aspect_ratio: float = 64.0,
    head_dim: int = 64,
    tolerance: float = 0.03,
) -> GPT2Shape:
    """A GPT-2 byte model shape whose parameter count is within `tolerance` of `num_parameters`.

    Search: for each depth 1..`max_layers` (or only `n_layer` when given), the width that is a multiple of
    `width_multiple` and brings `gpt2_num_parameters` closest to the target; when none is within
    `tolerance`, the search repeats with half the multiple, down to 1. Of the shapes within
    `tolerance` (relative), the one whose width/depth is closest to `aspect_ratio` (GPT-2 small has
    768/12 = 64) on a log scale wins; ties go to the smaller error. Heads: the divisor of the width whose head
    size is closest to `head_dim`. Raises ValueError when no shape is within tolerance.
    """
    if not isinstance(num_parameters, int) or num_parameters < 1:
        raise ValueError(f"num_parameters={num_parameters!r} must be a positive int")
    if n_layer is not None and (not isinstance(n_layer, int) or n_layer < 1):
        raise ValueError(f"n_layer={n_layer!r} must be a positive int or None")
    depths = [n_layer] if n_layer is not None else range(1, max_layers + 1)
    multiple = width_multiple
    within = [
        c for c in _shape_candidates(num_parameters, depths, multiple, n_positions) if c[0] <= tolerance
    ]
    while not within and multiple > 1:
        # A fixed or shallow depth may need a finer width step to land within tolerance.
        multiple //= 2
        candidates = _shape_candidates(num_parameters, depths, multiple, n_positions)
        within = [candidate for candidate in candidates if candidate[0] <= tolerance]
    if not within:
        error, depth, n_embd, count = min(_shape_candidates(num_parameters, depths, 1, n_positions))
        raise ValueError(
            f"num_parameters={num_parameters}: no GPT-2 shape within tolerance={tolerance} "
            f"(closest: n_layer={depth}, n_embd={n_embd} with {count} parameters, {error:.1%} off); "
            "raise tolerance or allow more layers"
        )
    error, depth, n_embd, count = min(within, key=lambda c: (abs(math.log(c[2] / c[1] / aspect_ratio)), c[0]))
    return GPT2Shape(n_layer=depth, n_embd=n_embd, n_head=_heads_for(n_embd, head_dim), num_parameters=count)


def byte_gpt2_baseline(
    num_parameters: int | None = None,
    *,
    n_layer: int | None = None,
    n_embd: int | None = None,
    n_head: int | None = None,
    n_positions: int = 1024,
    dropout: float = 0.0,
    head_dim: int = 64,
    **config_kwargs,
) -> GPT2LMHeadModel:
    """A randomly initialised GPT-2 (transformers' `GPT2LMHeadModel`) over the 261-id byte vocabulary.

    Either `num_parameters` (the shape comes from `match_gpt2_to`, with `n_layer` optionally fixing the
    depth) or `n_layer` and `n_embd` (default 4 and 256 when neither is given). `<pad>`, `<BoS>` and `<eos>`
    ids come from the byte tokenizer. Seed torch before calling for reproducible weights.
    """
    if num_parameters is not None:
        if n_embd is not None:
            raise ValueError(f"n_embd={n_embd} conflicts with num_parameters={num_parameters}: give one")
        shape = match_gpt2_to(num_parameters, n_positions=n_positions, n_layer=n_layer, head_dim=head_dim)
        n_layer, n_embd, n_head = shape.n_layer, shape.n_embd, n_head or shape.n_head
    n_layer = 4 if n_layer is None else n_layer
    n_embd = 256 if n_embd is None else n_embd
    n_head = _heads_for(n_embd, head_dim) if n_head is None else n_head
    if n_embd % n_head:
        raise ValueError(f"n_head={n_head} must divide n_embd={n_embd}")
    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=n_positions,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=SEQUENCE_START_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        **config_kwargs,
    )
    return GPT2LMHeadModel(config)


def byte_decoder_baseline(
    n_layer: int, n_embd: int, *, head_dim: int = 32, n_positions: int = 1024
) -> PlainDecoderForCausalLM:
    """The fair byte baseline of an LSLM: the project's own decoder (`PlainDecoderForCausalLM`:
    SwiGLU MLPs 4x wide, RMSNorm, RoPE, the LSLM stages' layers) over the 261-id byte vocabulary, at the
    LSLM's width and total depth. Seed torch before calling for reproducible weights."""
    if n_embd % head_dim:
        raise ValueError(f"n_embd={n_embd} must be a multiple of head_dim={head_dim}")
    config = PlainDecoderConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=n_embd,
        intermediate_size=4 * n_embd,
        num_hidden_layers=n_layer,
        num_attention_heads=n_embd // head_dim,
        max_position_embeddings=n_positions,
        bos_token_id=SEQUENCE_START_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return PlainDecoderForCausalLM(config)


def lslm_config_for(
    layers: tuple[int, int, int], widths: tuple[int, int, int], head_width: int = 32, **fields
) -> LSLMConfig:
    """An LSLM of (token, segment, decoder) `layers` and `widths`, heads `head_width` wide and MLPs 4x
    wide in every stage, other `fields` passed on; checked, with sdpa attention (the benchmarks' shape)."""
    stages = {}
    for prefix, width in zip(("token_", "", "decoder_"), widths, strict=True):
        stages[f"{prefix}hidden_size"] = width
        stages[f"{prefix}intermediate_size"] = 4 * width
        stages[f"{prefix}num_attention_heads"] = max(1, width // head_width)
    token_layers, segment_layers, decoder_layers = layers
    config = LSLMConfig(
        **stages,
        token_encoder_layers=token_layers,
        segment_encoder_layers=segment_layers,
        decoder_layers=decoder_layers,
        **fields,
    )
    config.check_fields()
    config._attn_implementation = "sdpa"
    return config
