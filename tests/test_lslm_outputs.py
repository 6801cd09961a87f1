"""What LSLM returns beside its logits: hidden states on every cached step, attentions of several cached
columns at once (assisted decoding and prompt lookup verify that way), hidden states inside the autograd
graph, and `shift_labels` honoured. `generate`'s outputs: `test_lslm_generate_outputs.py`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from hf_concept.modeling.transformers_compat import enable_activation_checkpointing
from tests.test_lslm_generation import random_row
from tests.test_lslm_hf_contracts import marked_batch, packed_batch
from tests.test_lslm_model import TOKENIZER, lslm

NXT, BOS_MARKER, PAD = 4, 3, 0
MARKERS = (NXT, BOS_MARKER)


def generating_lslm(seed: int = 0, **overrides):
    """An eager LSLM that writes `<nxt>` often (its LM-head row scaled up), with no end of sequence."""
    model = lslm(seed=seed, attn="eager", **overrides)
    with torch.no_grad():
        model.lm_head.weight[NXT] *= 3
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model


def prompt_ids(*texts: str) -> dict[str, torch.Tensor]:
    return TOKENIZER.encode_prompt(list(texts), return_tensors="pt")


def without_markers(row: torch.Tensor) -> torch.Tensor:
    return row[(row != NXT) & (row != BOS_MARKER)]


# Point 10: several cached columns with attentions; assisted decoding and prompt lookup with them.


def test_several_cached_columns_give_each_columns_own_attention_row():
    """A 3-column call over a filled cache returns, per attention module, the rows the three one-column
    calls return (keys zero-padded to the widest), and the same logits."""
    model = generating_lslm()
    input_ids = random_row(torch.Generator().manual_seed(2), 20, marker_share=0.25)
    with torch.no_grad():
        prompt = model(input_ids[:, :14], use_cache=True).cache
        together = model(input_ids[:, 14:17], cache=prompt, output_attentions=True)
        stepped = model(input_ids[:, :14], use_cache=True).cache
        singles = [
            model(input_ids[:, column : column + 1], cache=stepped, output_attentions=True)
            for column in range(14, 17)
        ]
    assert_close(together.logits, torch.cat([single.logits for single in singles], 1), atol=1e-6, rtol=0)
    assert len(together.attentions) == len(model.model.attention_modules())
    for index, weights in enumerate(together.attentions):
        assert weights.shape[-2] == 3
        for row, single in enumerate(singles):
            one = single.attentions[index]
            assert one is not None and one.shape[-2] == 1
            assert_close(weights[..., row : row + 1, : one.shape[-1]], one, atol=1e-6, rtol=0)
            assert (weights[..., row, one.shape[-1] :] == 0).all()


def assert_same_rows(ours: torch.Tensor, theirs: torch.Tensor, where: str) -> None:
    """Equal over the common keys, zero beyond them (a wider tensor holds keys stored later)."""
    assert ours.shape[:-1] == theirs.shape[:-1], where
    width = min(ours.shape[-1], theirs.shape[-1])
    assert_close(ours[..., :width], theirs[..., :width], atol=1e-5, rtol=0, msg=where)
    assert not ours[..., width:].any() and not theirs[..., width:].any(), where


def test_full_forward_attentions_are_the_cached_steps_rows():
    """One query row per input column at every level: a full forward's row t is what the cached step of
    column t returns (markers in the continuation close segments there)."""
    model = generating_lslm()
    input_ids = random_row(torch.Generator().manual_seed(6), 24, marker_share=0.25)
    input_ids[:, 1:8] = torch.arange(70, 77)  # a prefill without markers
    with torch.no_grad():
        full = model(input_ids, output_attentions=True).attentions
        cache = model(input_ids[:, :8], use_cache=True).cache
        steps = [
            model(input_ids[:, column : column + 1], cache=cache, output_attentions=True).attentions
            for column in range(8, 24)
        ]
    assert all(weights.shape[-2] == 24 for weights in full)
    closing = full[len(model.model.token_layers)].sum(-1)[0, 0] > 0.5
    assert int(closing[8:].sum()) >= 2, "the test needs segments closed in the continuation"
    for offset, step in enumerate(steps):
        for index, (ours, theirs) in enumerate(zip(step, full, strict=True)):
            column = 8 + offset
            assert_same_rows(ours, theirs[..., column : column + 1, :], f"column {column}, entry {index}")


@pytest.mark.parametrize("helper", ["assistant_model", "prompt_lookup_num_tokens"])
def test_assisted_decoding_with_attentions_and_hidden_states_equals_greedy(helper):
    model = generating_lslm()
    # A repetitive prompt gives prompt lookup matches; an identical assistant is always accepted.
    inputs = prompt_ids("abcabcabcabcabc")
    settings = dict(max_new_tokens=16, do_sample=False)
    greedy = model.generate(**inputs, **settings)
    extra = {"assistant_model": generating_lslm()} if helper == "assistant_model" else {helper: 3}
    assisted = model.generate(
        **inputs,
        **settings,
        **extra,
        output_attentions=True,
        output_hidden_states=True,
        return_dict_in_generate=True,
    )
    assert torch.equal(assisted.sequences, greedy)
    entries, layers = len(model.model.attention_modules()), model.config.token_encoder_layers + 1
    assert len(assisted.attentions) == len(assisted.hidden_states) >= 2
    for step in assisted.attentions:
        assert len(step) == entries and all(isinstance(weights, torch.Tensor) for weights in step)
    prompt_length = inputs["input_ids"].shape[1]
    first, *steps = assisted.hidden_states
    assert [states.shape[1] for states in first] == [prompt_length] * layers
    for step in steps:
        assert len(step) == layers
        assert all(states.shape == (1, 1, model.config.token_hidden_size) for states in step)


# Point 12a: hidden states on cached steps.


@pytest.mark.parametrize("chunk", [1, 3])
def test_cached_steps_return_the_full_forwards_hidden_states(chunk):
    """Left-padded rows with markers, prefilled then fed `chunk` columns at a time: every call's hidden
    states equal the full forward's at its columns (zero at markers and pads)."""
    model = lslm(token_encoder_layers=2)
    batch = marked_batch()
    input_ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        full = model(**batch, output_hidden_states=True).hidden_states
        out = model(input_ids[:, :14], attention_mask=mask[:, :14], use_cache=True, output_hidden_states=True)
        pieces = [out.hidden_states]
        for start in range(14, input_ids.shape[1], chunk):
            stop = min(start + chunk, input_ids.shape[1])
            step = model(
                input_ids[:, start:stop],
                attention_mask=mask[:, :stop],
                cache=out.cache,
                output_hidden_states=True,
            )
            assert len(step.hidden_states) == model.config.token_encoder_layers + 1
            pieces.append(step.hidden_states)
    for layer, expected in enumerate(full):
        assert_close(torch.cat([piece[layer] for piece in pieces], 1), expected, atol=1e-5, rtol=0)


def test_generate_returns_hidden_states_on_every_step():
    model = generating_lslm()
    inputs = prompt_ids("hidden", "states!")
    out = model.generate(
        **inputs, max_new_tokens=6, do_sample=False, output_hidden_states=True, return_dict_in_generate=True
    )
    assert len(out.hidden_states) == 6
    width, layers = model.config.token_hidden_size, model.config.token_encoder_layers + 1
    for index, step in enumerate(out.hidden_states):
        assert len(step) == layers
        columns = inputs["input_ids"].shape[1] if index == 0 else 1
        assert all(states.shape == (2, columns, width) for states in step)


# Point 12b: shift_labels.


def test_shift_labels_give_the_loss_of_the_labels_they_shift():
    model = lslm()
    batch = marked_batch()
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    labels[0, 5:9] = -100
    shift_labels = F.pad(labels[:, 1:], (0, 1), value=-100)
    with torch.no_grad():
        expected = model(**batch, labels=labels).loss
        shifted = model(**batch, shift_labels=shift_labels).loss
        # transformers' precedence: shift_labels win over labels.
        both = model(**batch, labels=batch["input_ids"], shift_labels=shift_labels).loss
        unmasked = model(**batch, labels=batch["input_ids"]).loss
    assert_close(shifted, expected, atol=0, rtol=0)
    assert_close(both, expected, atol=0, rtol=0)
    assert not torch.isclose(unmasked, expected)


def test_trainer_still_finds_labels_as_its_only_label_column():
    """Trainer takes every forward parameter named like a label for a required column: `shift_labels`
    is a keyword argument, so evaluation with `labels` alone still computes the loss."""
    from transformers.utils import find_labels

    from hf_concept.modeling.modeling_lslm import LSLMForCausalLM

    assert find_labels(LSLMForCausalLM) == ["labels"]


def test_shift_labels_past_the_input_are_refused():
    model = lslm()
    batch = marked_batch()
    shift_labels = F.pad(batch["input_ids"][:, 1:], (0, 1), value=7)
    with pytest.raises(ValueError, match=r"shift_labels\[:, -1\]"):
        model(**batch, shift_labels=shift_labels)
    with pytest.raises(ValueError, match="shift_labels of shape"):
        model(**batch, shift_labels=shift_labels[:, 1:])


# Point 12c: the returned hidden states are the ones the computation uses.


def test_hidden_states_carry_the_gradient_of_the_loss():
    model = lslm(token_encoder_layers=2).train()
    batch = marked_batch()
    out = model(**batch, labels=batch["input_ids"], output_hidden_states=True)
    for states in out.hidden_states:
        states.retain_grad()
    out.loss.backward()
    is_byte = (
        (batch["attention_mask"] == 1) & (batch["input_ids"] != NXT) & (batch["input_ids"] != BOS_MARKER)
    )
    for states in out.hidden_states:
        assert states.grad is not None
        assert (states.grad[is_byte].abs().sum(-1) > 0).float().mean() > 0.5


def test_asking_for_hidden_states_changes_no_output():
    model = lslm(token_encoder_layers=2)
    batch = marked_batch()
    with torch.no_grad():
        plain = model(**batch, labels=batch["input_ids"])
        asked = model(**batch, labels=batch["input_ids"], output_hidden_states=True)
    assert torch.equal(plain.logits, asked.logits) and torch.equal(plain.loss, asked.loss)


# The returned attentions are part of the graph, as transformers' models return them.


def recorded_training_pass(model, batch, seed: int = 0, retain: bool = True, **options):
    """A training forward (the router samples: seeded) with its loss taken backward."""
    torch.manual_seed(seed)
    out = model(**batch, labels=batch["input_ids"], **options)
    for entry in out.attentions or ():
        if retain:
            entry.retain_grad()
    out.loss.backward()
    return out


@pytest.mark.parametrize("batch_of", ["marked", "packed"])
def test_attentions_carry_the_gradient_of_the_loss(batch_of):
    """Every entry (token encoder, segment encoder, decoder self and cross) receives the loss's gradient,
    nonzero where it holds weights; asking for them changes neither the loss nor the parameters'
    gradients."""
    batch = marked_batch() if batch_of == "marked" else packed_batch()
    model = lslm(attn="eager", token_encoder_layers=2).train()
    plain = recorded_training_pass(model, batch)
    expected = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    model.zero_grad()
    asked = recorded_training_pass(model, batch, output_attentions=True)
    assert torch.equal(plain.loss, asked.loss) and torch.equal(plain.logits, asked.logits)
    assert len(asked.attentions) == len(model.model.attention_modules())
    for number, entry in enumerate(asked.attentions):
        assert entry.grad is not None, number
        assert entry.grad[entry != 0].abs().sum() > 0, number
    for name, parameter in model.named_parameters():
        assert_close(parameter.grad, expected[name], atol=1e-6, rtol=1e-5, msg=name)


def test_first_attention_and_hidden_state_retain_a_gradient_of_the_first_logit():
    """transformers' modeling test: retain_grad on `hidden_states[0]` and `attentions[0]`, backward from
    the first logit, both hold a gradient."""
    model = lslm(attn="eager").train()
    batch = marked_batch()
    torch.manual_seed(0)
    out = model(**batch, output_hidden_states=True, output_attentions=True)
    hidden, attention = out.hidden_states[0], out.attentions[0]
    hidden.retain_grad()
    attention.retain_grad()
    out[0].flatten()[0].backward(retain_graph=True)
    assert hidden.grad is not None and attention.grad is not None


def test_gradient_checkpointing_still_returns_the_attentions():
    """Layers recomputed in backward run unrecorded: the entries are then copies beside the graph, equal
    to the ones a pass without checkpointing returns, and training goes on."""
    batch = marked_batch()
    model = lslm(attn="eager").train()
    reference = recorded_training_pass(model, batch, output_attentions=True)
    enable_activation_checkpointing(model, {"use_reentrant": False})
    checkpointed = recorded_training_pass(model, batch, retain=False, output_attentions=True)
    for ours, theirs in zip(checkpointed.attentions, reference.attentions, strict=True):
        assert_close(ours, theirs, atol=1e-6, rtol=0)
