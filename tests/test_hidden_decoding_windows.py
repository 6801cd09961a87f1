"""Hidden Decoding windows in tokens: `local_window` derives the expanded
`sliding_window`, `intra_window` bounds what an intra layer sees of its own stream, and both hold in the
fast paths, the masked reference and cached decoding."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.testing import assert_close

from hf_concept.modeling.configuration_hidden_decoding import HiddenDecodingConfig, default_stream_layout
from hf_concept.reference.hidden_decoding import reference_logits
from tests.test_concept_cache import left_pad, prepared
from tests.test_hidden_decoding_model import BACKBONE, hd_model, ids

WINDOWED = dict(local_window=2, sliding_window=None, intra_window=3)


def test_local_window_counts_tokens_and_derives_the_expanded_window():
    config = HiddenDecodingConfig(
        **BACKBONE, num_streams=3, stream_attention_layout=["intra", "local"] * 2, local_window=4
    )
    assert (config.local_window, config.sliding_window) == (4, 12)
    # A saved config holds both; reloading it agrees with itself.
    again = HiddenDecodingConfig.from_dict(config.to_dict())
    assert (again.local_window, again.sliding_window) == (4, 12)
    with pytest.raises(
        ValueError, match=r"sliding_window=8 conflicts with local_window=4 tokens × num_streams=3 = 12"
    ):
        HiddenDecodingConfig(**BACKBONE, num_streams=3, local_window=4, sliding_window=8)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(local_window=0), r"local_window=0 must be None or an integer"),
        (dict(intra_window=2.5), r"intra_window=2.5 must be None or an integer"),
        (dict(intra_window=4, stream_kv="shared"), r"intra_window=4 cannot hold with stream_kv='shared'"),
        (
            dict(stream_attention_layout=["intra", "local", "intra", "full"]),
            r"local_window=None and sliding_window=None",
        ),
    ],
)
def test_window_fields_are_checked_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        HiddenDecodingConfig(**BACKBONE, **fields).check_fields()


def test_default_layout_rule_for_sources_whose_layers_all_slide():
    sliding = ["sliding_attention"] * 8
    assert default_stream_layout(8, 4, sliding) == ["intra"] * 3 + ["local"] + ["intra"] * 3 + ["local"]
    assert default_stream_layout(4, 1, sliding[:4]) == ["local"] * 4
    # Beside full source layers, sliding layers stay local and full layers follow the 1-in-K rule.
    mixed = ["full_attention"] * 4 + ["sliding_attention"] * 4
    assert default_stream_layout(8, 2, mixed) == ["intra", "full", "intra", "full"] + ["local"] * 4


@pytest.mark.parametrize(
    ("layout", "attn"),
    list(
        itertools.product(
            [["intra", "local", "intra", "full"], ["local", "intra", "local", "intra"]], ["eager", "sdpa"]
        )
    ),
)
def test_windowed_intra_layers_equal_the_masked_reference_and_decode_exactly(layout, attn):
    model = hd_model(attn=attn, stream_attention_layout=layout, **WINDOWED)
    unbounded = hd_model(attn=attn, stream_attention_layout=layout, local_window=2, sliding_window=None)
    input_ids, attention_mask = left_pad([ids(11, seed=3), ids(7, seed=4)])
    real = attention_mask.bool()
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        expected = reference_logits(model, input_ids, attention_mask, None)
        wider = unbounded(input_ids=input_ids, attention_mask=attention_mask).logits
        packed = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]])
        packed_logits = model(input_ids=input_ids[:1], position_ids=packed).logits
    assert_close(logits[real], expected[real], atol=1e-5, rtol=1e-5)
    assert_close(packed_logits, reference_logits(model, input_ids[:1], None, packed), atol=1e-5, rtol=1e-5)
    # Past three tokens the window matters: the same weights without it give other logits.
    assert (logits - wider)[real].abs().max() > 1e-3
    model = prepared(model)
    settings = dict(attention_mask=attention_mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(
        model.generate(input_ids, **settings), model.generate(input_ids, use_cache=False, **settings)
    )
