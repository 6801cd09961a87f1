"""`output_attentions=True` in every family: under eager attention each family returns the
weights its output class documents, in forward and per step of `generate`; under sdpa it does what a
transformers Llama does (a warning and an empty tuple); not asking returns None and changes nothing.

Token ids are drawn from [5, vocab): no pad, bos, eos or LSLM marker appears by chance, so LSLM's byte
view equals the input columns. Batches are left-padded.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.testing import assert_close
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from hf_concept.modeling.dlcm_replication import _expand_heads
from hf_concept.modeling.modeling_dlcm import DLCMForCausalLM
from hf_concept.modeling.modeling_plain import PlainDecoderForCausalLM
from tests.conformance.families import FAMILIES, FamilySpec

PAD = 0
FIRST_ID = 5
ATOL = 1e-5
SPECS = {spec.name: spec for spec in FAMILIES}


@pytest.fixture(params=FAMILIES, ids=lambda spec: spec.name)
def spec(request) -> FamilySpec:
    return request.param


def build(spec: FamilySpec, implementation: str = "eager", **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model_class = spec.model_class()
    model = model_class._from_config(spec.make_config(**overrides), attn_implementation=implementation)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model.eval()


def left_padded(spec: FamilySpec, lengths=(9, 6), seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids and mask, each row right-aligned."""
    generator = torch.Generator().manual_seed(seed)
    vocab_size = spec.make_config().vocab_size
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    attention_mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(FIRST_ID, vocab_size, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return input_ids, attention_mask


def check_rows(weights: torch.Tensor, real_queries: torch.Tensor | None = None) -> None:
    """Weights are probabilities: non-negative, each row summing to 1 (or to 0, a row that sees nothing);
    rows of `real_queries` (broadcast to (B', 1, Lq)) sum to 1."""
    assert torch.isfinite(weights).all() and (weights >= 0).all()
    sums = weights.sum(dim=-1)
    assert torch.all(((sums - 1).abs() < ATOL) | (sums.abs() < ATOL))
    if real_queries is not None:
        assert_close(sums[real_queries.expand_as(sums)], torch.ones_like(sums[real_queries.expand_as(sums)]))


def check_causal_over_tokens(
    weights: torch.Tensor, key_mask: torch.Tensor, window: int | None = None
) -> None:
    """(B', H, Lq, Lk) weights of the last Lq of Lk positions, `key_mask` (B', Lk) real positions: real
    queries sum to 1 over real keys at or before themselves (within `window`), everything else is 0."""
    query_length, key_length = weights.shape[-2:]
    keys = torch.arange(key_length)
    queries = keys[key_length - query_length :]
    allowed = keys[None, :] <= queries[:, None]
    if window is not None:
        allowed = allowed & (queries[:, None] - keys[None, :] < window)
    # (B', 1, Lq, Lk)
    allowed = allowed[None, None] & key_mask[:, None, None, :].bool()
    real_queries = key_mask[:, None, key_length - query_length :].bool()
    check_rows(weights, real_queries)
    real_rows = real_queries[..., None].expand_as(weights)
    assert torch.all(weights[real_rows & ~allowed.expand_as(weights)] == 0)


def check_causal_over_slots(weights: torch.Tensor) -> None:
    """Concept, segment or slot attention: square over the call's own slots, nothing above the diagonal."""
    assert weights.shape[-1] == weights.shape[-2]
    check_rows(weights)
    assert torch.all(weights.triu(diagonal=1) == 0)


# Forward, family by family.


@pytest.mark.parametrize("name", ["plain", "plain-moe"])
def test_plain_returns_one_causal_map_per_layer_as_llama(name):
    spec = SPECS[name]
    model = build(spec)
    input_ids, attention_mask = left_padded(spec)
    attentions = model(input_ids, attention_mask=attention_mask, output_attentions=True).attentions
    config = model.config
    assert isinstance(attentions, tuple) and len(attentions) == config.num_hidden_layers
    for weights in attentions:
        assert weights.shape == (2, config.num_attention_heads, 9, 9)
        check_causal_over_tokens(weights, attention_mask)


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("conceptmoe-first", {}),
        # Two concept layers, the second run twice more: four passes, in the order they run.
        ("conceptmoe-first", dict(num_hidden_layers=6, concept_loop=[1, 2, 2])),
        ("conceptmoe-mean", {}),
        ("conceptmoe-concept-topk", {}),
        ("dlcm", {}),
    ],
)
def test_concept_families_return_encoder_concept_and_decoder_maps(name, overrides):
    spec = SPECS[name]
    model = build(spec, **overrides)
    input_ids, attention_mask = left_padded(spec)
    attentions = model(input_ids, attention_mask=attention_mask, output_attentions=True).attentions
    backbone, config = model.model, model.config
    cross = isinstance(model, DLCMForCausalLM)
    passes = len(backbone.concept_layer_schedule())
    num_encoder, num_decoder = len(backbone.encoder_layers), len(backbone.decoder_layers)
    assert len(attentions) == num_encoder + passes + num_decoder * (2 if cross else 1)
    encoder, rest = attentions[:num_encoder], attentions[num_encoder:]
    concept, decoder = rest[:passes], rest[passes:]
    for weights in encoder + decoder[:: 2 if cross else 1]:
        assert weights.shape == (2, config.num_attention_heads, 9, 9)
        check_causal_over_tokens(weights, attention_mask)
    concept_heads = backbone.concept_layers[0].self_attn.num_heads
    num_concepts = concept[0].shape[-1]
    for weights in concept:
        # Token-aligned: row t holds the weights of the concept token t emits, zeros where none.
        assert weights.shape == (2, concept_heads, 9, num_concepts)
        check_rows(weights)
        for row in range(2):
            emitting = weights[row, 0].sum(dim=-1) > 0.5  # (L,)
            assert not weights[row][:, ~emitting].any()
            # The row's concepts in emission order over the batch's slots, its padding slots unread.
            own = int(emitting.sum())
            check_causal_over_slots(weights[row][:, emitting][..., :own])
            assert not weights[row][:, emitting][..., own:].any()
    # A looped layer's passes are distinct runs.
    assert len({id(weights) for weights in concept}) == passes
    if cross:
        for weights in decoder[1::2]:
            # The null concept, then the call's concepts; pads see nothing.
            assert weights.shape == (2, config.cross_num_attention_heads, 9, 1 + num_concepts)
            check_rows(weights, attention_mask[:, None].bool())
            assert torch.all(weights[1, :, :3] == 0)


def interleaved(weights: torch.Tensor, streams: int) -> torch.Tensor:
    """(B, H, S·L, S·T) in the interleaved order (token i's stream k at i·S + k) from Hidden Decoding's
    token-aligned (B·S, H·S, L, T) map of a full or local layer."""
    rows, heads, length, keys = weights.shape
    grouped = weights.view(rows // streams, streams, heads // streams, streams, length, keys)
    # (B, Sq, H, Sk, L, T) -> (B, H, L, Sq, T, Sk)
    grouped = grouped.permute(0, 2, 4, 1, 5, 3)
    return grouped.reshape(rows // streams, heads // streams, length * streams, keys * streams)


def in_query_rows(model: torch.nn.Module, index: int, weights: torch.Tensor) -> torch.Tensor:
    """Entry `index`'s weights with each query's whole distribution on one row: Hidden Decoding's full and
    local layers put the key streams in the heads (`interleaved` undoes it); other entries as they are."""
    layout = getattr(model.config, "stream_attention_layout", None)
    if layout is None or layout[index] == "intra":
        return weights
    return interleaved(weights, model.config.num_streams)


@pytest.mark.parametrize("name", ["hidden-decoding", "hidden-decoding-shared-moe"])
def test_hidden_decoding_returns_folded_intra_and_interleaved_maps(name):
    spec = SPECS[name]
    model = build(spec)
    input_ids, attention_mask = left_padded(spec)
    attentions = model(input_ids, attention_mask=attention_mask, output_attentions=True).attentions
    config = model.config
    streams, heads = config.num_streams, config.num_attention_heads
    assert len(attentions) == config.num_hidden_layers
    for kind, weights in zip(config.stream_attention_layout, attentions, strict=True):
        if kind == "intra":
            # Row b·S + k is stream k of sample b, over its own stream's tokens.
            assert weights.shape == (2 * streams, heads, 9, 9)
            check_causal_over_tokens(weights, attention_mask.repeat_interleave(streams, dim=0))
        else:
            # Token-aligned: query streams folded into the batch, key streams into the heads.
            assert weights.shape == (2 * streams, heads * streams, 9, 9)
            weights = interleaved(weights, streams)
            window = config.sliding_window if kind == "local" else None
            check_causal_over_tokens(weights, attention_mask.repeat_interleave(streams, dim=1), window)


def test_hidden_decoding_shared_kv_puts_the_own_key_at_the_current_token():
    spec = SPECS["hidden-decoding-shared-moe"]
    model = build(spec)
    input_ids, _ = left_padded(spec, lengths=(6,))
    attentions = model(input_ids, output_attentions=True).attentions
    intra = attentions[model.config.stream_attention_layout.index("intra")]
    streams = model.config.num_streams
    # (B, S, H, L, L): every stream puts weight on its current token, the final stream's or its own key.
    per_stream = intra.unflatten(0, (1, streams))
    assert torch.all(per_stream.diagonal(dim1=-2, dim2=-1) > 0)


@pytest.mark.parametrize("name", ["lslm", "lslm-hops"])
def test_lslm_returns_token_segment_and_decoder_maps(name):
    spec = SPECS[name]
    model = build(spec)
    input_ids, attention_mask = left_padded(spec)
    attentions = model(input_ids, attention_mask=attention_mask, output_attentions=True).attentions
    backbone, config = model.model, model.config
    num_token, num_segment = len(backbone.token_layers), len(backbone.segment_layers)
    assert len(attentions) == num_token + num_segment + 2 * len(backbone.decoder_layers)
    token = attentions[:num_token]
    segment = attentions[num_token : num_token + num_segment]
    decoder = attentions[num_token + num_segment :]
    for weights in token:
        # Without markers the byte view is the input columns.
        assert weights.shape == (2, config.token_num_attention_heads, 9, 9)
        check_causal_over_tokens(weights, attention_mask)
    # Token-aligned: row t holds the segment column t closes (zeros where none), and the decoder slot
    # whose logits column t reports.
    num_segments = segment[0].shape[-1]
    for weights in segment:
        assert weights.shape == (2, config.num_attention_heads, 9, num_segments)
        check_rows(weights)
        for row in range(2):
            closing = weights[row, 0].sum(dim=-1) > 0.5  # (L,)
            # The row's segments in closing order, each over itself and the ones before.
            own = int(closing.sum())
            check_causal_over_slots(weights[row][:, closing][..., :own])
            assert not weights[row][:, closing][..., own:].any()
    real = attention_mask[:, None].bool()
    for self_weights, cross_weights in zip(decoder[::2], decoder[1::2], strict=True):
        # Self-attention keys: the slots of the reported slot's segment by position, `<bos>` first.
        assert self_weights.shape[:3] == (2, config.decoder_num_attention_heads, 9)
        check_rows(self_weights, real)
        assert torch.all(self_weights[:, :, 3:, 0] > 0), "every real column reads its segment's <bos>"
        assert cross_weights.shape == (2, config.decoder_num_attention_heads, 9, 1 + num_segments)
        check_rows(cross_weights, real)


def test_base_models_return_the_same_attentions(spec):
    model = build(spec)
    input_ids, attention_mask = left_padded(spec)
    # The same path on both sides: the causal LM would otherwise fill a cache the base model does not, and
    # LSLM's cached path computes its weights with other kernel shapes (equal up to the last bit).
    full = model(input_ids, attention_mask=attention_mask, output_attentions=True, use_cache=False).attentions
    base = model.model(
        input_ids, attention_mask=attention_mask, output_attentions=True, use_cache=False
    ).attentions
    assert len(base) == len(full)
    for ours, theirs in zip(base, full, strict=True):
        assert_close(ours, theirs, atol=0, rtol=0)


# Cross-attention weights computed beside their kernels reproduce the kernels' outputs.


def _captured_cross(model, run) -> list[tuple]:
    """(module, args, output) of every cross-attention call while `run()` records attentions."""
    calls = []
    handles = [
        layer.cross_attn.register_forward_hook(
            lambda module, args, output: calls.append((module, args, output))
        )
        for layer in model.model.decoder_layers
    ]
    try:
        attentions = run()
    finally:
        for handle in handles:
            handle.remove()
    return calls, attentions


@pytest.mark.parametrize("form", ["replicated", "counted"])
def test_dlcm_cross_weights_reproduce_the_cross_attention(form):
    spec = SPECS["dlcm"]
    model = build(spec, cross_attention_form=form)
    input_ids, attention_mask = left_padded(spec)
    with torch.no_grad():
        prompt = model(input_ids[:, :-1], attention_mask=attention_mask[:, :-1], use_cache=True)
        for past in (None, prompt.cache):
            ids = input_ids if past is None else input_ids[:, -1:]

            def run(ids=ids, past=past):
                return model(
                    ids, attention_mask=attention_mask, cache=past, output_attentions=True
                ).attentions

            calls, attentions = _captured_cross(model, run)
            for (module, args, output), weights in zip(calls, attentions[-3::2], strict=True):
                token_states, _, concept_values, *_ = args
                batch, length, _ = token_states.shape
                values = _expand_heads(concept_values, module.num_heads)
                attended = torch.matmul(weights, values).transpose(1, 2).reshape(batch, length, -1)
                assert_close(module.o_proj(attended), output, atol=ATOL, rtol=0)


def test_lslm_cross_weights_reproduce_the_cross_attention():
    spec = SPECS["lslm"]
    model = build(spec)
    input_ids, attention_mask = left_padded(spec)
    with torch.no_grad():
        calls, attentions = _captured_cross(
            model,
            lambda: (
                model(
                    input_ids, attention_mask=attention_mask, use_cache=False, output_attentions=True
                ).attentions
            ),
        )
        # The weights are token-aligned: row t is the slot whose logits column t reports.
        column_slots = model.model.parallel_pass(input_ids, attention_mask).column_slots
    real = attention_mask.bool()
    for (module, args, output), weights in zip(calls, attentions[-3::2], strict=True):
        _, _, values, _ = args
        batch, length = column_slots.shape
        attended = torch.matmul(weights, values).transpose(1, 2).reshape(batch, length, -1)
        reported = torch.gather(output, 1, column_slots[..., None].expand(-1, -1, output.shape[-1]))
        assert_close(module.o_proj(attended)[real], reported[real], atol=ATOL, rtol=0)


# Generation, cached steps, and what is returned when nothing is asked.


def test_generate_returns_attentions_per_step(spec):
    model = build(spec)
    input_ids, attention_mask = left_padded(spec)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=3, do_sample=False)
    recorded = model.generate(input_ids, output_attentions=True, return_dict_in_generate=True, **kwargs)
    plain = model.generate(input_ids, **kwargs)
    # Asking for the weights changes no decision.
    assert torch.equal(recorded.sequences, plain)
    entries = len(model.model.attention_modules())
    assert len(recorded.attentions) == 3
    prefill, *steps = recorded.attentions
    assert len(prefill) == entries and all(weights is not None for weights in prefill)
    for index, step in enumerate(steps):
        assert len(step) == entries
        for layer_index, weights in enumerate(step):
            if weights is not None:
                check_rows(in_query_rows(model, layer_index, weights))
        # The first layer is token-level in every registered family (Hidden Decoding's is intra): one
        # new query over the prompt and the tokens so far.
        assert step[0].shape[-2:] == (1, input_ids.shape[1] + index + 1)


def test_cached_step_maps_equal_the_full_forward_rows(spec):
    """The first layer's weights at a cached step are the last row of a full forward's (first layer: its
    inputs are the embeddings, so the two agree up to rounding in every family)."""
    model = build(spec)
    input_ids, attention_mask = left_padded(spec)
    with torch.no_grad():
        prompt = model(input_ids[:, :-1], attention_mask=attention_mask[:, :-1], use_cache=True)
        step = model(
            input_ids[:, -1:],
            attention_mask=attention_mask,
            cache=prompt.cache,
            output_attentions=True,
        ).attentions[0]
        full = model(input_ids, attention_mask=attention_mask, output_attentions=True).attentions[0]
    assert_close(step, full[..., -1:, :], atol=ATOL, rtol=0)


def test_not_asking_returns_none_and_the_same_logits(spec):
    model = build(spec)
    input_ids, attention_mask = left_padded(spec)
    with torch.no_grad():
        unasked = model(input_ids, attention_mask=attention_mask)
        declined = model(input_ids, attention_mask=attention_mask, output_attentions=False)
        asked = model(input_ids, attention_mask=attention_mask, output_attentions=True)
    assert unasked.attentions is None and declined.attentions is None
    assert torch.equal(unasked.logits, declined.logits)
    if getattr(model.config, "num_experts", 0) and hasattr(model.config, "num_streams"):
        # Recording runs Hidden Decoding's last layer for every stream (no final-stream shortcut): its
        # experts then multiply other row counts, which may round differently (about 1e-8).
        assert_close(asked.logits, unasked.logits, atol=1e-6, rtol=0)
    else:
        assert torch.equal(unasked.logits, asked.logits)
    assert all(getattr(module, "attention_recorder", None) is None for module in model.modules())


def test_config_output_attentions_asks_for_them(spec):
    model = build(spec)
    model.config.output_attentions = True
    input_ids, attention_mask = left_padded(spec)
    attentions = model(input_ids, attention_mask=attention_mask).attentions
    assert len(attentions) == len(model.model.attention_modules())


def test_tuple_output_carries_the_attentions():
    spec = SPECS["plain"]
    model = build(spec)
    input_ids, attention_mask = left_padded(spec)
    as_dict = model(input_ids, attention_mask=attention_mask, output_attentions=True)
    as_tuple = model(input_ids, attention_mask=attention_mask, output_attentions=True, return_dict=False)
    assert as_tuple[-1] is not None and len(as_tuple[-1]) == len(as_dict.attentions)


def test_lslm_several_cached_columns_return_one_row_each():
    """Assisted decoding verifies several columns in one cached call: each entry has one row per column
    (tests/test_lslm_outputs.py compares them with one-column calls)."""
    spec = SPECS["lslm"]
    model = build(spec)
    input_ids, attention_mask = left_padded(spec)
    with torch.no_grad():
        prompt = model(input_ids[:, :-2], attention_mask=attention_mask[:, :-2], use_cache=True)
        attentions = model(
            input_ids[:, -2:],
            attention_mask=attention_mask,
            cache=prompt.cache,
            output_attentions=True,
        ).attentions
    assert len(attentions) == len(model.model.attention_modules())
    for weights in attentions:
        assert weights.shape[-2] == 2
        check_rows(weights)


# sdpa: what transformers' Llama does.


def _tiny_llama(implementation: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=PAD,
    )
    return LlamaForCausalLM._from_config(config, attn_implementation=implementation).eval()


def _outputs_under(model, input_ids, attention_mask) -> tuple:
    forward = model(input_ids, attention_mask=attention_mask, output_attentions=True).attentions
    generated = model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=2,
        do_sample=False,
        output_attentions=True,
        return_dict_in_generate=True,
        pad_token_id=PAD,
    ).attentions
    return forward, generated


def test_llama_reference_under_sdpa_returns_empty_tuples():
    """What the families imitate (transformers 5.23): sdpa computes no weights; Llama warns and returns
    an empty tuple, per forward and per generation step; eager returns one map per layer."""
    input_ids, attention_mask = left_padded(SPECS["plain"])
    forward, generated = _outputs_under(_tiny_llama("sdpa"), input_ids, attention_mask)
    assert forward == () and generated == ((), ())
    forward, generated = _outputs_under(_tiny_llama("eager"), input_ids, attention_mask)
    assert len(forward) == 2 and [len(step) for step in generated] == [2, 2]


def test_sdpa_warns_and_returns_empty_tuples_as_llama(spec, caplog):
    model = build(spec, implementation="sdpa")
    input_ids, attention_mask = left_padded(spec)
    hf_logging.warning_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="hf_concept.modeling.layers"):
        forward, generated = _outputs_under(model, input_ids, attention_mask)
    assert forward == () and generated == ((), ())
    assert "attn_implementation='eager'" in caplog.text
    # And the model goes on as before: switching to eager gives the weights.
    model.set_attn_implementation("eager")
    forward, _ = _outputs_under(model, input_ids, attention_mask)
    assert len(forward) == len(model.model.attention_modules())


def test_plain_with_llamas_weights_returns_llamas_maps():
    llama = _tiny_llama("eager")
    config = SPECS["plain"].make_config(rms_norm_eps=llama.config.rms_norm_eps)
    plain = PlainDecoderForCausalLM._from_config(config, attn_implementation="eager").eval()
    plain.load_state_dict(llama.state_dict())
    input_ids, _ = left_padded(SPECS["plain"], lengths=(9,))
    with torch.no_grad():
        ours = plain(input_ids, output_attentions=True).attentions
        theirs = llama(input_ids, output_attentions=True).attentions
    assert len(ours) == len(theirs)
    for mine, reference in zip(ours, theirs, strict=True):
        assert_close(mine, reference, atol=ATOL, rtol=0)
