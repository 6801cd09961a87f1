"""The transformers contracts users of a causal LM rely on without reading our code,
across the four families: what `hidden_states` and `attentions` hold, that the returned states are the
ones the computation uses, that assisted and prompt-lookup decoding return the same per-token outputs as
plain greedy decoding, and that gradient checkpointing (reentrant or not) leaves the gradients unchanged.

Documented layout (the model classes' docstrings; docs/python-api.md), B batch, L tokens of the call:
- ConceptMoE, DLCM: `num_hidden_layers + 1` hidden states, each (B, L, ·): the embeddings, each encoder
  layer, each concept pass as a token view (the concept a token emits, `concept_views`; width Dc), each
  decoder layer (the last normed). Attentions: one entry per attention run, every one token-aligned
  (B, H, L, ·), never None.
- Hidden Decoding: `num_hidden_layers + 1` hidden states (B, L, D), each token's final stream (the last
  one the normed head input). Attentions: one per layer, shapes in `HiddenDecodingModelOutput`.
- LSLM: token-encoder layers + 1 hidden states (B, L, Dt) at the input columns (the byte level).
  Attentions: one per attention module, token-aligned (one row per input column), never None.

Token ids come from [5, vocab): no pad, bos, eos or LSLM marker by chance.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch.testing import assert_close

from hf_concept.modeling.transformers_compat import (
    disable_activation_checkpointing,
    enable_activation_checkpointing,
)
from tests.conformance.families import FAMILIES, FamilySpec

PAD = 0
FIRST_ID = 5
ATOL = 1e-5
SPECS = {spec.name: spec for spec in FAMILIES}
# One spec per family, plus ConceptMoE's closed-chunk pooling and its wider concept stack.
CONTRACT_SPECS = ["conceptmoe-first", "dlcm", "hidden-decoding", "lslm"]
LAYOUT_SPECS = [*CONTRACT_SPECS, "conceptmoe-mean", "conceptmoe-concept-topk", "hidden-decoding-shared-moe"]


def build(spec: FamilySpec, implementation: str = "eager", seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = spec.make_config(**overrides)
    model = spec.model_class()._from_config(config, attn_implementation=implementation)
    # Generation runs to max_new_tokens: an eos by chance must not end a comparison early.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model.eval()


def random_ids(model: torch.nn.Module, *shape: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_ID, model.config.vocab_size, shape, generator=generator)


def left_padded(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 9 and 6 real tokens, right-aligned."""
    input_ids = random_ids(model, 2, 9, seed=1)
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, :3], attention_mask[1, :3] = PAD, 0
    return input_ids, attention_mask


def documented_state_widths(model: torch.nn.Module) -> list[int]:
    """The width of each entry of `hidden_states`, as the family's docstring states it."""
    config, backbone = model.config, model.model
    name = type(model).__name__
    if name.startswith("LSLM"):
        return [config.token_hidden_size] * (len(backbone.token_layers) + 1)
    if name.startswith("HiddenDecoding"):
        return [config.hidden_size] * (config.num_hidden_layers + 1)
    width = config.hidden_size
    concept_width = backbone.concept_layers[0].self_attn.q_proj.in_features
    passes = len(backbone.concept_layer_schedule())
    encoder, decoder = len(backbone.encoder_layers), len(backbone.decoder_layers)
    return [width] * (1 + encoder) + [concept_width] * passes + [width] * decoder


@pytest.mark.parametrize("name", LAYOUT_SPECS)
def test_hidden_states_follow_the_documented_layout(name):
    model = build(SPECS[name])
    input_ids, attention_mask = left_padded(model)
    with torch.no_grad():
        states = model(input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    widths = documented_state_widths(model)
    if not type(model).__name__.startswith("LSLM"):
        # transformers' convention: the embeddings, then one per layer.
        assert len(widths) == model.config.num_hidden_layers + 1
    assert [tuple(state.shape) for state in states] == [(2, 9, width) for width in widths]


@pytest.mark.parametrize("name", ["conceptmoe-first", "conceptmoe-mean", "dlcm"])
def test_concept_entries_are_token_aligned_and_never_none(name):
    """Every attention entry is (B, H, L, ·) for the call's L tokens, in a forward, in a cached step that
    emits no concept and in a multi-token cached call; concept-pass entries are zero on tokens that emit
    no concept."""
    model = build(SPECS[name])
    input_ids = random_ids(model, 1, 12, seed=2)
    with SPECS[name].force_boundaries(model), torch.no_grad():
        prompt = model(input_ids[:, :7], use_cache=True)
        # Fixed chunks of 2: token 7 continues the chunk token 6 opened and emits nothing.
        step = model(input_ids[:, 7:8], cache=prompt.cache, output_attentions=True)
        verify = model(input_ids[:, 8:], cache=prompt.cache, output_attentions=True)
        full = model(input_ids, output_attentions=True)
    first_concept = len(model.model.encoder_layers)
    for output, length in ((step, 1), (verify, 4), (full, 12)):
        assert all(entry is not None and entry.shape[-2] == length for entry in output.attentions)
    assert not step.attentions[first_concept].any()
    # Token 8 opens a chunk (it emits under every pooling); token 9 continues it.
    emitted = full.attentions[first_concept]
    assert emitted[..., 8, :].sum(-1).gt(0).all() and not emitted[..., 9, :].any()
    assert_close(
        verify.attentions[first_concept][..., 0, :],
        emitted[..., 8, : verify.attentions[first_concept].shape[-1]],
    )


@pytest.mark.parametrize("name", [*CONTRACT_SPECS, "conceptmoe-mean"])
def test_cached_steps_return_the_full_forward_rows(name):
    """Hidden states of one-token cached calls (generation's steps) are the full forward's rows, in
    every entry: the concept views too, whose rows are placed where the concept becomes readable."""
    model = build(SPECS[name])
    input_ids = random_ids(model, 1, 11, seed=3)
    with torch.no_grad():
        full = model(input_ids, output_hidden_states=True).hidden_states
        cache = model(input_ids[:, :6], use_cache=True).cache
        for column in range(6, 11):
            step = model(
                input_ids[:, column : column + 1], cache=cache, output_hidden_states=True
            ).hidden_states
            assert step is not None and len(step) == len(full)
            for index, (ours, theirs) in enumerate(zip(step, full, strict=True)):
                assert_close(ours, theirs[:, column : column + 1], atol=ATOL, rtol=0, msg=f"entry {index}")


@pytest.mark.parametrize("name", CONTRACT_SPECS)
def test_returned_hidden_states_are_the_ones_the_computation_uses(name):
    """As transformers' `retain_grad` test: a loss on the logits reaches every returned state, and a loss
    on any returned state reaches the parameters."""
    model = build(SPECS[name])
    input_ids, attention_mask = left_padded(model)
    outputs = model(input_ids, attention_mask=attention_mask, output_hidden_states=True)
    for state in outputs.hidden_states:
        state.retain_grad()
    outputs.logits.sum().backward(retain_graph=True)
    for index, state in enumerate(outputs.hidden_states):
        assert state.grad is not None and state.grad.abs().sum() > 0, f"entry {index} not on the logits' path"
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    for index, state in enumerate(outputs.hidden_states):
        grads = torch.autograd.grad(state.sum(), parameters, retain_graph=True, allow_unused=True)
        assert any(grad is not None and grad.abs().sum() > 0 for grad in grads), f"entry {index}"


def _draft(model: torch.nn.Module) -> torch.nn.Module:
    """The model with noise on its LM head: a draft of the same vocabulary that is sometimes wrong."""
    draft = type(model)._from_config(model.config, attn_implementation="eager").eval()
    draft.load_state_dict(model.state_dict())
    draft.generation_config.eos_token_id = None
    draft.generation_config.pad_token_id = PAD
    noise = torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        draft.lm_head.weight.add_(noise * 0.5 * draft.lm_head.weight.std())
    return draft


def _same_entry(ours: torch.Tensor, theirs: torch.Tensor, where: str) -> None:
    """Equal but for the last dim, which may differ for entries over slots (a verification call's
    tensor holds the slots of later candidates too): the common part is equal, the rest is zero."""
    assert ours.shape[:-1] == theirs.shape[:-1], where
    width = min(ours.shape[-1], theirs.shape[-1])
    assert_close(ours[..., :width], theirs[..., :width], atol=ATOL, rtol=0, msg=where)
    for tensor in (ours, theirs):
        assert not tensor[..., width:].any(), where


@contextlib.contextmanager
def first_round(model: torch.nn.Module) -> Iterator[dict]:
    """Records the first verification pass of assisted decoding: its input length and how many tokens the
    crop of the model's own cache removed after it."""
    record: dict = {}
    cache_class = type(model.model.new_cache())
    crop = cache_class.crop

    def before(module, args, kwargs) -> None:
        record.setdefault("length", kwargs["input_ids"].shape[1])

    def after(module, args, kwargs, output) -> None:
        record.setdefault("cache", output.cache)

    def spy(cache, tokens_to_remove: int) -> None:
        if cache is record.get("cache"):
            record.setdefault("removed", -tokens_to_remove)
        crop(cache, tokens_to_remove)

    handles = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cache_class, "crop", spy)
            yield record
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("mode", ["assistant", "prompt_lookup"])
@pytest.mark.parametrize("name", CONTRACT_SPECS)
def test_assisted_decoding_returns_greedy_outputs_per_token(name, mode):
    # A windowed layer's keys start where its cache's window starts, which differs between a greedy step
    # and a verification pass (transformers' sliding-window caches do the same): Hidden Decoding's local
    # window here spans the whole sequence, so that entries compare key for key.
    overrides = dict(sliding_window=96) if name.startswith("hidden-decoding") else {}
    model = build(SPECS[name], **overrides)
    # A prompt that repeats itself, so that prompt lookup has something to propose.
    prompt = random_ids(model, 1, 4, seed=5).repeat(1, 3)
    new_tokens = 8
    settings = dict(
        max_new_tokens=new_tokens,
        do_sample=False,
        output_scores=True,
        output_attentions=True,
        output_hidden_states=True,
        return_dict_in_generate=True,
    )
    drafting = (
        dict(assistant_model=_draft(model)) if mode == "assistant" else dict(prompt_lookup_num_tokens=3)
    )
    greedy = model.generate(prompt, **settings)
    with first_round(model) as record:
        assisted = model.generate(prompt, **settings, **drafting)
    assert torch.equal(assisted.sequences, greedy.sequences)
    for field in ("scores", "attentions", "hidden_states"):
        assert len(getattr(assisted, field)) == len(getattr(greedy, field)) == new_tokens, field
    # transformers 5.23 splits the candidates the first pass accepted from the call's first rows, not
    # from the prompt's end (a Llama shows it too): those tokens are compared by shape only.
    accepted_first = record["length"] - prompt.shape[1] - record["removed"]
    for token in range(new_tokens):
        assert_close(assisted.scores[token], greedy.scores[token], atol=ATOL, rtol=0)
        for field in ("attentions", "hidden_states"):
            ours, theirs = getattr(assisted, field)[token], getattr(greedy, field)[token]
            assert len(ours) == len(theirs), (field, token)
            for index, (entry, reference) in enumerate(zip(ours, theirs, strict=True)):
                where = f"{field}[{token}][{index}]"
                if 1 <= token <= accepted_first:
                    assert entry.shape[:-1] == reference.shape[:-1], where
                else:
                    _same_entry(entry, reference, where)


def _gradients(model: torch.nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    model.zero_grad()
    # Training samples boundaries: the same seed gives every run the same decisions.
    torch.manual_seed(7)
    model(**batch).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", CONTRACT_SPECS)
def test_gradient_checkpointing_reentrant_or_not_keeps_the_gradients(name):
    """DLCM's "ema" smoothing included (its straight-through confidence reaches every decoder layer)."""
    model = build(SPECS[name]).train()
    input_ids, attention_mask = left_padded(model)
    batch = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        labels=input_ids.masked_fill(attention_mask == 0, -100),
    )
    plain = _gradients(model, batch)
    for reentrant in (True, False):
        enable_activation_checkpointing(model, {"use_reentrant": reentrant})
        checkpointed = _gradients(model, batch)
        disable_activation_checkpointing(model)
        assert checkpointed.keys() == plain.keys(), reentrant
        for key, grad in plain.items():
            assert_close(checkpointed[key], grad, atol=1e-6, rtol=1e-5, msg=f"{key} (reentrant={reentrant})")
