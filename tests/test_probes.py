"""Stream probes (hf_concept.probes) against direct computations on a tiny random Hidden Decoding model."""

from __future__ import annotations

import math

import pytest
import torch

from hf_concept.modeling.configuration_hidden_decoding import HiddenDecodingConfig
from hf_concept.modeling.configuration_plain import PlainDecoderConfig
from hf_concept.modeling.modeling_hidden_decoding import HiddenDecodingForCausalLM
from hf_concept.modeling.modeling_plain import PlainDecoderForCausalLM
from hf_concept.probes import StreamProbe, probe_streams

STREAMS = 3
VOCAB = 48
TOLERANCE = dict(atol=1e-5, rtol=1e-5)


def tiny_model(seed: int = 0) -> HiddenDecodingForCausalLM:
    config = HiddenDecodingConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_streams=STREAMS,
        stream_attention_layout=["intra", "full", "intra", "full"],
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    # Larger weights than the default init make the per-stream distributions differ visibly.
    model = HiddenDecodingForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.3)
    return model.eval()


def prompt(length: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


class WordTokenizer:
    """Stand-in tokenizer: 'w<id>' words; enough for `text=` and decoding in the table."""

    def __call__(self, text: str, return_tensors: str = "pt"):
        ids = torch.tensor([[int(word[1:]) for word in text.split()]])
        return type("Encoding", (), {"input_ids": ids})()

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(f"w{token_id}" if token_id != 5 else "\n" for token_id in token_ids)


def test_final_stream_is_the_models_own_distribution():
    model = tiny_model()
    input_ids = prompt()
    probe = probe_streams(model, input_ids)
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=input_ids).logits[0].float(), dim=-1)  # (L, V)
    top_probs, top_ids = probs.max(dim=-1)
    assert torch.equal(probe.top_ids[:, -1], top_ids)
    torch.testing.assert_close(probe.top_probs[:, -1], top_probs, **TOLERANCE)
    expected_entropy = torch.distributions.Categorical(probs=probs).entropy()
    torch.testing.assert_close(probe.entropies[:, -1], expected_entropy, **TOLERANCE)


def test_every_stream_matches_the_lm_head_on_its_stream_state():
    model = tiny_model()
    input_ids = prompt()
    probe = probe_streams(model, input_ids)
    with torch.no_grad():
        outputs = model(input_ids=input_ids, output_stream_states=True)
        assert outputs.stream_states.shape == (1, STREAMS, input_ids.shape[1], 32)
        logits = model.lm_head(outputs.stream_states[0])  # (S, L, V)
    distribution = torch.distributions.Categorical(logits=logits)
    probs = distribution.probs
    assert (
        probe.top_ids.shape == probe.top_probs.shape == probe.entropies.shape == (input_ids.shape[1], STREAMS)
    )
    assert torch.equal(probe.top_ids, probs.argmax(dim=-1).T)
    torch.testing.assert_close(probe.top_probs, probs.amax(dim=-1).T, **TOLERANCE)
    torch.testing.assert_close(probe.entropies, distribution.entropy().T, **TOLERANCE)
    torch.testing.assert_close(probe.entropy_bits, distribution.entropy().T / math.log(2), **TOLERANCE)
    torch.testing.assert_close(probe.mean_entropy(), distribution.entropy().mean(dim=1), **TOLERANCE)
    differs = (probs.argmax(dim=-1) != probs.argmax(dim=-1)[-1]).float().mean(dim=1)
    torch.testing.assert_close(probe.differs_from_final(), differs)
    assert probe.differs_from_final()[-1] == 0
    # The random model's streams do not all agree: the check above compared distinct distributions.
    assert not torch.allclose(probe.entropies[:, 0], probe.entropies[:, -1])


def test_probe_leaves_the_model_as_it_found_it():
    model = tiny_model().train()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    probe_streams(model, prompt()[0])
    assert model.training
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_table_has_one_row_per_token_and_one_column_per_stream():
    model = tiny_model()
    tokenizer = WordTokenizer()
    text = "w7 w5 w12 w30 w9"
    probe = probe_streams(model, text=text, tokenizer=tokenizer)
    assert isinstance(probe, StreamProbe)
    assert probe.token_ids == [7, 5, 12, 30, 9]
    assert probe.token_texts == ["w7", "\n", "w12", "w30", "w9"]
    lines = probe.to_table().splitlines()
    note, header, rule, rows, footer = lines[0], lines[1], lines[2], lines[3:-3], lines[-3:]
    assert "nats" in note
    assert header.split()[:-1] == ["token", "E0", "E1", "E2"] and header.endswith("(final)")
    assert set(rule.replace(" ", "")) == {"-"} and footer[0] == rule
    assert len(rows) == 5
    for position, row in enumerate(rows):
        # The newline token is shown escaped, so every token stays on its own line.
        assert row.startswith(repr(probe.token_texts[position]))
        assert row.count(" H=") == STREAMS
        for stream in range(STREAMS):
            top = repr(probe.top_texts[position][stream])
            cell = f"{top} {float(probe.top_probs[position, stream]):.2f} H="
            cell += f"{float(probe.entropies[position, stream]):.2f}"
            assert cell in row
    mean_row, differs_row = footer[1], footer[2]
    assert mean_row.split()[2:] == [f"H={float(value):.2f}" for value in probe.entropies.mean(dim=0)]
    final_top = probe.top_ids[:, -1:]
    rates = (probe.top_ids != final_top).float().mean(dim=0)
    assert differs_row.split()[3:] == [f"{float(value):.0%}" for value in rates]
    assert differs_row.split()[-1] == "0%"


def test_table_without_tokenizer_shows_ids():
    model = tiny_model()
    input_ids = prompt(length=4)
    probe = probe_streams(model, input_ids)
    rows = probe.to_table().splitlines()[3:-3]
    assert len(rows) == 4
    assert [row.split()[0] for row in rows] == [str(token_id) for token_id in input_ids[0].tolist()]
    assert all(row.split()[1] == str(int(probe.top_ids[index, 0])) for index, row in enumerate(rows))


def test_bad_inputs_raise_clear_errors():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"batch 1.*\(2, 5\)"):
        probe_streams(model, prompt(length=10).view(2, 5))
    with pytest.raises(ValueError, match="exactly one of input_ids or text"):
        probe_streams(model)
    with pytest.raises(ValueError, match="exactly one of input_ids or text"):
        probe_streams(model, prompt(), text="w3", tokenizer=WordTokenizer())
    with pytest.raises(ValueError, match="text: a tokenizer"):
        probe_streams(model, text="w3 w4")
    with pytest.raises(ValueError, match="empty"):
        probe_streams(model, torch.zeros(1, 0, dtype=torch.long))
    plain = PlainDecoderForCausalLM(
        PlainDecoderConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
        )
    )
    with pytest.raises(ValueError, match=r"Hidden Decoding.*PlainDecoderForCausalLM.*hf_concept_plain"):
        probe_streams(plain, prompt())
    with pytest.raises(ValueError, match="Hidden Decoding"):
        probe_streams(model.model, prompt())
