"""Assisted decoding and prompt lookup: every family cache rolls back exactly (`crop`), so
`generate` with a draft model or with `prompt_lookup_num_tokens` gives plain greedy's tokens."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch.testing import assert_close

from hf_concept.modeling.family_cache import FamilyCache
from hf_concept.modeling.hidden_decoding_cache import RollbackWindowLayer
from hf_concept.modeling.transformers_compat import cache_kwarg, output_cache
from tests.conformance.families import FAMILIES, FamilySpec

PAD = 0
ATOL = 1e-5
# Every family but the plain one, whose cache is transformers' DynamicCache.
SPECS = [spec for spec in FAMILIES if not spec.name.startswith("plain")]
# The first id of no special meaning in any family (LSLM: the first byte, after its five specials).
FIRST_ID = 5


@pytest.fixture(params=SPECS, ids=lambda spec: spec.name)
def spec(request) -> FamilySpec:
    return request.param


def prepared(model: torch.nn.Module) -> torch.nn.Module:
    # Generation runs to max_new_tokens: an eos by chance must not end a comparison early.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model.eval()


def build(spec: FamilySpec, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    return prepared(spec.model_class()(spec.make_config(**overrides)))


def draft_of(model: torch.nn.Module, scale: float, seed: int = 5) -> torch.nn.Module:
    """The model with noise on its LM head: a draft that agrees with it often, not always."""
    draft = prepared(type(model)(model.config))
    draft.load_state_dict(model.state_dict())
    weight = draft.lm_head.weight
    noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        weight.add_(noise * scale * weight.std())
    return draft


def random_ids(model: torch.nn.Module, *shape: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_ID, model.config.vocab_size, shape, generator=generator)


@contextlib.contextmanager
def counted_crops(model: torch.nn.Module) -> Iterator[list[tuple[object, int]]]:
    """(cache, tokens_to_remove) of every crop of the model's cache class (a checkpoint's remote code has
    its own copy of the class, so the class is read from the model)."""
    cache_class = type(model.model.new_cache())
    crop, calls = cache_class.crop, []

    def spy(cache, tokens_to_remove: int) -> None:
        calls.append((cache, tokens_to_remove))
        crop(cache, tokens_to_remove)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cache_class, "crop", spy)
        yield calls


def greedy(model: torch.nn.Module, prompt: torch.Tensor, **kwargs) -> torch.Tensor:
    kwargs.setdefault("max_new_tokens", 20)
    return model.generate(prompt, do_sample=False, **kwargs)


def test_assisted_and_prompt_lookup_equal_greedy(spec):
    model = build(spec)
    prompt = random_ids(model, 1, 7, seed=2)
    # A prompt that repeats itself, so that prompt lookup has something to propose.
    repeating = random_ids(model, 1, 4, seed=3).repeat(1, 3)
    with counted_crops(model) as crops:
        assert torch.equal(greedy(model, prompt, assistant_model=draft_of(model, 1.0)), greedy(model, prompt))
        assisted_crops = [count for _, count in crops]
        looked_up = greedy(model, repeating, prompt_lookup_num_tokens=3)
        assert torch.equal(looked_up, greedy(model, repeating))
    # Candidates were rejected and rolled back in both modes (the draft's own cache crops too).
    assert any(count < 0 for count in assisted_crops), assisted_crops
    assert any(count < 0 for _, count in crops[len(assisted_crops) :]), crops


def test_a_close_draft_is_partly_accepted_and_still_exact(spec):
    """A draft that is usually right: some rounds accept candidates, some reject some."""
    model = build(spec)
    prompt = random_ids(model, 1, 6, seed=4)
    settings = dict(max_new_tokens=24, return_dict_in_generate=True)
    with counted_crops(model) as crops:
        assisted = greedy(model, prompt, assistant_model=draft_of(model, 0.3), **settings)
    assert torch.equal(assisted.sequences, greedy(model, prompt, **settings).sequences)
    # One crop of the model's own cache per verification pass: fewer passes than tokens, some rejecting.
    rounds = [count for cache, count in crops if cache is output_cache(assisted)]
    assert len(rounds) < 24 and any(count < 0 for count in rounds), rounds


def logits_of(model: torch.nn.Module, input_ids: torch.Tensor, cache=None, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        output = model(input_ids=input_ids, **cache_kwarg(cache), use_cache=cache is not None, **kwargs)
    return output.logits.float()


def test_crop_then_refeeding_equals_never_having_fed(spec):
    """A verification pass (kept and rejected tokens in one call) and a draft's pattern (one token per
    call, then a crop across calls): the logits of what follows equal those of a full forward."""
    model = build(spec)
    prompt, kept, wrong = (
        random_ids(model, 1, length, seed=seed) for length, seed in ((7, 5), (6, 6), (4, 7))
    )
    full = logits_of(model, torch.cat([prompt, kept], dim=1))[:, 7:]
    cache = model.model.new_cache()
    logits_of(model, prompt, cache)
    # Verification pass: two kept tokens and the wrong ones in one call, then the crop.
    first = logits_of(model, torch.cat([kept[:, :2], wrong], dim=1), cache)
    assert_close(first[:, :2], full[:, :2], atol=ATOL, rtol=0)
    cache.crop(-wrong.shape[1])
    assert cache.get_seq_length() == 9
    # A draft's pattern: one kept token, then wrong tokens one call each, then a crop across the calls.
    assert_close(logits_of(model, kept[:, 2:3], cache), full[:, 2:3], atol=ATOL, rtol=0)
    for column in range(wrong.shape[1]):
        logits_of(model, wrong[:, column : column + 1], cache)
    cache.crop(-wrong.shape[1])
    cache.crop(0)
    assert_close(logits_of(model, kept[:, 3:], cache), full[:, 3:], atol=ATOL, rtol=0)
    assert cache.get_seq_length() == 13


def test_crop_covers_left_padding_and_beam_reordering(spec):
    """Two left-padded rows, reordered between feeding and cropping: the rollback point, the recorded
    tokens and the mask follow the rows."""
    model = build(spec)
    rows = [random_ids(model, 8, seed=8), random_ids(model, 5, seed=9)]
    prompt = torch.full((2, 8), PAD)
    prompt_mask = torch.zeros(2, 8, dtype=torch.long)
    for index, row in enumerate(rows):
        prompt[index, 8 - len(row) :], prompt_mask[index, 8 - len(row) :] = row, 1
    wrong, kept = random_ids(model, 2, 3, seed=10), random_ids(model, 2, 4, seed=11)
    cache = model.model.new_cache()
    logits_of(model, prompt, cache, attention_mask=prompt_mask)
    logits_of(model, kept[:, :1], cache, attention_mask=torch.cat([prompt_mask, torch.ones(2, 1)], 1).long())
    cache.crop(0)
    logits_of(model, wrong, cache, attention_mask=torch.cat([prompt_mask, torch.ones(2, 4)], 1).long())
    swap = torch.tensor([1, 0])
    cache.reorder_cache(swap)
    cache.crop(-wrong.shape[1])
    mask = torch.cat([prompt_mask[swap], torch.ones(2, 4, dtype=torch.long)], dim=1)
    stepped = logits_of(model, kept[swap, 1:], cache, attention_mask=mask)
    full = logits_of(model, torch.cat([prompt[swap], kept[swap]], dim=1), attention_mask=mask)
    for row in range(2):
        assert_close(stepped[row], full[row, -3:], atol=ATOL, rtol=0)


def test_every_family_cache_is_croppable(spec):
    cache = build(spec).model.new_cache()
    assert isinstance(cache, FamilyCache) and cache.is_croppable


def test_window_layer_matches_transformers_and_gives_back_its_latest_update():
    """Updates return what transformers' window layer returns; a crop of the latest update's entries is a
    slice that leaves the window transformers' recording layer leaves; further back it refuses."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    ours, theirs, recording = (
        RollbackWindowLayer(4),
        DynamicSlidingWindowLayer(4),
        DynamicSlidingWindowLayer(4),
    )
    recording.activate_past_recording()
    entries = torch.randn(1, 2, 12, 3, generator=torch.Generator().manual_seed(12))
    for start, end in ((0, 2), (2, 7), (7, 8), (8, 11)):
        chunk = entries[:, :, start:end]
        for mine, reference in zip(ours.update(chunk, chunk), theirs.update(chunk, chunk), strict=True):
            assert torch.equal(mine, reference)
        recording.update(chunk, chunk)
    assert torch.equal(ours.keys, theirs.keys)
    assert ours.can_remove(3) and not ours.can_remove(4)
    ours.crop(-2)
    recording.crop(-2)
    assert (
        torch.equal(ours.keys, recording.keys) and ours.cumulative_length == recording.cumulative_length == 9
    )
    assert torch.equal(ours.keys, entries[:, :, 6:9])
    ours.update(entries[:, :, 9:10], entries[:, :, 9:10])
    with pytest.raises(ValueError, match="no longer holds the 3 entries before them"):
        ours.crop(-2)
    # Recording the past (transformers' switch, e.g. for its deferred stop check): a crop may span updates.
    ours.activate_past_recording()
    for column in range(10, 12):
        ours.update(entries[:, :, column : column + 1], entries[:, :, column : column + 1])
    ours.crop(-2)
    assert torch.equal(ours.keys, entries[:, :, 7:10]) and ours.cumulative_length == 10


def test_stream_windows_slice_a_verification_pass_and_replay_a_draft_pattern(monkeypatch):
    """Local window 6 slots (2 tokens), intra window 3 tokens: a verification pass past both windows is
    cropped by slicing (no replay, the windows as large as ever); a crop across one-token calls replays."""
    spec = next(spec for spec in SPECS if spec.name == "hidden-decoding")
    layout = ["intra", "local", "intra", "full"]
    model = build(spec, stream_attention_layout=layout, sliding_window=6, intra_window=3)
    replay, replays = FamilyCache._replay, []

    def spy(cache, target: int) -> None:
        replays.append(target)
        replay(cache, target)

    monkeypatch.setattr(FamilyCache, "_replay", spy)
    prompt, kept, wrong = (
        random_ids(model, 1, length, seed=seed) for length, seed in ((9, 13), (4, 14), (3, 15))
    )
    full = logits_of(model, torch.cat([prompt, kept], dim=1))[:, 9:]
    cache, fresh = model.model.new_cache(), model.model.new_cache()
    logits_of(model, prompt, cache)
    logits_of(model, torch.cat([kept[:, :1], wrong], dim=1), cache)
    cache.crop(-3)
    logits_of(model, torch.cat([prompt, kept[:, :1]], dim=1), fresh)
    assert replays == [] and cache.num_bytes() == fresh.num_bytes()
    assert_close(logits_of(model, kept[:, 1:2], cache), full[:, 1:2], atol=ATOL, rtol=0)
    for column in range(3):
        logits_of(model, wrong[:, column : column + 1], cache)
    cache.crop(-3)
    assert replays == [11]
    assert_close(logits_of(model, kept[:, 2:], cache), full[:, 2:], atol=ATOL, rtol=0)


def test_crop_refusals_name_the_reason():
    spec = next(spec for spec in SPECS if spec.name == "conceptmoe-mean")
    model = build(spec)
    cache = model.model.new_cache()
    logits_of(model, random_ids(model, 1, 6, seed=16), cache)
    with pytest.raises(ValueError, match=r"tokens_to_remove=2: ConceptCache\.crop takes a negative count"):
        cache.crop(2)
    with pytest.raises(ValueError, match="tokens_to_remove=-7: the cache holds 6 tokens"):
        cache.crop(-7)
    cache.crop(-1)
    logits_of(model, random_ids(model, 1, 2, seed=17), cache)
    with pytest.raises(ValueError, match=r"can roll back to 5 tokens at most \(its last crop\), not to 4"):
        cache.crop(-3)
    # Keys and values written past the model's forward: nothing recorded them, so nothing can replay them.
    for layer_idx in cache.token_layer_ids:
        layer = cache.layers[layer_idx]
        layer.update(layer.keys[:, :, -1:], layer.values[:, :, -1:])
    with pytest.raises(ValueError, match="tokens were fed without the family's forward recording them"):
        cache.crop(-1)
    assert cache.get_seq_length() == 8


def test_a_converted_checkpoint_drafts_with_its_source(tmp_path):
    """A tiny Mistral with sliding windows converted to Hidden Decoding with n = 2 (windowed intra and
    local layers), loaded as remote code: its source model as the draft gives its greedy tokens. In the
    paper's cross-stream form the converted model differs from its source, so some drafts are rolled
    back; with the conversion default it is its source, so every draft is accepted."""
    from transformers import AutoModelForCausalLM

    from hf_concept.conversion.hidden_decoding import convert_to_hidden_decoding
    from tests.test_convert_hidden_decoding import four_layer_source

    source = four_layer_source(tmp_path / "source", "mistral-sliding").eval()
    paper = dict(cross_stream_mask="causal", cross_stream_positions="expanded")
    for name, settings in (("paper", paper), ("default", {})):
        convert_to_hidden_decoding(tmp_path / "source", tmp_path / name, num_streams=2, **settings)
        model = prepared(AutoModelForCausalLM.from_pretrained(tmp_path / name, trust_remote_code=True))
        assert model.config.intra_window is not None and "local" in model.config.stream_attention_layout
        prompt = random_ids(model, 1, 9, seed=18)
        options = dict(max_new_tokens=24, return_dict_in_generate=True)
        with counted_crops(model) as crops:
            assisted = greedy(model, prompt, assistant_model=prepared(source), **options)
        assert torch.equal(assisted.sequences, greedy(model, prompt, **options).sequences)
        rounds = [count for cache, count in crops if cache is output_cache(assisted)]
        assert len(rounds) < 24 and any(count < 0 for count in rounds) == (name == "paper"), (name, rounds)


def test_a_crop_after_a_long_run_of_one_token_calls():
    """Past 64 one-token calls the recorded calls are merged; a crop still replays them exactly."""
    spec = next(spec for spec in SPECS if spec.name == "conceptmoe-mean")
    model = build(spec)
    tokens = random_ids(model, 1, 80, seed=19)
    full = logits_of(model, tokens)
    cache = model.model.new_cache()
    logits_of(model, tokens[:, :5], cache)
    for column in range(5, 78):
        logits_of(model, tokens[:, column : column + 1], cache)
    cache.crop(-3)
    assert_close(logits_of(model, tokens[:, 75:], cache), full[:, 75:], atol=ATOL, rtol=0)
