"""Source checkpoints load into the plain decoder family and give the source model's logits.

For each supported source type a tiny seeded transformers model (fp32, random non-trivial norms,
biases and routers) is saved sharded to disk, read back with `load_source_into_plain`, and both models
run the same left-padded batch under eager and sdpa. Tolerance: atol = rtol = 1e-5 on real tokens.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file
from torch.testing import assert_close
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from hf_concept.conversion import (
    SUPPORTED_SOURCE_TYPES,
    iter_source_tensors,
    load_source_into_plain,
    plain_config_from_source,
    source_key_to_plain,
)
from hf_concept.modeling.configuration_plain import PlainDecoderConfig
from hf_concept.modeling.layers import rope_inverse_frequencies
from hf_concept.modeling.modeling_plain import PlainDecoderForCausalLM

ATOL = RTOL = 1e-5
LENGTH = 12
LEFT_PADS = 3
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    tie_word_embeddings=False,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    config_class: type
    model_class: type
    overrides: dict
    save_kwargs: dict = dataclasses.field(default_factory=dict)


CASES = [
    Case(
        "llama-llama3-rope-biases",
        LlamaConfig,
        LlamaForCausalLM,
        # Wavelengths of head dim 16 fall on all three sides of llama3's band [16, 64].
        dict(
            attention_bias=True,
            mlp_bias=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    Case(
        "llama-tied-linear-rope",
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            tie_word_embeddings=True, rope_parameters=dict(rope_type="linear", rope_theta=5000.0, factor=2.0)
        ),
    ),
    Case("mistral-sliding", MistralConfig, MistralForCausalLM, dict(sliding_window=4, head_dim=16)),
    # max_window_layers=1: layer 0 full, layer 1 sliding; Qwen2 biases q/k/v only.
    Case(
        "qwen2-bias-mixed-window",
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
    ),
    Case(
        "qwen3-qknorm-yarn",
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            head_dim=16,
            attention_bias=True,
            max_position_embeddings=256,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64
            ),
        ),
    ),
    Case("mixtral", MixtralConfig, MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2)),
    Case(
        "mixtral-fused-on-disk",
        MixtralConfig,
        MixtralForCausalLM,
        dict(num_local_experts=4, num_experts_per_tok=2),
        dict(save_original_format=False),
    ),
    # mlp_only_layers=[1]: layer 1 is a dense MLP of intermediate_size.
    Case(
        "qwen2_moe-shared",
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        dict(MOE, shared_expert_intermediate_size=32, norm_topk_prob=False, mlp_only_layers=[1]),
    ),
    Case(
        "qwen2_moe-norm-topk",
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        dict(MOE, shared_expert_intermediate_size=32, norm_topk_prob=True),
    ),
    # decoder_sparse_step=2: layer 0 dense, layer 1 sparse.
    Case(
        "qwen3_moe-sparse-step",
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(MOE, head_dim=16, norm_topk_prob=True, decoder_sparse_step=2),
    ),
]


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter a non-trivial value so that a swapped or dropped tensor cannot hide."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if "norm" in name:
                parameter.copy_(1.0 + 0.3 * noise)
            elif name.endswith("bias"):
                parameter.copy_(0.5 * noise)
            else:
                parameter.copy_(0.2 * noise)


def build_source(case: Case, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = case.config_class(**{**TINY, **case.overrides})
    model = case.model_class(config).eval()
    randomize(model, seed)
    return model


def save_sharded(model: torch.nn.Module, folder, **save_kwargs) -> None:
    model.save_pretrained(folder, max_shard_size="40KB", **save_kwargs)
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1, "the test checkpoint should be sharded"


def padded_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows of LENGTH ids; row 0 has LEFT_PADS pads on the left. Positions count real tokens."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, TINY["vocab_size"], (2, LENGTH), generator=generator)
    attention_mask = torch.ones(2, LENGTH, dtype=torch.long)
    attention_mask[0, :LEFT_PADS] = 0
    input_ids[0, :LEFT_PADS] = TINY["pad_token_id"]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


@torch.no_grad()
def logits_of(model, input_ids, attention_mask, position_ids=None) -> torch.Tensor:
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_source_logits_match(case: Case, tmp_path):
    source = build_source(case)
    save_sharded(source, tmp_path, **case.save_kwargs)
    plain = load_source_into_plain(tmp_path)
    assert isinstance(plain, PlainDecoderForCausalLM)
    input_ids, attention_mask, position_ids = padded_batch()
    real = attention_mask.bool()
    for implementation in ("eager", "sdpa"):
        source.set_attn_implementation(implementation)
        plain.set_attn_implementation(implementation)
        expected = logits_of(source, input_ids, attention_mask, position_ids)
        actual = logits_of(plain, input_ids, attention_mask, position_ids)
        assert torch.isfinite(actual[real]).all()
        assert_close(actual[real], expected[real], atol=ATOL, rtol=RTOL, msg=implementation)
    # Without position_ids the plain model counts real tokens itself (as generate would pass them).
    assert_close(logits_of(plain, input_ids, attention_mask)[real], expected[real], atol=ATOL, rtol=RTOL)


def test_tied_source_stays_tied(tmp_path):
    case = next(case for case in CASES if case.name == "llama-tied-linear-rope")
    save_sharded(build_source(case), tmp_path)
    plain = load_source_into_plain(tmp_path)
    assert plain.config.tie_word_embeddings is True
    assert plain.lm_head.weight is plain.model.embed_tokens.weight


def test_sliding_window_matters_in_the_mistral_case(tmp_path):
    """Guard against a window that both sides silently ignore: full attention gives other logits."""
    case = next(case for case in CASES if case.name == "mistral-sliding")
    save_sharded(build_source(case), tmp_path)
    plain = load_source_into_plain(tmp_path)
    assert plain.config.sliding_window == 4 and set(plain.config.layer_types) == {"sliding_attention"}
    full_config = PlainDecoderConfig(
        **{**plain.config.to_dict(), "sliding_window": None, "layer_types": None}
    )
    full = PlainDecoderForCausalLM(full_config).eval()
    full.load_state_dict(plain.state_dict())
    input_ids, attention_mask, _ = padded_batch()
    windowed, unwindowed = (
        logits_of(plain, input_ids, attention_mask),
        logits_of(full, input_ids, attention_mask),
    )
    window = plain.config.sliding_window
    assert_close(windowed[1, :window], unwindowed[1, :window], atol=ATOL, rtol=RTOL)
    assert not torch.allclose(windowed[1, window:], unwindowed[1, window:], atol=1e-3)


def test_qwen2_mixed_layer_types_are_carried(tmp_path):
    case = next(case for case in CASES if case.name == "qwen2-bias-mixed-window")
    config = plain_config_from_source(case.config_class(**{**TINY, **case.overrides}))
    assert config.layer_types == ["full_attention", "sliding_attention"]
    assert config.sliding_window == 5
    assert (config.attention_bias, config.attention_output_bias) == (True, False)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        dict(rope_type="linear", factor=3.0),
        dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
        dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
        dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, truncate=False, beta_fast=16),
        dict(
            rope_type="yarn", factor=8.0, original_max_position_embeddings=32, mscale=0.7, mscale_all_dim=1.3
        ),
        dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=128, attention_factor=0.9),
    ],
    ids=["default", "linear", "llama3", "yarn", "yarn-no-truncate", "yarn-mscale", "yarn-attention-factor"],
)
def test_rope_frequencies_match_transformers(rope_scaling):
    head_dim, theta, max_positions = 16, 10000.0, 256
    parameters = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": theta}
    reference_config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=max_positions
    )
    reference_config.rope_parameters = parameters
    rope_type = parameters["rope_type"]
    if rope_type == "default":
        expected = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        expected_scale = 1.0
    else:
        expected, expected_scale = ROPE_INIT_FUNCTIONS[rope_type](reference_config)
    inv_freq, scale = rope_inverse_frequencies(head_dim, theta, rope_scaling, max_positions)
    assert_close(inv_freq, expected, atol=0, rtol=1e-6)
    assert scale == pytest.approx(expected_scale, rel=1e-12)


def test_unsupported_source_type_is_named(tmp_path):
    GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=4)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="gpt2") as error:
        load_source_into_plain(tmp_path)
    assert all(name in str(error.value) for name in SUPPORTED_SOURCE_TYPES)
    with pytest.raises(ValueError, match="gpt2"):
        plain_config_from_source(GPT2Config())
    with pytest.raises(ValueError, match="gpt2"):
        source_key_to_plain("transformer.h.0.attn.c_attn.weight", "gpt2")


def test_mixtral_keys_map_to_per_expert_modules():
    assert (
        source_key_to_plain("model.layers.3.block_sparse_moe.experts.5.w1.weight", "mixtral")
        == "model.layers.3.mlp.experts.5.gate_proj.weight"
    )
    assert source_key_to_plain("model.layers.0.block_sparse_moe.experts.0.w2.weight", "mixtral").endswith(
        "experts.0.down_proj.weight"
    )
    assert source_key_to_plain("model.layers.0.block_sparse_moe.experts.0.w3.weight", "mixtral").endswith(
        "experts.0.up_proj.weight"
    )
    assert (
        source_key_to_plain("model.layers.1.block_sparse_moe.gate.weight", "mixtral")
        == "model.layers.1.mlp.gate.weight"
    )
    assert source_key_to_plain("model.layers.1.mlp.shared_expert_gate.weight", "qwen2_moe") == (
        "model.layers.1.mlp.shared_expert_gate.weight"
    )
    assert source_key_to_plain("model.layers.0.self_attn.rotary_emb.inv_freq", "llama") is None


def _single_file_checkpoint(folder, case_name: str = "llama-tied-linear-rope") -> dict[str, torch.Tensor]:
    """A source saved as one model.safetensors; returns its tensors."""
    case = next(case for case in CASES if case.name == case_name)
    source = build_source(case)
    source.save_pretrained(folder)
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def test_unused_and_missing_keys_are_reported(tmp_path):
    tensors = _single_file_checkpoint(tmp_path)
    save_file(
        {**tensors, "model.layers.0.self_attn.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors"
    )
    with pytest.raises(
        ValueError, match=r"unused source keys: \['model\.layers\.0\.self_attn\.extra\.weight'\]"
    ):
        load_source_into_plain(tmp_path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"missing from the source: \['model\.layers\.1\.mlp\.up_proj\.weight'\]"
    ):
        load_source_into_plain(tmp_path)


def test_pickle_weights_need_explicit_flag(tmp_path):
    tensors = _single_file_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="allow_pickle=True"):
        load_source_into_plain(tmp_path)
    plain = load_source_into_plain(tmp_path, allow_pickle=True)
    assert torch.equal(plain.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])


def test_unreadable_shard_is_named(tmp_path):
    _single_file_checkpoint(tmp_path)
    shard = tmp_path / "model.safetensors"
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(ValueError, match=r"file='.*model\.safetensors' could not be read as safetensors"):
        list(iter_source_tensors(tmp_path))
