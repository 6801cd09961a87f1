"""A training forward whose loss the model does not assemble: TRL's SFTTrainer calls
the backbone under its fused LM head, `Trainer` with `compute_loss_func` or label smoothing calls the
causal LM without labels. The family's extra terms (ConceptMoE/DLCM ratio loss, LSLM prior term, Hidden
Decoding's other streams under "all_streams" supervision) are
then not optimised, and the model says so once; a forward that assembles its own loss, and any
gradient-free one, says nothing. (`test_ratio_scopes.py` runs the real SFTTrainer.)"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.conformance.families import (
    _conceptmoe_class,
    _conceptmoe_config,
    _dlcm_class,
    _dlcm_config,
    _hidden_decoding_class,
    _hidden_decoding_config,
    _lslm_class,
    _lslm_config,
)

FAMILIES = {
    "conceptmoe": (_conceptmoe_class, _conceptmoe_config, "the ratio loss (aux_loss_weight="),
    "dlcm": (_dlcm_class, _dlcm_config, "the ratio loss (aux_loss_weight="),
    "lslm": (_lslm_class, _lslm_config, "the beta_binomial prior term (kl_weight="),
    "hidden_decoding": (
        _hidden_decoding_class,
        lambda **overrides: _hidden_decoding_config(**{"stream_supervision": "all_streams", **overrides}),
        "the other streams' cross-entropy (stream_supervision='all_streams')",
    ),
}


def build(family: str, **overrides):
    class_of, make_config, _ = FAMILIES[family]
    torch.manual_seed(0)
    return class_of()(make_config(**overrides)).train()


def dropped(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if "not in the loss" in record.getMessage()]


def ids() -> torch.Tensor:
    return torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_backbone_trained_directly_warns_once_naming_the_dropped_term(family, caplog):
    model = build(family)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            model.model(input_ids=ids())
    (message,) = dropped(caplog)
    assert FAMILIES[family][2] in message and "ConceptSFTTrainer" in message


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_causal_lm_without_labels_warns_and_with_labels_does_not(family, caplog):
    model = build(family)
    input_ids = ids()
    with caplog.at_level(logging.WARNING):
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        with torch.no_grad():
            model(input_ids=input_ids)
            model.model(input_ids=input_ids)
        model.eval()
        model(input_ids=input_ids)
        assert dropped(caplog) == []
        model.train()
        model(input_ids=input_ids)
    assert len(dropped(caplog)) == 1


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("conceptmoe", dict(chunking="fixed")),
        ("dlcm", dict(aux_loss_weight=0.0)),
        ("lslm", dict(kl_weight=0.0)),
        ("hidden_decoding", dict(stream_supervision="final")),
        ("hidden_decoding", dict(stream_supervision="sum")),
    ],
)
def test_nothing_is_said_when_the_family_has_no_extra_term(family, overrides, caplog):
    model = build(family, **overrides)
    with caplog.at_level(logging.WARNING):
        model(input_ids=ids())
    assert dropped(caplog) == []
