"""Every family's model survives `copy.deepcopy` (what TRL does to make a reference model) and pickling,
and the copy computes the original's logits while training the copy leaves the original alone."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from tests.conformance.families import FAMILIES

SPECS = {spec.name: spec for spec in FAMILIES}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_deep_copy_computes_the_same_logits_and_owns_its_weights(name):
    spec = SPECS[name]
    torch.manual_seed(0)
    model = spec.model_class()(spec.make_config()).eval()
    input_ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    copied = copy.deepcopy(model)
    restored = pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
        assert torch.equal(copied(input_ids=input_ids).logits, expected)
        assert torch.equal(restored(input_ids=input_ids).logits, expected)
        next(copied.parameters()).add_(1.0)
        assert torch.equal(model(input_ids=input_ids).logits, expected)
