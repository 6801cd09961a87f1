"""hf_concept: concept-level and multi-stream language models for the Hugging Face stack."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public names and the model-folder module that defines each; imported on first use so that
# `import hf_concept` does not import torch.
_LAZY_EXPORTS = {
    "ConceptMoEConfig": "hf_concept.modeling.configuration_conceptmoe",
    "ConceptMoEModel": "hf_concept.modeling.modeling_conceptmoe",
    "ConceptMoEForCausalLM": "hf_concept.modeling.modeling_conceptmoe",
    "ConceptCache": "hf_concept.modeling.concept_cache",
    "DLCMConfig": "hf_concept.modeling.configuration_dlcm",
    "DLCMModel": "hf_concept.modeling.modeling_dlcm",
    "DLCMForCausalLM": "hf_concept.modeling.modeling_dlcm",
    "HiddenDecodingConfig": "hf_concept.modeling.configuration_hidden_decoding",
    "HiddenDecodingModel": "hf_concept.modeling.modeling_hidden_decoding",
    "HiddenDecodingForCausalLM": "hf_concept.modeling.modeling_hidden_decoding",
    "StreamCache": "hf_concept.modeling.hidden_decoding_cache",
    "LSLMConfig": "hf_concept.modeling.configuration_lslm",
    "LSLMModel": "hf_concept.modeling.modeling_lslm",
    "LSLMForCausalLM": "hf_concept.modeling.modeling_lslm",
    "SegmentCache": "hf_concept.modeling.lslm_segment_cache",
    "ByteTokenizer": "hf_concept.modeling.tokenization_lslm",
}

__all__ = ["__version__", *_LAZY_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _LAZY_EXPORTS:
        return getattr(importlib.import_module(_LAZY_EXPORTS[name]), name)
    raise AttributeError(f"module 'hf_concept' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_EXPORTS))
