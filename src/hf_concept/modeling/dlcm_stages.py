"""DLCM's derived stage defaults in one place: the config and the planner (`hf_concept.planning`, which
does not import torch) both fill their missing fields with `fill_stage_defaults`, so the two cannot
disagree about the shape a partial description means. Plain Python, no imports.
"""

from __future__ import annotations

from typing import Any


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def fill_stage_defaults(spec: Any) -> None:
    """Fill, in place on a config or spec object, each DLCM stage field that is None:

    - concept stage: width d_token, heads of the token stage, KV heads = its heads, head dim = width /
      heads, MLP width scaled from the token MLP by d_concept / d_token;
    - decoder MLP width: the token stage's;
    - cross-attention: the token stage's heads and KV heads (its heads when those are unset), head dim of
      the token stage (d_token / heads when unset).
    """
    if spec.concept_hidden_size is None:
        spec.concept_hidden_size = spec.hidden_size
    if spec.concept_num_attention_heads is None:
        spec.concept_num_attention_heads = spec.num_attention_heads
    if spec.concept_num_key_value_heads is None:
        spec.concept_num_key_value_heads = spec.concept_num_attention_heads
    width, heads = spec.concept_hidden_size, spec.concept_num_attention_heads
    if spec.concept_head_dim is None and _is_positive_int(width) and _is_positive_int(heads):
        spec.concept_head_dim = width // heads
    if spec.concept_intermediate_size is None and all(
        _is_positive_int(value) for value in (spec.intermediate_size, width, spec.hidden_size)
    ):
        spec.concept_intermediate_size = spec.intermediate_size * width // spec.hidden_size
    if spec.decoder_intermediate_size is None:
        spec.decoder_intermediate_size = spec.intermediate_size
    if spec.cross_num_attention_heads is None:
        spec.cross_num_attention_heads = spec.num_attention_heads
    if spec.cross_num_key_value_heads is None:
        spec.cross_num_key_value_heads = spec.num_key_value_heads or spec.cross_num_attention_heads
    if spec.cross_head_dim is None:
        heads = spec.num_attention_heads
        if spec.head_dim is not None:
            spec.cross_head_dim = spec.head_dim
        elif _is_positive_int(spec.hidden_size) and _is_positive_int(heads):
            spec.cross_head_dim = spec.hidden_size // heads
