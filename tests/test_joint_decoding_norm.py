"""Joint decoding reads normalised concepts: gradients of the right size, step 0 unchanged.

A converted checkpoint's concept is the concept layers' summed residual update (per-token RMS ~60 on
SmolLM2, outliers ~2e4), while q/k/v_proj read the layer's RMS-normed input. Unnormalised, the zero-init
`concept_{q,k,v}_proj` got gradients ~1000x those of every other layer and dominated clipping. The tiny
source here has realistic magnitudes: its concept layers' MLP outputs are scaled so that the concept RMS
is ~40.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close
from transformers import LlamaConfig, LlamaForCausalLM

from hf_concept.conversion.conceptmoe import convert_to_conceptmoe
from hf_concept.modeling.configuration_conceptmoe import ConceptMoEConfig
from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM

# A concept projection's gradient norm stays within this factor of its own layer's q/k/v_proj's.
GRADIENT_FACTOR = 4.0
# The concept layers' MLP output scale that gives concept states of RMS ~40 in this tiny Llama.
MLP_OUTPUT_SCALE = 1e4


def loud_llama() -> LlamaForCausalLM:
    """A tiny random Llama whose middle layers write large residual updates, as trained models do."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers[1:3]:
            layer.mlp.down_proj.weight.mul_(MLP_OUTPUT_SCALE)
    return model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("joint_norm")
    source = loud_llama()
    source.save_pretrained(folder / "source")
    # R = 1 with fixed chunking: every token is a concept, so the converted model is the source.
    destination = convert_to_conceptmoe(
        folder / "source",
        folder / "converted",
        encoder_layers=1,
        decoder_layers=1,
        chunking="fixed",
        compression_ratio=1,
    )
    return source, destination


def joint_gradient_ratios(destination, joint_decoding_norm: bool) -> dict[str, float]:
    """concept_{q,k,v}_proj gradient norm over {q,k,v}_proj's, in the one joint layer, after one batch."""
    config = ConceptMoEConfig.from_pretrained(destination)
    config.joint_decoding_norm = joint_decoding_norm
    model = ConceptMoEForCausalLM.from_pretrained(destination, config=config)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    attention = model.model.decoder_layers[-1].self_attn
    return {
        name: getattr(attention, f"concept_{name}_proj").weight.grad.norm().item()
        / getattr(attention, f"{name}_proj").weight.grad.norm().item()
        for name in "qkv"
    }


def test_converted_model_is_still_the_source_at_step_zero(converted):
    source, destination = converted
    model = ConceptMoEForCausalLM.from_pretrained(destination).eval()
    assert model.config.joint_decoding_norm is True
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_close(model(ids).logits, source.eval()(ids).logits, rtol=1e-5, atol=1e-5)


def test_concept_states_have_realistic_magnitude(converted):
    _, destination = converted
    model = ConceptMoEForCausalLM.from_pretrained(destination).eval()
    seen = {}
    layer = model.model.decoder_layers[-1]
    layer.register_forward_pre_hook(lambda module, args: seen.update(concepts=args[1]))
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 16)))
    assert seen["concepts"].pow(2).mean().sqrt() > 20


def test_joint_projection_gradients_match_the_layers_own(converted):
    ratios = joint_gradient_ratios(converted[1], joint_decoding_norm=True)
    assert all(1 / GRADIENT_FACTOR < ratio < GRADIENT_FACTOR for ratio in ratios.values()), ratios


def test_unnormalised_concepts_blow_the_gradients_up(converted):
    # The former behaviour (configs saved before the field): the check above has teeth.
    ratios = joint_gradient_ratios(converted[1], joint_decoding_norm=False)
    assert min(ratios.values()) > 5 * GRADIENT_FACTOR, ratios


def test_configs_saved_before_the_field_load_without_the_norm():
    legacy = ConceptMoEConfig.from_dict({"transformers_version": "5.0.0", "num_hidden_layers": 6})
    assert legacy.joint_decoding_norm is False
    assert ConceptMoEConfig().joint_decoding_norm is True
    with pytest.raises(ValueError, match="joint_decoding_norm"):
        ConceptMoEConfig(joint_decoding_norm="yes").check_fields()
