"""ConceptCache: cached decoding equals full recomputation, batch operations cover the whole state."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.testing import assert_close
from transformers import DynamicCache, StaticCache

from hf_concept.modeling.concept_cache import ConceptCache
from hf_concept.modeling.configuration_plain import PlainDecoderConfig
from hf_concept.modeling.modeling_plain import PlainDecoderForCausalLM
from hf_concept.modeling.transformers_compat import cache_kwarg, output_cache
from tests.test_conceptmoe_model import BACKBONE, MOE, concept_model, ids

PAD = 0


def prepared(model):
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model


def generate(model, input_ids, **kwargs):
    kwargs.setdefault("max_new_tokens", 8)
    kwargs.setdefault("do_sample", False)
    return model.generate(input_ids, return_dict_in_generate=True, output_logits=True, **kwargs)


def left_pad(rows):
    length = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), length), PAD, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for index, row in enumerate(rows):
        input_ids[index, length - len(row) :] = row
        attention_mask[index, length - len(row) :] = 1
    return input_ids, attention_mask


@pytest.mark.parametrize("pooling", ["first", "sum", "mean"])
def test_cached_steps_equal_full_forward_and_greedy_equals_recompute(pooling):
    model = prepared(concept_model(pooling=pooling, **MOE))
    prompt = ids(1, 7, seed=11)
    cached = generate(model, prompt, use_cache=True)
    uncached = generate(model, prompt, use_cache=False)
    assert torch.equal(cached.sequences, uncached.sequences)
    with torch.no_grad():
        full = model(input_ids=cached.sequences).logits
    assert_close(torch.stack(cached.logits, 1), full[:, 6:-1], atol=1e-5, rtol=0)
    cache = output_cache(cached)
    assert isinstance(cache, ConceptCache)
    assert cache.get_seq_length() == cached.sequences.shape[1] - 1


@pytest.mark.parametrize("pooling", ["first", "sum"])
def test_left_padded_rows_with_different_boundaries_equal_rows_alone(pooling):
    model = prepared(concept_model(pooling=pooling))
    rows = [ids(4, seed=12), ids(9, seed=13), ids(6, seed=14)]
    input_ids, attention_mask = left_pad(rows)
    batched = generate(model, input_ids, attention_mask=attention_mask)
    state = output_cache(batched).state
    # The rows really did open chunks at different steps.
    assert len(set(state.concept_count.tolist())) > 1
    for index, row in enumerate(rows):
        alone = generate(model, row[None])
        assert torch.equal(batched.sequences[index, -8:], alone.sequences[0, -8:])
        step_logits = torch.stack([step[index] for step in batched.logits])
        assert_close(step_logits, torch.stack(alone.logits, 1)[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("pooling", ["first", "mean"])
def test_chunked_prefill_and_user_cache_equal_normal_generation(pooling):
    model = prepared(concept_model(pooling=pooling))
    prompt = ids(1, 10, seed=15)
    normal = generate(model, prompt)
    chunked = generate(model, prompt, prefill_chunk_size=3)
    assert torch.equal(normal.sequences, chunked.sequences)
    assert_close(torch.stack(chunked.logits, 1), torch.stack(normal.logits, 1), atol=1e-5, rtol=0)
    cache = model.model.new_cache()
    first = generate(model, prompt, **cache_kwarg(cache), max_new_tokens=3)
    assert output_cache(first) is cache and cache.get_seq_length() == 12
    resumed = generate(model, first.sequences, **cache_kwarg(cache), max_new_tokens=5)
    assert torch.equal(resumed.sequences, normal.sequences)


def test_beam_search_and_sampling_with_cache_equal_recompute():
    model = prepared(concept_model(pooling="sum"))
    prompt = ids(1, 6, seed=16)
    beam = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6)
    with_cache = generate(model, prompt, use_cache=True, **beam).sequences
    assert torch.equal(with_cache, generate(model, prompt, use_cache=False, **beam).sequences)
    sampled = []
    for use_cache in (True, False):
        torch.manual_seed(3)
        sampled.append(generate(model, prompt, use_cache=use_cache, do_sample=True, top_k=0).sequences)
    assert torch.equal(sampled[0], sampled[1])


def _cache_tensors(cache: ConceptCache) -> list[torch.Tensor]:
    tensors = [layer.keys for layer in cache.layers if layer.is_initialized]
    tensors += [tensor for tensor in cache.concept_keys if tensor is not None]
    return tensors + list(cache.concept_slots()) + cache.state.tensors()


def test_batch_operations_cover_every_tensor():
    model = concept_model(pooling="mean")
    input_ids, attention_mask = left_pad([ids(5, seed=17), ids(8, seed=18)])
    with torch.no_grad():
        cache = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True).cache
    before = [tensor.clone() for tensor in _cache_tensors(cache)]
    cache.batch_repeat_interleave(3)
    assert all(tensor.shape[0] == 6 for tensor in _cache_tensors(cache))
    cache.reorder_cache(torch.tensor([3, 4, 5, 0, 1, 2]))
    cache.batch_select_indices(torch.tensor([3, 0]))
    for old, new in zip(before, _cache_tensors(cache), strict=True):
        assert torch.equal(old, new)
    cache.reorder_cache(torch.tensor([1, 0]))
    for old, new in zip(before, _cache_tensors(cache), strict=True):
        assert torch.equal(old.flip(0), new)
    assert cache.is_croppable
    with pytest.raises(ValueError, match="tokens_to_remove=1"):
        cache.crop(1)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.state is None and cache.num_bytes() == 0


def test_concept_layers_store_about_one_entry_per_r_tokens():
    length = 64
    model = concept_model(chunking="fixed", compression_ratio=2, pooling="first")
    torch.manual_seed(0)
    plain = PlainDecoderForCausalLM(PlainDecoderConfig(**BACKBONE)).eval()
    input_ids = ids(1, length, seed=19)
    with torch.no_grad():
        cache = model(input_ids=input_ids, use_cache=True).cache
        dynamic = plain(input_ids=input_ids, use_cache=True).cache
    assert isinstance(dynamic, DynamicCache)
    dynamic_bytes = sum(
        (layer.keys.numel() + layer.values.numel()) * layer.keys.element_size() for layer in dynamic.layers
    )
    concept_bytes = sum(
        tensor.numel() * tensor.element_size() for tensor in cache.concept_keys + cache.concept_values
    )
    per_layer = dynamic_bytes // BACKBONE["num_hidden_layers"]
    token_layers, concept_layers = 4, 2
    # One concept slot per 2 tokens in each concept layer.
    assert concept_bytes == concept_layers * per_layer // 2
    ideal = (token_layers + concept_layers / 2) / BACKBONE["num_hidden_layers"]
    assert cache.num_bytes() < dynamic_bytes
    assert abs(cache.num_bytes() / dynamic_bytes - ideal) < 0.05


def test_foreign_caches_are_refused_clearly():
    model = concept_model()
    input_ids = ids(1, 4, seed=20)
    filled = DynamicCache()
    filled.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 0)
    with pytest.raises(ValueError, match="filled DynamicCache"):
        model(input_ids=input_ids, cache=filled)
    static = StaticCache(config=model.config, max_cache_len=16)
    with pytest.raises(ValueError, match="StaticCache"):
        model(input_ids=input_ids, cache=static)
    replaced = model(input_ids=input_ids, cache=DynamicCache()).cache
    assert isinstance(replaced, ConceptCache) and replaced.get_seq_length() == 4


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, BACKBONE["vocab_size"])}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


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

    model = prepared(concept_model(pooling="sum"))
    tokenizer = _word_tokenizer()
    prompt = "w5 w9 w13 w7 w21"
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    streamer = Collect()
    streamed = model.generate(input_ids, max_new_tokens=6, do_sample=False, streamer=streamer)
    assert list(itertools.chain(*streamer.chunks)) == streamed[0].tolist() and streamer.chunks[-1] == []
    uncached = model.generate(input_ids, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(streamed, uncached)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    text = generator(prompt, max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
    # The pipeline's text drops special tokens (pad, bos, eos: ids 0-2).
    new_words = [f"w{token}" for token in streamed[0, input_ids.shape[1] :].tolist() if token > 2]
    assert text.split() == new_words
