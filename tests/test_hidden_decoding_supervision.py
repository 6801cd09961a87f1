"""Hidden Decoding's supervision variants (HD §5.1, Table 5): "final" (the paper's HD) is the model as it
was, "all_streams" averages every stream's next-token loss, "sum" predicts from the streams' summed
states; each against a by-hand reference, with cached generation and gradients."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from hf_concept.modeling.configuration_hidden_decoding import HiddenDecodingConfig
from hf_concept.reference.hidden_decoding import reference_logits
from tests.test_concept_cache import prepared
from tests.test_hidden_decoding_model import BACKBONE, hd_model, ids

VOCAB = BACKBONE["vocab_size"]
ALL_INTRA = ["intra"] * 4


def with_supervision(model, supervision: str):
    """`model` (same weights) under another `stream_supervision`: the field is read at every forward."""
    model.config.stream_supervision = supervision
    return model


def token_mean_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, items: int | None = None):
    """Shifted next-token cross-entropy of (B, L, V) logits: summed over labels != -100, divided by their
    count or by `items`."""
    shifted = labels[:, 1:].reshape(-1)
    total = nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB).float(), shifted, ignore_index=-100, reduction="sum"
    )
    return total / (items if items is not None else (shifted != -100).sum())


def raw_stream_states(model, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, S, L, D) last-layer states before the final norm: `stream_states` with the norm taken out."""
    norm = model.model.norm
    model.model.norm = nn.Identity()
    try:
        with torch.no_grad():
            return model(input_ids=input_ids, output_stream_states=True).stream_states
    finally:
        model.model.norm = norm


def labelled(input_ids: torch.Tensor) -> torch.Tensor:
    labels = input_ids.clone()
    labels[0, :3] = -100
    return labels


def test_final_is_the_default_and_reads_the_final_stream_only():
    """ "final" is bit-identical to a config that never names the field (today's model)."""
    input_ids = ids(2, 9)
    labels = labelled(input_ids)
    default = hd_model().train()
    final = hd_model(stream_supervision="final").train()
    assert default.config.stream_supervision == "final"
    expected, outputs = default(input_ids=input_ids, labels=labels), final(input_ids=input_ids, labels=labels)
    assert torch.equal(outputs.logits, expected.logits) and torch.equal(outputs.loss, expected.loss)
    assert outputs.stream_states is None
    with torch.no_grad():
        streams = final(input_ids=input_ids, output_stream_states=True).stream_states
    # Same values by two kernel shapes (the norm over one stream or over all): equal up to float reordering,
    # which some CPUs (AMD EPYC here) show in the last bit.
    assert_close(outputs.logits, final.lm_head(streams[:, -1]), atol=1e-6, rtol=1e-6)
    assert_close(outputs.loss, token_mean_cross_entropy(outputs.logits, labels))


def test_a_saved_config_without_the_field_loads_as_final(tmp_path):
    HiddenDecodingConfig(**BACKBONE, num_streams=2, stream_attention_layout=ALL_INTRA).save_pretrained(
        tmp_path
    )
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    assert saved.pop("stream_supervision") == "final"
    path.write_text(json.dumps(saved))
    assert HiddenDecodingConfig.from_pretrained(tmp_path).stream_supervision == "final"
    config = HiddenDecodingConfig(**BACKBONE, num_streams=2, stream_attention_layout=ALL_INTRA)
    config.stream_supervision = "sum"
    config.save_pretrained(tmp_path)
    assert HiddenDecodingConfig.from_pretrained(tmp_path).stream_supervision == "sum"


def test_an_unknown_supervision_names_the_field():
    with pytest.raises(ValueError, match="stream_supervision='mean'"):
        HiddenDecodingConfig(
            **BACKBONE, num_streams=2, stream_attention_layout=ALL_INTRA, stream_supervision="mean"
        )


@pytest.mark.parametrize("items", [None, 37])
def test_all_streams_loss_is_the_mean_of_every_streams_cross_entropy(items):
    """Mean over the S streams of each stream's per-label-token loss through the shared norm and head;
    with Trainer's `num_items_in_batch` every stream's sum is divided by it. Logits stay the final
    stream's."""
    model = hd_model(stream_supervision="all_streams").train()
    input_ids = ids(2, 9)
    labels = labelled(input_ids)
    extra = {} if items is None else dict(num_items_in_batch=torch.tensor(items))
    outputs = model(input_ids=input_ids, labels=labels, **extra)
    streams = outputs.stream_states
    assert streams.shape == (2, 3, 9, BACKBONE["hidden_size"])
    per_stream = [token_mean_cross_entropy(model.lm_head(streams[:, k]), labels, items) for k in range(3)]
    assert_close(outputs.loss, torch.stack(per_stream).mean())
    # The prediction is still the final stream's: other than the final-stream loss.
    assert_close(outputs.logits, model.lm_head(streams[:, -1]), atol=1e-6, rtol=1e-6)
    final_loss = token_mean_cross_entropy(outputs.logits, labels, items)
    assert (outputs.loss - final_loss).abs() > 1e-4
    with torch.no_grad():
        final = with_supervision(model, "final")(input_ids=input_ids)
    assert_close(final.logits, outputs.logits, atol=1e-6, rtol=1e-6)


def test_sum_predicts_from_the_norm_of_the_summed_streams():
    """head(norm(Σ_k h_k)) with the sum taken on the last layer's states, before the final norm."""
    model = hd_model(stream_supervision="sum").eval()
    input_ids = ids(2, 9)
    labels = labelled(input_ids)
    with torch.no_grad():
        outputs = model(input_ids=input_ids, labels=labels)
        expected = model.lm_head(model.model.norm(raw_stream_states(model, input_ids).sum(dim=1)))
        masked_reference = reference_logits(model, input_ids)
        final = with_supervision(model, "final")(input_ids=input_ids)
    assert_close(outputs.logits, expected, atol=1e-5, rtol=1e-5)
    # The masked reference, built from the definitions, reads the sum too.
    assert_close(outputs.logits, masked_reference, atol=1e-5, rtol=1e-5)
    assert_close(outputs.loss, token_mean_cross_entropy(outputs.logits, labels))
    # The reference can fail: the final stream alone predicts otherwise.
    assert (final.logits - outputs.logits).abs().max() > 1e-3


def test_sum_with_one_stream_is_the_final_stream():
    input_ids = ids(2, 7)
    with torch.no_grad():
        final = hd_model(num_streams=1, sliding_window=None, stream_attention_layout=ALL_INTRA)(
            input_ids=input_ids
        )
        summed = hd_model(
            num_streams=1, sliding_window=None, stream_attention_layout=ALL_INTRA, stream_supervision="sum"
        )(input_ids=input_ids)
    assert torch.equal(summed.logits, final.logits)


@pytest.mark.parametrize("supervision", ["sum", "all_streams"])
def test_cached_greedy_generation_equals_recomputation(supervision):
    model = prepared(hd_model(stream_supervision=supervision))
    input_ids = ids(2, 6, seed=5)
    cached = model.generate(input_ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(cached, model.generate(input_ids, max_new_tokens=8, do_sample=False, use_cache=False))
    with torch.no_grad():
        full = model(input_ids=cached).logits
    # Every generated token is the argmax of the full recomputation at the step before it.
    assert torch.equal(full[:, 5:-1].argmax(-1), cached[:, 6:])


def first_table_gradient(supervision: str, layout: list[str]) -> torch.Tensor:
    """Gradient of the first stream's embedding table, (V, D), after one loss under `supervision`."""
    model = hd_model(stream_supervision=supervision, stream_attention_layout=layout).train()
    input_ids = ids(2, 9)
    model(input_ids=input_ids, labels=labelled(input_ids)).loss.backward()
    return model.model.embed_tokens.weight.grad.view(VOCAB, 3, -1)[:, 0]


def test_the_first_streams_table_learns_directly_only_under_all_streams():
    """With intra layers only, no attention reaches across streams: "final" gives the first stream's table
    no gradient at all, "all_streams" gives it its own loss. With cross-stream layers both reach it."""
    assert torch.equal(first_table_gradient("final", ALL_INTRA), torch.zeros(VOCAB, BACKBONE["hidden_size"]))
    direct = first_table_gradient("all_streams", ALL_INTRA)
    assert direct.isfinite().all() and direct.abs().sum() > 0
    for supervision in ("final", "all_streams", "sum"):
        through_attention = first_table_gradient(supervision, ["intra", "local", "intra", "full"])
        assert through_attention.isfinite().all() and through_attention.abs().sum() > 0, supervision
