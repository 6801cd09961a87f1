"""Hidden Decoding converts a checkpoint without loss at any n.

Converted with the defaults (token-block cross-stream masks, one RoPE position per token in every layer),
an n-stream model gives its source's logits (max |Δlogit| ≤ 1e-4, fp32, a left-padded batch, real tokens)
for n = 2 and 4, under the paper-default layout (one full layer in four), intra + full layouts, and local
layers (sources with sliding-window layers, windows shorter than the batch); its cached greedy generation
is the source's. The paper's form (causal masks over the expanded sequence, expanded positions) changes
the logits, so the comparison can fail. Growing a token-block model whose stream tables differ (as after
training) n → 2n keeps its logits exactly. A real shape: SmolLM2-135M's dimensions (hidden 576, 9 query /
3 key-value heads of 64, RoPE θ 1e5, tied embeddings), 4 of its 30 layers and a smaller vocabulary,
random weights at a trained model's logit scale (slow: about 12 s on a shared core). The real checkpoint's
figures are in REPRODUCTION.md; docs/conversion.md describes the conversion.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from hf_concept.conversion import convert_to_hidden_decoding, expand_hidden_decoding
from hf_concept.modeling.modeling_hidden_decoding import HiddenDecodingForCausalLM
from hf_concept.modeling.transformers_compat import output_cache
from tests.test_convert_hidden_decoding import EMBEDDING, config_of, four_layer_source
from tests.test_layers_compat import TINY, logits_of, padded_batch

TOLERANCE = 1e-4
# (source case, layout pattern or None for the converter's default, the layout that results).
LAYOUTS = {
    "paper-default": ("llama-llama3-rope-biases", None, ["intra", "intra", "intra", "full"]),
    "intra-full": ("qwen3-qknorm-yarn", "ifif", ["intra", "full", "intra", "full"]),
    "all-full": ("llama-tied-linear-rope", "ffff", ["full"] * 4),
    # Layer 0 full in the source, layers 1-3 sliding (window 5 tokens < 12): they become local.
    "local-mixed": ("qwen2-bias-mixed-window", None, ["intra", "local", "local", "local"]),
    # Every source layer slides (window 4): windowed intra layers and one local layer.
    "local-all-sliding": ("mistral-sliding", None, ["intra", "intra", "intra", "local"]),
}


def max_difference(model, expected: torch.Tensor, batch: dict) -> float:
    real = batch["attention_mask"].bool()
    return (logits_of(model, **batch)[real] - expected[real]).abs().max().item()


@pytest.mark.parametrize("num_streams", [2, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_conversion_keeps_the_source_logits(tmp_path, layout, num_streams):
    case, pattern, expected_layout = LAYOUTS[layout]
    source = four_layer_source(tmp_path / "src", case)
    input_ids, attention_mask, position_ids = padded_batch()
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    expected = logits_of(source, **batch)
    convert_to_hidden_decoding(
        tmp_path / "src", tmp_path / "hd", num_streams=num_streams, stream_attention_layout=pattern
    )
    config = config_of(tmp_path / "hd")
    assert config["stream_attention_layout"] == expected_layout
    assert (config["cross_stream_mask"], config["cross_stream_positions"]) == ("token_block", "token")
    model = HiddenDecodingForCausalLM.from_pretrained(tmp_path / "hd").eval()
    assert max_difference(model, expected, batch) <= TOLERANCE


def test_the_papers_cross_stream_form_changes_the_source(tmp_path):
    """The comparison above can fail: the paper's causal masks and expanded positions in the cross-stream
    layers move the converted logits (streams of one token see different copies of it)."""
    source = four_layer_source(tmp_path / "src", "qwen2-bias-mixed-window")
    input_ids, attention_mask, position_ids = padded_batch()
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    expected = logits_of(source, **batch)
    for name, settings in {
        "causal": dict(cross_stream_mask="causal"),
        "expanded": dict(cross_stream_positions="expanded"),
    }.items():
        convert_to_hidden_decoding(tmp_path / "src", tmp_path / name, num_streams=2, **settings)
        model = HiddenDecodingForCausalLM.from_pretrained(tmp_path / name).eval()
        assert max_difference(model, expected, batch) > 1e-2, name


def test_converted_greedy_generation_is_the_sources(tmp_path):
    """n = 4 with local and full layers, cached, past the local window (5 tokens): the source's tokens."""
    source = four_layer_source(tmp_path / "src", "qwen2-bias-mixed-window", max_window_layers=2)
    convert_to_hidden_decoding(tmp_path / "src", tmp_path / "hd", num_streams=4, cross_every=2)
    assert config_of(tmp_path / "hd")["stream_attention_layout"] == ["intra", "full", "local", "local"]
    model = HiddenDecodingForCausalLM.from_pretrained(tmp_path / "hd").eval()
    input_ids, attention_mask, _ = padded_batch()
    settings = dict(attention_mask=attention_mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    expected = source.generate(input_ids, **settings)
    output = model.generate(input_ids, return_dict_in_generate=True, **settings)
    assert type(output_cache(output)).__name__ == "StreamCache"
    assert torch.equal(output.sequences, expected)


def test_expanding_a_token_block_model_keeps_its_logits(tmp_path):
    """Tables that differ (as after training) grown 2 → 4 by cyclic replication: the same logits, since
    stream k + 2 repeats stream k at every layer and every cross-stream key comes twice as often."""
    source = four_layer_source(tmp_path / "src", "qwen2-bias-mixed-window")
    convert_to_hidden_decoding(tmp_path / "src", tmp_path / "two", num_streams=2, cross_every=2)
    tensors = load_file(tmp_path / "two" / "model.safetensors")
    width = TINY["hidden_size"]
    noise = torch.randn(TINY["vocab_size"], width, generator=torch.Generator().manual_seed(3))
    tensors[EMBEDDING][:, width:] += noise
    save_file(tensors, str(tmp_path / "two" / "model.safetensors"), metadata={"format": "pt"})
    expand_hidden_decoding(tmp_path / "two", tmp_path / "four", num_streams=4)
    assert config_of(tmp_path / "four")["cross_stream_mask"] == "token_block"
    input_ids, attention_mask, position_ids = padded_batch()
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    two = HiddenDecodingForCausalLM.from_pretrained(tmp_path / "two").eval()
    four = HiddenDecodingForCausalLM.from_pretrained(tmp_path / "four").eval()
    expected = logits_of(two, **batch)
    assert max_difference(four, expected, batch) <= TOLERANCE
    # The changed table took effect: the two-stream model is no longer its source.
    assert max_difference(source, expected, batch) > 1e-2


SMOLLM2_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    # SmolLM2-135M has 30 layers and 49152 tokens; 4 layers and 2048 tokens keep the test short.
    num_hidden_layers=4,
    vocab_size=2048,
    pad_token_id=0,
    initializer_range=0.05,
)


def smollm2_shaped_source(seed: int = 0) -> LlamaForCausalLM:
    """Random weights at about a trained model's scale: norms away from 1, logits spread over several
    nats (a final norm of 2 to 4)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                low = 2.0 if name == "model.norm.weight" else 0.5
                parameter.copy_(low + 2 * (torch.rand(parameter.shape, generator=generator) - 0.25))
    return model


@pytest.mark.slow
def test_a_smollm2_shaped_model_converts_without_loss(tmp_path):
    """n = 2 and 4, the default layout (one full layer in four), 2 × 40 tokens with left padding: the
    source's logits within 1e-4, while the paper's form moves them by more than 0.1."""
    source = smollm2_shaped_source()
    source.save_pretrained(tmp_path / "src")
    input_ids = torch.randint(
        1, SMOLLM2_SHAPE["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1)
    )
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :5] = 0
    input_ids[0, :5] = 0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    expected = logits_of(source, **batch)
    assert expected.std() > 2, "logits at a trained model's spread"
    paper = dict(cross_stream_mask="causal", cross_stream_positions="expanded")
    for num_streams in (2, 4):
        for name, settings in (("default", {}), ("paper", paper)):
            folder = tmp_path / f"{name}-{num_streams}"
            convert_to_hidden_decoding(tmp_path / "src", folder, num_streams=num_streams, **settings)
            assert config_of(folder)["stream_attention_layout"] == ["intra", "intra", "intra", "full"]
            model = HiddenDecodingForCausalLM.from_pretrained(folder).eval()
            difference = max_difference(model, expected, batch)
            if name == "default":
                assert difference <= TOLERANCE, (num_streams, difference)
            else:
                assert difference > 0.1, (num_streams, difference)


def _copies_model(**overrides) -> HiddenDecodingForCausalLM:
    """A tiny token-block model whose S stream tables are equal, as a fresh conversion leaves them."""
    from tests.conformance.families import _hidden_decoding_token_block_config

    config = _hidden_decoding_token_block_config(**overrides)
    torch.manual_seed(0)
    model = HiddenDecodingForCausalLM(config).train()
    weight = model.model.embed_tokens.weight
    with torch.no_grad():
        first = weight.view(config.vocab_size, config.num_streams, -1)[:, :1]
        weight.copy_(first.expand(-1, config.num_streams, -1).reshape_as(weight))
    return model


def _stays_source_warnings(model, caplog) -> list[str]:
    import logging

    input_ids = torch.randint(3, 60, (2, 10), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            model(input_ids=input_ids, labels=input_ids).loss.backward()
    return [r.getMessage() for r in caplog.records if "the streams stay copies" in r.getMessage()]


@pytest.mark.parametrize("supervision", ["sum", "all_streams"])
def test_a_symmetric_loss_on_equal_tables_warns_once_and_the_streams_get_equal_gradients(supervision, caplog):
    """Under token-block layers a stream-symmetric loss gives every stream the same gradient, so training
    could never make the streams differ: the model says so once."""
    model = _copies_model(stream_supervision=supervision)
    (message,) = _stays_source_warnings(model, caplog)
    assert supervision in message and "stream_supervision='final'" in message
    config = model.config
    grads = model.model.embed_tokens.weight.grad.view(config.vocab_size, config.num_streams, -1)
    torch.testing.assert_close(grads, grads[:, :1].expand_as(grads), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(stream_supervision="final"),
        dict(stream_supervision="sum", cross_stream_mask="causal", cross_stream_positions="expanded"),
    ],
    ids=["final-supervision", "paper-form"],
)
def test_nothing_is_said_when_training_can_break_the_symmetry(overrides, caplog):
    assert _stays_source_warnings(_copies_model(**overrides), caplog) == []
