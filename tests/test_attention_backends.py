"""What docs/attention.md says about attention backends holds: every family builds with eager and sdpa, and
refuses flash_attention_2 by name when the model is built (their layouts have no flash path that has run)."""

from __future__ import annotations

import pytest

from tests.conformance import families

FAMILIES = {
    "conceptmoe": (families._conceptmoe_class, families._conceptmoe_config),
    "dlcm": (families._dlcm_class, families._dlcm_config),
    "hidden_decoding": (families._hidden_decoding_class, families._hidden_decoding_config),
    "lslm": (families._lslm_class, families._lslm_config),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_eager_and_sdpa_build_and_flash_attention_is_refused_by_name(family):
    model_class, make_config = (
        maker() if index == 0 else maker for index, maker in enumerate(FAMILIES[family])
    )
    for implementation in ("eager", "sdpa"):
        model = model_class._from_config(make_config(), attn_implementation=implementation)
        assert model.config._attn_implementation == implementation
    with pytest.raises(ValueError, match="does not support Flash Attention 2"):
        model_class._from_config(make_config(), attn_implementation="flash_attention_2")
