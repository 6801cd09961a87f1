"""PlainDecoderConfig: derived defaults, one validation method, JSON round trip, and what the model
builds from it (dense/sparse placement, router-logit output)."""

from __future__ import annotations

import json

import pytest
import torch

from hf_concept.modeling.configuration_plain import PlainDecoderConfig
from hf_concept.modeling.layers import MLP, SparseMoeBlock
from hf_concept.modeling.modeling_plain import PlainDecoderForCausalLM

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def test_derived_defaults():
    config = PlainDecoderConfig(**{**TINY, "num_key_value_heads": None})
    assert config.num_key_value_heads == 4
    assert config.head_dim == 8
    assert config.layer_types == ["full_attention", "full_attention"]
    assert config.moe_intermediate_size == 48
    assert config.mlp_only_layers == []
    assert config.rope_scaling is None
    windowed = PlainDecoderConfig(**TINY, sliding_window=6)
    assert windowed.layer_types == ["sliding_attention", "sliding_attention"]


def test_rope_scaling_is_normalised():
    legacy = PlainDecoderConfig(**TINY, rope_scaling={"type": "linear", "factor": 2.0})
    assert legacy.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert PlainDecoderConfig(**TINY, rope_scaling={"rope_type": "default"}).rope_scaling is None
    yarn = PlainDecoderConfig(**TINY, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    assert yarn.rope_scaling["original_max_position_embeddings"] == TINY["max_position_embeddings"]


BAD_VALUES = [
    ("vocab_size", 0, {}),
    ("hidden_size", -32, {}),
    ("num_hidden_layers", 1.5, {}),
    ("num_key_value_heads", 3, {}),
    ("head_dim", 7, {}),
    ("hidden_act", "swishy", {}),
    ("rms_norm_eps", 0.0, {}),
    ("rope_theta", -1.0, {}),
    ("attention_dropout", 1.0, {}),
    ("qk_norm", "yes", {}),
    ("sliding_window", 0, {}),
    ("layer_types", ["full_attention"], {}),
    ("layer_types", ["full_attention", "global"], {}),
    ("num_experts", -1, {}),
    ("num_experts_per_tok", 5, {"num_experts": 4}),
    ("moe_intermediate_size", 0, {"num_experts": 4}),
    ("decoder_sparse_step", 0, {"num_experts": 4}),
    ("mlp_only_layers", [2], {"num_experts": 4}),
    ("shared_expert_intermediate_size", 16, {}),
    ("tie_word_embeddings", None, {}),
    ("pad_token_id", 64, {}),
]


@pytest.mark.parametrize(
    ("field", "value", "extra"), BAD_VALUES, ids=[f"{f}={v!r}" for f, v, _ in BAD_VALUES]
)
def test_bad_value_raises_naming_field_and_value(field, value, extra):
    with pytest.raises(ValueError) as error:
        PlainDecoderConfig(**{**TINY, **extra, field: value})
    assert f"{field}={value!r}" in str(error.value), str(error.value)


def test_sliding_layers_need_a_window():
    with pytest.raises(ValueError, match="sliding_window=None"):
        PlainDecoderConfig(**TINY, layer_types=["full_attention", "sliding_attention"])


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "linear"},
        {"rope_type": "linear", "factor": 2.0, "beta_fast": 32},
        {"rope_type": "linear", "factor": -2.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
         "original_max_position_embeddings": 32},
    ],
    ids=["unknown-type", "missing-factor", "unknown-key", "negative-factor", "inverted-band"],
)  # fmt: skip
def test_bad_rope_scaling_raises(rope_scaling):
    with pytest.raises(ValueError, match=r"rope_scaling|factor"):
        PlainDecoderConfig(**TINY, rope_scaling=rope_scaling)


def test_model_revalidates_a_config_edited_after_construction():
    config = PlainDecoderConfig(**TINY)
    config.num_key_value_heads = 3
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        PlainDecoderForCausalLM(config)


def test_json_round_trip_and_auto_map(tmp_path):
    config = PlainDecoderConfig(
        **TINY,
        rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32},
        num_experts=4,
        mlp_only_layers=[0],
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "hf_concept_plain"
    assert saved["auto_map"]["AutoConfig"] == "configuration_plain.PlainDecoderConfig"
    assert saved["auto_map"]["AutoModel"] == "modeling_plain.PlainDecoderModel"
    assert (tmp_path / "configuration_plain.py").is_file()
    reloaded = PlainDecoderConfig.from_pretrained(tmp_path)
    for field in (
        "rope_scaling",
        "layer_types",
        "mlp_only_layers",
        "sliding_window",
        "num_experts",
        "head_dim",
    ):
        assert getattr(reloaded, field) == getattr(config, field), field


def test_sparse_placement_follows_step_and_mlp_only_layers():
    config = PlainDecoderConfig(
        **{**TINY, "num_hidden_layers": 4},
        num_experts=4,
        moe_intermediate_size=16,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )
    model = PlainDecoderForCausalLM(config)
    kinds = [type(layer.mlp) for layer in model.model.layers]
    # Sparse where (index + 1) % step == 0 and not listed as MLP-only.
    assert kinds == [MLP, SparseMoeBlock, MLP, MLP]
    assert model.model.layers[1].mlp.experts[0].gate_proj.out_features == 16
    assert model.model.layers[0].mlp.gate_proj.out_features == TINY["intermediate_size"]


def test_router_logits_are_returned_per_sparse_layer():
    torch.manual_seed(0)
    config = PlainDecoderConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    model = PlainDecoderForCausalLM(config).eval()
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 5))
    captured = []
    hook = model.model.layers[1].mlp.gate.register_forward_hook(lambda _m, _i, out: captured.append(out))
    with torch.no_grad():
        outputs = model(input_ids=input_ids, output_router_logits=True)
        silent = model(input_ids=input_ids)
    hook.remove()
    assert len(outputs.router_logits) == 2
    assert all(logits.shape == (10, 4) for logits in outputs.router_logits)
    assert torch.equal(outputs.router_logits[1], captured[0])
    assert silent.router_logits is None
