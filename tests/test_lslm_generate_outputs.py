"""LSLM `generate` keeps transformers' output contract: `sequences` hold every id the loop ran on, the
`<nxt>`/`<bos>` markers included, so every per-step output has one entry per returned token in every
decoding mode, `compute_transition_scores` works, and the step logits are what a full forward over the
returned sequence computes. Text drops the markers: `decode(skip_special_tokens=True)`, the
text-generation pipeline and a streamer."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close
from transformers import TextStreamer, pipeline
from transformers.generation.streamers import BaseStreamer

from hf_concept.modeling.tokenization_lslm import ByteTokenizer
from tests.test_lslm_outputs import MARKERS, NXT, generating_lslm, prompt_ids

PER_STEP = ("scores", "logits", "attentions", "hidden_states")
# Sampling at temperature 0.1: the untrained model's distribution is nearly flat, and the runs must hold
# markers. Assisted decoding and prompt lookup take one row.
SAMPLED = dict(do_sample=True, temperature=0.1)
MODES = {
    "greedy": dict(do_sample=False),
    "sample": SAMPLED,
    "beam_search": dict(num_beams=3, num_return_sequences=2, do_sample=False),
    "beam_sample": dict(num_beams=3, **SAMPLED),
    "assisted_greedy": dict(do_sample=False, assistant="draft", one_row=True),
    "assisted_sample": dict(**SAMPLED, assistant="draft", one_row=True),
    "prompt_lookup": dict(do_sample=False, prompt_lookup_num_tokens=3, one_row=True),
}
ASKED = dict(
    return_dict_in_generate=True,
    output_scores=True,
    output_logits=True,
    output_attentions=True,
    output_hidden_states=True,
)


def marker_prone(seed: int = 0) -> torch.nn.Module:
    """`generating_lslm` writing `<nxt>` more often still: every sampled run below holds markers."""
    model = generating_lslm(seed=seed)
    with torch.no_grad():
        model.lm_head.weight[NXT] *= 1.5
    return model


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return marker_prone()


def generate(model, mode: str, inputs: dict[str, torch.Tensor], max_new_tokens: int = 14, **extra):
    settings = dict(MODES[mode])
    if settings.pop("assistant", None):
        settings["assistant_model"] = marker_prone(seed=1)
    if settings.pop("one_row", False):
        inputs = {name: tensor[:1] for name, tensor in inputs.items()}
    torch.manual_seed(7)
    return model.generate(**inputs, max_new_tokens=max_new_tokens, **settings, **ASKED, **extra), inputs


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_output_has_one_entry_per_returned_token(model, mode):
    """`max_new_tokens` counts every returned id, markers included; each per-step output has that many
    entries; `compute_transition_scores` gives one score per returned token."""
    batch = prompt_ids("abcab abcab", "the quick brown fox")
    output, inputs = generate(model, mode, batch)
    prompt_length = inputs["input_ids"].shape[1]
    new = output.sequences.shape[1] - prompt_length
    assert new == 14  # no end of sequence: every step returns one id
    rows = output.sequences[:, prompt_length:]
    assert torch.isin(rows, torch.tensor(MARKERS)).any(), "the test needs generated markers"
    for name in PER_STEP:
        assert len(getattr(output, name)) == new, (mode, name)
    beams = getattr(output, "beam_indices", None)
    transition = model.compute_transition_scores(
        output.sequences, output.scores, beams, normalize_logits=True
    )
    assert transition.shape == rows.shape
    assert torch.isfinite(transition[rows != 0]).all()
    if "beam" not in mode:
        # Outside beam search the transition score of a token is its log-probability in that step's scores.
        chosen = torch.stack(output.scores, 1).log_softmax(-1).gather(2, rows[..., None])[..., 0]
        assert_close(transition, chosen, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["greedy", "sample", "assisted_sample", "prompt_lookup"])
def test_step_logits_equal_a_full_forward_over_the_returned_sequence(model, mode):
    """Left-padded rows (one row under assisted decoding): every step's logits equal one forward over the
    returned ids, markers included, within 1e-4."""
    batch = prompt_ids("ab", "the quick brown fox")
    output, inputs = generate(model, mode, batch, max_new_tokens=16)
    prompt_length = inputs["input_ids"].shape[1]
    mask = torch.cat([inputs["attention_mask"], torch.ones_like(output.sequences[:, prompt_length:])], dim=1)
    with torch.no_grad():
        full = model(output.sequences, attention_mask=mask).logits
    steps = torch.stack(output.logits, 1)
    assert_close(steps, full[:, prompt_length - 1 : -1], atol=1e-4, rtol=0)
    assert (output.sequences[:, prompt_length:] == NXT).any(), "the test needs generated markers"


class Collector(BaseStreamer):
    def __init__(self) -> None:
        self.puts: list[list[int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.flatten().tolist())

    def end(self) -> None:
        self.puts.append([])


def test_text_carries_no_marker(model, capsys):
    """`decode(skip_special_tokens=True)`, the text-generation pipeline and `TextStreamer` (special tokens
    not skipped) give the same text, without markers; a streamer receives the prompt, then bytes."""
    tokenizer = ByteTokenizer(append_eos_token=False)
    inputs = prompt_ids("clean output")
    settings = dict(max_new_tokens=16, do_sample=False)
    streamer = Collector()
    sequences = model.generate(**inputs, **settings, streamer=streamer)
    new = sequences[0, inputs["input_ids"].shape[1] :]
    assert (new == NXT).sum() >= 2, "the test needs generated markers"
    text = tokenizer.decode(new, skip_special_tokens=True)
    assert "<nxt>" in tokenizer.decode(new) and "<nxt>" not in text and "<bos>" not in text
    assert streamer.puts[0] == inputs["input_ids"][0].tolist() and streamer.puts[-1] == []
    streamed = [token for put in streamer.puts[1:] for token in put]
    assert streamed == [token for token in new.tolist() if token not in MARKERS]
    capsys.readouterr()
    model.generate(**inputs, **settings, streamer=TextStreamer(tokenizer, skip_prompt=True))
    assert capsys.readouterr().out == text + "\n"
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    piped = generator("clean output", **settings, return_full_text=False)[0]["generated_text"]
    assert piped == text
