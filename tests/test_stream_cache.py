"""StreamCache: cached decoding equals recomputation, sizes per layout, batch operations keep streams
of a row together, foreign caches refused, generate's streamer and pipeline work."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.testing import assert_close
from transformers import DynamicCache, StaticCache

from hf_concept.modeling.hidden_decoding_cache import StreamCache
from tests.test_concept_cache import _word_tokenizer, left_pad, prepared
from tests.test_hidden_decoding_model import BACKBONE, hd_model, ids

KV_BYTES_PER_SLOT = 2 * BACKBONE["num_key_value_heads"] * BACKBONE["head_dim"] * 4  # keys + values, fp32


@pytest.mark.parametrize(
    ("stream_kv", "attn"), list(itertools.product(["per_stream", "shared"], ["eager", "sdpa"]))
)
def test_cached_steps_equal_full_forward_for_left_padded_rows(stream_kv, attn):
    model = prepared(hd_model(attn=attn, stream_kv=stream_kv))
    input_ids, attention_mask = left_pad([ids(9, seed=3), ids(5, seed=4)])
    out = model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=8,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    uncached = model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False, use_cache=False
    )
    assert torch.equal(out.sequences, uncached)
    full_mask = torch.cat([attention_mask, torch.ones(2, 8, dtype=torch.long)], dim=1)
    with torch.no_grad():
        full = model(input_ids=out.sequences, attention_mask=full_mask).logits
    assert_close(torch.stack(out.logits, dim=1), full[:, 8:16], atol=1e-5, rtol=1e-5)
    alone = model.generate(input_ids[1:, 4:], max_new_tokens=8, do_sample=False)
    assert torch.equal(alone[0, 5:], out.sequences[1, 9:])


def test_sizes_per_layout_and_token_count():
    """Bytes: intra S·T slots per row (shared: T), full S·T, local min(S·T, W - 1); seq length in tokens."""
    length, streams, window = 10, 3, 5
    for stream_kv, intra_slots in (("per_stream", streams * length), ("shared", length)):
        model = hd_model(stream_kv=stream_kv)
        with torch.no_grad():
            cache = model(input_ids=ids(2, length), use_cache=True).cache
        assert isinstance(cache, StreamCache) and cache.get_seq_length() == length
        slots = 2 * intra_slots + streams * length + (window - 1)  # intra, local, intra, full
        assert cache.num_bytes() == 2 * slots * KV_BYTES_PER_SLOT
        assert [cache.get_query_offset(i) for i in range(4)] == [
            length,
            streams * length,
            length,
            streams * length,
        ]


def _kv(cache: StreamCache) -> list[torch.Tensor]:
    return [layer.keys for layer in cache.layers] + [layer.values for layer in cache.layers]


def test_batch_operations_move_the_streams_of_a_row_together():
    model = hd_model()
    input_ids, attention_mask = left_pad([ids(6, seed=5), ids(8, seed=6)])
    with torch.no_grad():
        cache = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True).cache
        rows = [
            model(input_ids=input_ids[i : i + 1], attention_mask=attention_mask[i : i + 1], use_cache=True)
            for i in range(2)
        ]
    # Row-wise caches equal slices of the batched one (so folded rows are laid out b·S + k).
    for index, row in enumerate(rows):
        select = StreamCache(model.config.stream_attention_layout, 3, 5)
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=attention_mask, cache=select)
        select.batch_select_indices(torch.tensor([index]))
        for mine, theirs in zip(_kv(select), _kv(row.cache), strict=True):
            assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    before = [tensor.clone() for tensor in _kv(cache)]
    cache.batch_repeat_interleave(3)
    assert all(tensor.shape[0] in (6, 18) for tensor in _kv(cache))
    cache.reorder_cache(torch.tensor([3, 4, 5, 0, 1, 2]))
    cache.batch_select_indices(torch.tensor([3, 0]))
    for old, new in zip(before, _kv(cache), strict=True):
        assert torch.equal(old, new)
    assert cache.is_croppable
    with pytest.raises(ValueError, match="tokens_to_remove=2"):
        cache.crop(2)


def test_beam_search_and_sampling_with_cache_equal_recompute():
    model = prepared(hd_model(stream_kv="shared"))
    input_ids, attention_mask = left_pad([ids(7, seed=7), ids(4, seed=8)])
    common = dict(attention_mask=attention_mask, max_new_tokens=6)
    beams = dict(num_beams=3, num_return_sequences=2, do_sample=False)
    assert torch.equal(
        model.generate(input_ids, **common, **beams),
        model.generate(input_ids, **common, **beams, use_cache=False),
    )
    torch.manual_seed(11)
    sampled = model.generate(input_ids, **common, do_sample=True, top_k=0)
    torch.manual_seed(11)
    assert torch.equal(sampled, model.generate(input_ids, **common, do_sample=True, top_k=0, use_cache=False))


def test_foreign_caches_are_refused_clearly():
    model = hd_model()
    input_ids = ids(1, 4)
    filled = DynamicCache()
    filled.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 0)
    with pytest.raises(ValueError, match="filled DynamicCache"):
        model(input_ids=input_ids, cache=filled)
    with pytest.raises(ValueError, match="StaticCache"):
        model(input_ids=input_ids, cache=StaticCache(config=model.config, max_cache_len=16))
    replaced = model(input_ids=input_ids, cache=DynamicCache()).cache
    assert isinstance(replaced, StreamCache) and replaced.get_seq_length() == 4


def test_streamer_and_text_generation_pipeline_use_the_cache():
    from transformers import pipeline
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self) -> None:
            self.chunks: list[list[int]] = []

        def put(self, value: torch.Tensor) -> None:
            self.chunks.append(value.flatten().tolist())

        def end(self) -> None:
            self.chunks.append([])

    model = prepared(hd_model())
    tokenizer = _word_tokenizer()
    prompt = "w5 w9 w13 w7 w21"
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    streamer = Collect()
    streamed = model.generate(input_ids, max_new_tokens=6, do_sample=False, streamer=streamer)
    assert list(itertools.chain(*streamer.chunks)) == streamed[0].tolist() and streamer.chunks[-1] == []
    assert torch.equal(
        streamed, model.generate(input_ids, max_new_tokens=6, do_sample=False, use_cache=False)
    )
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    text = generator(prompt, max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
    new_words = [f"w{token}" for token in streamed[0, input_ids.shape[1] :].tolist() if token > 2]
    assert text.split() == new_words


FAMILY_MAKERS = {
    "conceptmoe": ("_conceptmoe_class", "_conceptmoe_config"),
    "dlcm": ("_dlcm_class", "_dlcm_config"),
    "hidden_decoding": ("_hidden_decoding_class", "_hidden_decoding_config"),
    "lslm": ("_lslm_class", "_lslm_config"),
}


@pytest.mark.parametrize("family", sorted(FAMILY_MAKERS))
@pytest.mark.parametrize("implementation", ["static", "offloaded"])
def test_generate_with_a_cache_the_family_cannot_use_names_the_fix(family, implementation):
    """generate(cache_implementation=...) hands the model a cache it cannot fill; replacing it would drop
    what the user asked for (a static size, CPU offloading) without a word, so every family refuses it
    and says what to do instead."""
    from tests.conformance import families

    model_class, make_config = (getattr(families, name) for name in FAMILY_MAKERS[family])
    torch.manual_seed(0)
    model = model_class()(make_config()).eval()
    input_ids = torch.randint(3, 60, (1, 5), generator=torch.Generator().manual_seed(2))
    kind = "StaticCache" if implementation == "static" else "offloaded DynamicCache"
    with pytest.raises(ValueError, match=f"cache of type {kind} is not supported") as error:
        model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=2,
                       cache_implementation=implementation)  # fmt: skip
    assert "model.model.new_cache()" in str(error.value) and "without cache_implementation" in str(
        error.value
    )
    # The default dynamic cache is replaced by the family's own.
    assert model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=2).shape == (
        1,
        7,
    )
