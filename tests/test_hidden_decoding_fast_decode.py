"""Hidden Decoding's decode levers change no result: the last layer run for the final
stream only, the block-growing cache layers and the grouped-head sdpa call each equal the plain path."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.testing import assert_close
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_concept.modeling.hidden_decoding_cache import BlockGrowthLayer
from hf_concept.modeling.hidden_decoding_layers import StreamAttention, grouped_sdpa_attention
from hf_concept.reference.hidden_decoding import reference_logits
from tests.test_concept_cache import left_pad, prepared
from tests.test_hidden_decoding_model import hd_model, ids

# Cross-stream modes: the paper's causal masks over the interleaved sequence, and the conversion
# default (token-block masks, token positions; a local window of 2 whole tokens).
MODES = {
    "causal": {},
    "token_block": dict(cross_stream_mask="token_block", cross_stream_positions="token", sliding_window=6),
}
# One layout per kind of last layer.
LAST_LAYER_LAYOUTS = {
    "full": ["intra", "local", "intra", "full"],
    "intra": ["full", "local", "full", "intra"],
    "local": ["intra", "full", "intra", "local"],
}


def mlp_rows(model) -> list[int]:
    """A list that receives the row count of every input the last layer's MLP sees."""
    rows: list[int] = []
    model.model.layers[-1].mlp.register_forward_hook(
        lambda module, args, output: rows.append(args[0][..., 0].numel())
    )
    return rows


@pytest.mark.parametrize(
    ("last", "attn", "mode"), list(itertools.product(LAST_LAYER_LAYOUTS, ["eager", "sdpa"], MODES))
)
def test_final_stream_last_layer_equals_the_plain_call_and_the_reference(last, attn, mode):
    model = hd_model(attn=attn, stream_attention_layout=LAST_LAYER_LAYOUTS[last], **MODES[mode])
    input_ids, attention_mask = left_pad([ids(9, seed=3), ids(6, seed=4)])
    rows = mlp_rows(model)
    with torch.no_grad():
        trimmed = model(input_ids=input_ids, attention_mask=attention_mask).logits
        plain = model(input_ids=input_ids, attention_mask=attention_mask, output_stream_states=True).logits
        expected = reference_logits(model, input_ids, attention_mask, None)
    real = attention_mask.bool()
    assert_close(trimmed[real], plain[real], atol=1e-5, rtol=1e-5)
    assert_close(trimmed[real], expected[real], atol=1e-5, rtol=1e-5)
    # The trimmed call feeds the MLP one row per token, the plain call S per token (then the reference).
    tokens = input_ids.numel()
    assert rows[:2] == [tokens, 3 * tokens]


@pytest.mark.parametrize(("last", "mode"), list(itertools.product(LAST_LAYER_LAYOUTS, MODES)))
def test_final_stream_last_layer_without_a_mask_and_with_packed_documents(last, mode):
    """No padding (sdpa's mask may be skipped: the causal rows are spelled out) and packed rows."""
    model = hd_model(stream_attention_layout=LAST_LAYER_LAYOUTS[last], **MODES[mode])
    input_ids = ids(2, 10, seed=5)
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]] * 2)
    with torch.no_grad():
        for positions in (None, packed):
            trimmed = model(input_ids=input_ids, position_ids=positions).logits
            plain = model(input_ids=input_ids, position_ids=positions, output_stream_states=True).logits
            assert_close(trimmed, plain, atol=1e-5, rtol=1e-5)
            assert_close(trimmed, reference_logits(model, input_ids, None, positions), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("last", list(LAST_LAYER_LAYOUTS))
def test_final_stream_last_layer_trains_as_the_plain_call(last):
    """Same loss and same gradients: the streams the trimmed layer skips reach the loss only through the
    keys and values it still computes."""
    model = hd_model(stream_attention_layout=LAST_LAYER_LAYOUTS[last]).train()
    input_ids = ids(2, 8, seed=6)
    gradients = []
    for keep_streams in (False, True):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=input_ids, labels=input_ids, output_stream_states=keep_streams).loss
        loss.backward()
        gradients.append((loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    (trimmed_loss, trimmed), (plain_loss, plain) = gradients
    assert_close(trimmed_loss, plain_loss, atol=1e-6, rtol=1e-6)
    assert trimmed.keys() == plain.keys()
    for name in plain:
        assert_close(trimmed[name], plain[name], atol=1e-5, rtol=1e-4, msg=name)
    # The last layer's query projection still learns, from the final stream alone.
    assert trimmed["model.layers.3.self_attn.q_proj.weight"].abs().sum() > 0


@pytest.mark.parametrize(
    ("last", "attn", "mode"), list(itertools.product(LAST_LAYER_LAYOUTS, ["eager", "sdpa"], MODES))
)
def test_cached_greedy_decode_equals_recomputation_for_every_last_layer(last, attn, mode):
    model = prepared(hd_model(attn=attn, stream_attention_layout=LAST_LAYER_LAYOUTS[last], **MODES[mode]))
    input_ids, attention_mask = left_pad([ids(7, seed=8), ids(4, seed=9)])
    settings = dict(attention_mask=attention_mask, max_new_tokens=12, do_sample=False)
    out = model.generate(input_ids, return_dict_in_generate=True, output_logits=True, **settings)
    assert torch.equal(out.sequences, model.generate(input_ids, use_cache=False, **settings))
    full_mask = torch.cat([attention_mask, torch.ones(2, 12, dtype=torch.long)], dim=1)
    with torch.no_grad():
        full = model(input_ids=out.sequences, attention_mask=full_mask).logits
    assert_close(torch.stack(out.logits, dim=1), full[:, 6:-1], atol=1e-4, rtol=1e-4)


def test_sparse_last_layer_keeps_every_row_when_router_logits_are_returned():
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    model = hd_model(**moe)
    input_ids = ids(1, 5, seed=10)
    with torch.no_grad():
        kept = model(input_ids=input_ids, output_router_logits=True)
        trimmed = model(input_ids=input_ids)
    # Every sparse layer's router saw all S·L rows, the last one included.
    assert [logits.shape[0] for logits in kept.router_logits] == [3 * 5] * 4
    assert_close(trimmed.logits, kept.logits, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------- the cache


def append_all(layer, chunks):
    return [layer.update(keys, values) for keys, values in chunks]


def chunks_of(lengths, batch=2, heads=2, dim=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch, heads, length, dim, generator=generator),
            torch.randn(batch, heads, length, dim, generator=generator),
        )
        for length in lengths
    ]


def test_block_growth_layer_stores_what_concatenation_stores():
    chunks = chunks_of([5, 1, 1, 7, 1, 1, 1, 9, 1])
    growing, plain = BlockGrowthLayer(block=4), DynamicLayer()
    for (got_keys, got_values), (keys, values) in zip(
        append_all(growing, chunks), append_all(plain, chunks), strict=True
    ):
        assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
        # Room for at most two blocks beyond what is stored.
        assert growing.get_seq_length() <= growing.key_buffer.shape[2] <= growing.get_seq_length() + 8
    # Steps within a block write in place: the stored keys stay a view of the same buffer.
    buffer = growing.key_buffer
    growing.update(*chunks_of([1], seed=1)[0])
    assert growing.key_buffer is buffer and growing.keys.data_ptr() == buffer.data_ptr()


def test_block_growth_layer_after_row_selection_crop_and_reset():
    chunks = chunks_of([6, 1, 1])
    growing, plain = BlockGrowthLayer(block=4), DynamicLayer()
    append_all(growing, chunks), append_all(plain, chunks)
    index = torch.tensor([1, 1])
    for layer in (growing, plain):
        layer.batch_select_indices(index)
        layer.crop(-2)
    later = chunks_of([1, 3], seed=2)
    for (got_keys, got_values), (keys, values) in zip(
        append_all(growing, later), append_all(plain, later), strict=True
    ):
        assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
    growing.reset()
    assert growing.get_seq_length() == 0 and growing.key_buffer is None
    fresh = chunks_of([2], seed=3)[0]
    assert torch.equal(growing.update(*fresh)[0], fresh[0])


def test_block_growth_layer_concatenates_while_autograd_records():
    """In-place writes would invalidate the graph of earlier steps; recorded entries are concatenated."""
    layer = BlockGrowthLayer(block=4)
    first, second = (torch.randn(1, 1, 2, 3, requires_grad=True) for _ in range(2))
    keys, _ = layer.update(first, first * 2)
    keys_after, _ = layer.update(second, second * 2)
    (keys.sum() + keys_after.pow(2).sum()).backward()
    assert_close(first.grad, torch.ones_like(first) + 2 * first.detach())
    assert_close(second.grad, 2 * second.detach())


# ------------------------------------------------------------------------------------- the sdpa kernel


def test_grouped_sdpa_equals_transformers_sdpa_under_a_mask():
    model = hd_model()
    attention = model.model.layers[0].self_attn
    assert isinstance(attention, StreamAttention) and attention.kernel() is grouped_sdpa_attention
    assert attention.num_key_value_groups == 2
    generator = torch.Generator().manual_seed(11)
    query = torch.randn(2, 4, 3, 8, generator=generator)
    key, value = (torch.randn(2, 2, 10, 8, generator=generator) for _ in range(2))
    mask = torch.rand(2, 1, 3, 10, generator=generator) > 0.3
    mask[..., -1] = True
    expected, _ = sdpa_attention_forward(attention, query, key, value, mask, scaling=0.3)
    actual, weights = grouped_sdpa_attention(attention, query, key, value, mask, scaling=0.3)
    assert weights is None and actual.shape == expected.shape == (2, 3, 4, 8)
    assert_close(actual, expected, atol=1e-6, rtol=1e-6)
    assert hd_model(attn="eager").model.layers[0].self_attn.kernel() is not grouped_sdpa_attention
