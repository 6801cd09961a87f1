"""LSLM generation: `<nxt>`/`<bos>` markers in the input, the segment cache against full recomputation,
and what the cache keeps (one segment of decoder K/V, one entry per closed segment)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.testing import assert_close

from hf_concept.modeling.lslm_segment_cache import SegmentCache
from hf_concept.modeling.transformers_compat import output_cache
from hf_concept.reference.lslm import reference_logits
from tests.test_lslm_model import encode, lslm

NXT, BOS_MARKER = 4, 3
CASES = list(itertools.product(["mean", "hops:2"], ["eager", "sdpa"]))


def random_row(generator: torch.Generator, length: int, marker_share: float = 0.15) -> torch.Tensor:
    """(1, length): `<BoS>` then bytes, with markers (`<nxt>` and `<bos>`) and an `<eos>` sprinkled in."""
    row = torch.randint(5, 261, (length,), generator=generator)
    draw = torch.rand(length, generator=generator)
    row[draw < marker_share] = NXT
    row[draw < marker_share / 3] = BOS_MARKER
    row[(draw > 0.97)] = 2
    row[0] = 1
    return row[None]


@torch.no_grad()
def stepped_logits(model, input_ids, prefill: int, attention_mask=None, chunk: int = 1) -> torch.Tensor:
    """Logits of a parallel prefill of `prefill` columns, then the rest fed `chunk` columns at a time."""
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    out = model(input_ids[:, :prefill], attention_mask=mask[:, :prefill], use_cache=True)
    cache, logits = out.cache, [out.logits]
    assert isinstance(cache, SegmentCache) and cache.get_seq_length() == prefill
    for start in range(prefill, input_ids.shape[1], chunk):
        stop = min(start + chunk, input_ids.shape[1])
        step = model(input_ids[:, start:stop], attention_mask=mask[:, :stop], cache=cache, use_cache=True)
        logits.append(step.logits)
    assert cache.get_seq_length() == input_ids.shape[1]
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize(("pooling", "attn"), CASES)
def test_markers_follow_the_loop_reference(pooling, attn):
    """Rows with `<nxt>`/`<bos>` markers (and packed documents) against the column-by-column loop."""
    model = lslm(attn=attn, pooling=pooling)
    generator = torch.Generator().manual_seed(3)
    first, second = random_row(generator, 23), random_row(generator, 17)
    packed = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(23), torch.arange(17)])[None]
    assert (packed == NXT).any() and (packed == BOS_MARKER).any()
    with torch.no_grad():
        outputs = model(packed, position_ids=positions, labels=packed)
    expected_logits, expected_loss = reference_logits(model, packed, positions)
    assert_close(outputs.logits[0], expected_logits, atol=1e-5, rtol=1e-5)
    assert_close(outputs.lm_loss, expected_loss, atol=1e-5, rtol=1e-5)
    # Markers never open a segment and never count as bytes.
    assert not outputs.boundaries[packed == NXT].any()


@pytest.mark.parametrize(("pooling", "attn"), CASES)
def test_cached_steps_equal_full_recomputation(pooling, attn):
    """Prefill at every split point, then one column at a time: every column's logits equal one full
    forward over the row (markers, `<eos>` and several segments included)."""
    model = lslm(attn=attn, pooling=pooling)
    generator = torch.Generator().manual_seed(5)
    input_ids = random_row(generator, 28)
    with torch.no_grad():
        full = model(input_ids).logits
    for prefill in (1, 2, 9, 17, 27):
        assert_close(stepped_logits(model, input_ids, prefill), full, atol=1e-5, rtol=0)


def test_left_padded_chunked_continuation_equals_rows_alone():
    """A left-padded batch continued in chunks of 3 columns (pads inside the first chunks) = each row's
    own full forward."""
    model = lslm()
    generator = torch.Generator().manual_seed(9)
    rows = [random_row(generator, length)[0] for length in (21, 9, 15)]
    width = max(len(row) for row in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for index, row in enumerate(rows):
        input_ids[index, width - len(row) :], attention_mask[index, width - len(row) :] = row, 1
    stepped = stepped_logits(model, input_ids, prefill=4, attention_mask=attention_mask, chunk=3)
    for index, row in enumerate(rows):
        with torch.no_grad():
            alone = model(row[None]).logits[0]
        assert_close(stepped[index, width - len(row) :], alone, atol=1e-5, rtol=0)


def _nxt_prone(model):
    """Make `<nxt>` a likely choice after a few bytes: scale its row of the LM head up."""
    with torch.no_grad():
        model.lm_head.weight[NXT] *= 3
    return model


def test_generated_nxt_closes_segments_and_cached_generation_equals_recompute():
    model = _nxt_prone(lslm())
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompt = encode("segment")["input_ids"]
    # The raw ids: the `<nxt>` markers the model wrote are what a full recomputation reads.
    kwargs = dict(max_new_tokens=24, return_dict_in_generate=True, output_logits=True)
    cached = model.generate(prompt, use_cache=True, do_sample=False, **kwargs)
    uncached = model.generate(prompt, use_cache=False, do_sample=False, **kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
    new = cached.sequences[0, prompt.shape[1] :]
    assert (new == NXT).sum() >= 2, f"the test needs generated <nxt> markers: {new.tolist()}"
    with torch.no_grad():
        full = model(cached.sequences).logits
    assert_close(torch.stack(cached.logits, 1), full[:, prompt.shape[1] - 1 : -1], atol=1e-5, rtol=0)
    # Every closed segment (by a marker or by the router) is one segment-encoder entry, encoded once.
    cache = output_cache(cached)
    with torch.no_grad():
        boundaries = model(cached.sequences).boundaries[0]
    opened = int(boundaries.sum())
    still_open = int(cache.open_counts[0])
    assert int(cache.segment_store.lengths[0]) == opened - (1 if still_open else 0)
    assert int(cache.cross_store.lengths[0]) == int(cache.segment_store.lengths[0]) + 1  # + null


def test_beams_sampling_and_batches_equal_recompute():
    model = _nxt_prone(lslm(pooling="hops:2"))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    batch = encode("a row", "another, longer row")
    beams = dict(num_beams=3, num_return_sequences=2, max_new_tokens=10, do_sample=False)
    assert torch.equal(
        model.generate(**batch, use_cache=True, **beams), model.generate(**batch, use_cache=False, **beams)
    )
    sampled = []
    for use_cache in (True, False):
        torch.manual_seed(4)
        sampled.append(model.generate(**batch, use_cache=use_cache, do_sample=True, max_new_tokens=12))
    assert torch.equal(*sampled)


def test_decoder_cache_holds_one_segment_not_the_context():
    """The decoder's self-attention K/V never hold more than the current segment; the token encoder's
    grow with the context; `num_bytes` counts every stored tensor."""
    model = _nxt_prone(lslm())
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompt = encode("the context grows, segments do not")["input_ids"]
    generated = model.generate(prompt, max_new_tokens=30, do_sample=False, return_dict_in_generate=True)
    cache, sequence = output_cache(generated), generated.sequences
    with torch.no_grad():
        opens = model(sequence).boundaries[0].tolist()
    longest, length = 0, 0
    for token, opening in zip(sequence[0].tolist(), opens, strict=True):
        length = 1 if opening else (0 if token in (NXT, BOS_MARKER) else length + 1)
        longest = max(longest, length)
    token_width = cache.layers[0].keys.shape[2]
    decoder_width = max(tensor.shape[2] for tensor in cache.decoder_store.keys.values())
    assert token_width == sequence.shape[1] - 1
    # Storage grows geometrically: at most twice the longest segment (+ its `<bos>`), not the context.
    assert int(cache.decoder_store.lengths.max()) <= longest + 1
    assert decoder_width <= max(2 * (longest + 1), 4) < token_width
    tensors = [layer.keys for layer in cache.layers] + [layer.values for layer in cache.layers]
    for store in (cache.segment_store, cache.cross_store, cache.decoder_store):
        tensors += [*store.keys.values(), *store.values.values(), store.lengths]
    tensors += [cache.token_valid, cache.byte_counts, cache.open_states, cache.open_counts, cache.rate_units]
    tensors.append(cache.latest_segment)
    assert cache.num_bytes() == sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def test_packed_documents_with_a_cache_are_refused():
    model = lslm()
    ids = encode("one")["input_ids"]
    packed = torch.cat([ids, ids], dim=1)
    positions = torch.cat([torch.arange(ids.shape[1])] * 2)[None]
    with pytest.raises(ValueError, match="packed documents"):
        model(packed, position_ids=positions, use_cache=True)


def test_foreign_filled_cache_is_refused():
    from transformers import DynamicCache

    model = lslm()
    ids = encode("one")["input_ids"]
    cache = DynamicCache()
    cache.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 0)
    with pytest.raises(ValueError, match="SegmentCache"):
        model(ids, cache=cache, use_cache=True)
