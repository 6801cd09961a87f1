"""Conversion tools: read source checkpoints (Llama, Mistral, Qwen2/3, Mixtral, Qwen-MoE) into our models,
convert them (ConceptMoE, Hidden Decoding), and grow Hidden Decoding checkpoints.

These modules are tools, never loaded by a checkpoint; they may import `hf_concept.modeling`.
"""

from .conceptmoe import convert_to_conceptmoe
from .hidden_decoding import convert_to_hidden_decoding, expand_hidden_decoding
from .sources import (
    SUPPORTED_SOURCE_TYPES,
    iter_source_tensors,
    load_source_into_plain,
    plain_config_from_source,
    read_source_config,
    source_key_to_plain,
)

__all__ = [
    "SUPPORTED_SOURCE_TYPES",
    "convert_to_conceptmoe",
    "convert_to_hidden_decoding",
    "expand_hidden_decoding",
    "iter_source_tensors",
    "load_source_into_plain",
    "plain_config_from_source",
    "read_source_config",
    "source_key_to_plain",
]
