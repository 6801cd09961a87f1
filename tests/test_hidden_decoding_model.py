"""Hidden Decoding model family: the fast paths against the masked reference, n = 1 against the plain
family, stream isolation, loss placement, configuration errors."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.testing import assert_close

from hf_concept.modeling.configuration_hidden_decoding import HiddenDecodingConfig, default_stream_layout
from hf_concept.modeling.configuration_plain import PlainDecoderConfig
from hf_concept.modeling.modeling_hidden_decoding import HiddenDecodingForCausalLM
from hf_concept.modeling.modeling_plain import PlainDecoderForCausalLM
from hf_concept.reference.hidden_decoding import reference_logits

BACKBONE = dict(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    pad_token_id=0,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
MIXED_LAYOUT = ["intra", "local", "intra", "full"]


def hd_model(seed: int = 0, attn: str = "sdpa", **overrides) -> HiddenDecodingForCausalLM:
    torch.manual_seed(seed)
    values = dict(BACKBONE, num_streams=3, stream_attention_layout=MIXED_LAYOUT, sliding_window=5)
    values.update(overrides)
    config = HiddenDecodingConfig(**values)
    config._attn_implementation = attn
    return HiddenDecodingForCausalLM(config).eval()


def ids(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, BACKBONE["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("stream_kv", "positions", "attn"),
    list(itertools.product(["per_stream", "shared"], ["expanded", "token"], ["eager", "sdpa"])),
)
def test_folded_streams_equal_the_masked_reference(stream_kv, positions, attn):
    """Folding intra layers into the batch (and the shared-KV path) equals explicit (S·L)² masks."""
    model = hd_model(attn=attn, stream_kv=stream_kv, intra_stream_positions=positions, **MOE)
    input_ids = ids(2, 9)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    expected = reference_logits(model, input_ids, attention_mask)
    real = attention_mask.bool()
    assert_close(logits[real], expected[real], atol=1e-5, rtol=1e-5)
    # Packed documents: position ids restart at 0.
    packed_positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]])
    with torch.no_grad():
        packed = model(input_ids=input_ids[:1], position_ids=packed_positions).logits
    assert_close(packed, reference_logits(model, input_ids[:1], None, packed_positions), atol=1e-5, rtol=1e-5)


def test_reference_mask_catches_a_wrong_layout():
    """The reference comparison can fail: the same weights under another layout give other logits."""
    model = hd_model()
    input_ids = ids(1, 9)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    model.model.layers[0].stream_kind = "full"
    assert (reference_logits(model, input_ids) - logits).abs().max() > 1e-3


@pytest.mark.parametrize("backbone", [{}, MOE, {"sliding_window": 4}], ids=["dense", "moe", "sliding"])
@pytest.mark.parametrize("cross_every", [1, 4])
def test_one_stream_reproduces_the_plain_model(backbone, cross_every):
    torch.manual_seed(0)
    plain = PlainDecoderForCausalLM(PlainDecoderConfig(**BACKBONE, **backbone)).eval()
    layout = default_stream_layout(4, cross_every, plain.config.layer_types)
    # Every layer of the sliding backbone slides: its intra layers keep the window (conversion's rule).
    windows = {"intra_window": 4} if backbone.get("sliding_window") and "intra" in layout else {}
    hd = HiddenDecodingForCausalLM(
        HiddenDecodingConfig(**BACKBONE, **backbone, **windows, num_streams=1, stream_attention_layout=layout)
    ).eval()
    hd.load_state_dict(plain.state_dict())
    input_ids = ids(2, 11)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0
    with torch.no_grad():
        expected = plain(input_ids=input_ids, attention_mask=attention_mask).logits
        logits = hd(input_ids=input_ids, attention_mask=attention_mask).logits
    assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_intra_layers_keep_streams_apart_and_cross_layers_mix_them():
    """All-intra: the final stream never sees the other streams' tables; one full layer changes that."""
    input_ids = ids(1, 7)
    for layout, mixes in ((["intra"] * 4, False), (["intra", "intra", "intra", "full"], True)):
        model = hd_model(stream_attention_layout=layout, sliding_window=None)
        with torch.no_grad():
            before = model(input_ids=input_ids).logits
            width = BACKBONE["hidden_size"]
            # Perturb the tables of streams 0 and 1 only (columns [0, 2D)).
            model.model.embed_tokens.weight[:, : 2 * width] += 1.0
            after = model(input_ids=input_ids).logits
        moved = (after - before).abs().max().item()
        assert (moved > 1e-3) == mixes, (layout, moved)


def test_loss_is_next_token_cross_entropy_on_final_streams_and_every_table_learns():
    model = hd_model().train()
    input_ids = ids(2, 10)
    labels = input_ids.clone()
    labels[0, :3] = -100
    outputs = model(input_ids=input_ids, labels=labels, output_stream_states=True)
    expected = torch.nn.functional.cross_entropy(
        outputs.logits[:, :-1].reshape(-1, BACKBONE["vocab_size"]), labels[:, 1:].reshape(-1)
    )
    assert_close(outputs.loss, expected)
    # The logits are the LM head on the final stream's normed states.
    assert_close(outputs.logits, model.lm_head(outputs.stream_states[:, -1]))
    outputs.loss.backward()
    grad = model.model.embed_tokens.weight.grad.view(BACKBONE["vocab_size"], 3, -1)
    assert all(grad[:, stream].abs().sum() > 0 for stream in range(3))


def test_stream_states_shape_and_inputs_embeds_width_is_checked():
    model = hd_model()
    input_ids = ids(2, 5)
    with torch.no_grad():
        outputs = model(input_ids=input_ids, output_stream_states=True)
        assert outputs.stream_states.shape == (2, 3, 5, BACKBONE["hidden_size"])
        embeds = model.model.embed_tokens(input_ids)
        assert_close(model(inputs_embeds=embeds).logits, outputs.logits)
    with pytest.raises(ValueError, match=r"num_streams \* hidden_size = 96"):
        model(inputs_embeds=torch.zeros(2, 5, BACKBONE["hidden_size"]))


def test_default_layout_follows_the_paper_and_the_source():
    assert default_stream_layout(8) == ["intra", "intra", "intra", "full"] * 2
    assert default_stream_layout(4, 2) == ["intra", "full", "intra", "full"]
    source = ["full_attention", "sliding_attention"] * 2
    assert default_stream_layout(4, 4, source) == ["intra", "local", "intra", "local"]
    with pytest.raises(ValueError, match="cross_every=0"):
        default_stream_layout(4, 0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(num_streams=0), "num_streams=0"),
        (dict(num_streams=2.0), "num_streams=2.0"),
        (dict(stream_attention_layout=["intra"] * 3), "stream_attention_layout="),
        (dict(stream_attention_layout=["intra", "local", "intra", "full"]), "sliding_window=None"),
        (dict(stream_kv="pooled"), "stream_kv='pooled'"),
        (dict(intra_stream_positions="absolute"), "intra_stream_positions='absolute'"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings=True"),
        (dict(layer_types=["sliding_attention"] * 4, sliding_window=4), "layer_types="),
    ],
)
def test_invalid_configs_name_the_field(overrides, message):
    values = dict(BACKBONE, num_streams=2, stream_attention_layout=["intra", "intra", "intra", "full"])
    values.update(overrides)
    with pytest.raises(ValueError, match=message):
        HiddenDecodingConfig(**values)


def test_config_round_trip_keeps_layout_and_derives_layer_types(tmp_path):
    config = HiddenDecodingConfig(
        **BACKBONE, num_streams=4, stream_attention_layout=MIXED_LAYOUT, sliding_window=8
    )
    assert config.layer_types == ["full_attention", "sliding_attention", "full_attention", "full_attention"]
    config.save_pretrained(tmp_path)
    loaded = HiddenDecodingConfig.from_pretrained(tmp_path)
    assert loaded.stream_attention_layout == MIXED_LAYOUT and loaded.num_streams == 4
    assert loaded.layer_types == config.layer_types
    assert HiddenDecodingConfig(num_streams=1, tie_word_embeddings=True).tie_word_embeddings
