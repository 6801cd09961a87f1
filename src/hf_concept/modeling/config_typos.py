"""Unknown config keyword arguments that look like a misspelt field, for every family config.

transformers' configs accept any keyword argument and keep an unknown one as a plain attribute that no
model reads, so `ConceptMoEConfig(compresion_ratio=4.0)` would silently keep the default ratio.
`warn_misspelt_keys` warns about each unknown key whose spelling is close to one of the config's own
fields, naming both. Keys transformers itself writes or reads are never unknown. A saved config
(`from_dict`, which `from_pretrained` goes through) is not checked: its keys were written by a program,
and a file written by another version or tool must load quietly; keyword overrides given to
`from_pretrained` are checked like constructor arguments.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import functools
from collections.abc import Iterator, Mapping
from typing import Any

from transformers import GenerationConfig
from transformers.utils import logging

logger = logging.get_logger(__name__)

# difflib's similarity ratio: a dropped, doubled or swapped letter in a name of ten letters or more
# scores 0.9 or more (compresion_ratio: 0.97); two different words sharing a suffix score less
# (num_local_experts / num_experts: 0.79).
CLOSENESS = 0.8

# Keys transformers reads from a config's keyword arguments or writes into config.json besides the
# dataclass fields (PreTrainedConfig.__post_init__, from_dict, to_dict), and v4 base-config attributes that
# older files still carry. Generation keys and keys starting with "_" are added below.
TRANSFORMERS_KEYS = frozenset(
    {
        "add_cross_attention",
        "architectures",
        "attn_implementation",
        "auto_map",
        "base_model_tp_plan",
        "cross_attention_hidden_size",
        "custom_pipelines",
        "decoder_start_token_id",
        "dtype",
        "experts_implementation",
        "finetuning_task",
        "is_decoder",
        "model_type",
        "name_or_path",
        "num_labels",
        "output_attentions",
        "partial_rotary_factor",
        "per_layer_config",
        "prefix",
        "pruned_heads",
        "quantization_config",
        "rope_parameters",
        "sep_token_id",
        "task_specific_params",
        "tf_legacy_loss",
        "tie_encoder_decoder",
        "tokenizer_class",
        "torch_dtype",
        "torchscript",
        "transformers_version",
        "use_bfloat16",
        "use_return_dict",
    }
)

_loading_saved_config: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "hf_concept_loading_saved_config", default=False
)


@functools.cache
def _generation_keys() -> frozenset[str]:
    """Every generation setting transformers knows (v4 kept them in the model config)."""
    return frozenset(GenerationConfig().to_dict())


@contextlib.contextmanager
def loading_saved_config() -> Iterator[None]:
    """Within this block configs are being rebuilt from a saved dict: their keys are not checked."""
    token = _loading_saved_config.set(True)
    try:
        yield
    finally:
        _loading_saved_config.reset(token)


@functools.cache
def known_keys(config_class: type) -> frozenset[str]:
    """The config's own parameter names (its dataclass fields, transformers' base fields included) and
    the names in its `attribute_map`."""
    names = {field.name for field in dataclasses.fields(config_class)}
    return frozenset(names | set(getattr(config_class, "attribute_map", {})))


def misspelt_keys(config_class: type, kwargs: Mapping[str, Any]) -> dict[str, str]:
    """{unknown key: the field it resembles} for the keys of `kwargs` that are neither fields nor
    transformers' own keys but spell close to a field."""
    fields = known_keys(config_class)
    found = {}
    for key in kwargs:
        ignored = key in fields or key in TRANSFORMERS_KEYS or key in _generation_keys()
        if ignored or not isinstance(key, str) or key.startswith("_"):
            continue
        match = difflib.get_close_matches(key, sorted(fields), n=1, cutoff=CLOSENESS)
        if match:
            found[key] = match[0]
    return found


def warn_misspelt_keys(config_class: type, kwargs: Mapping[str, Any]) -> None:
    """Warn once per unknown keyword argument that looks like a misspelt field (not while loading a
    saved config)."""
    if _loading_saved_config.get():
        return
    for key, field in misspelt_keys(config_class, kwargs).items():
        logger.warning(
            f"{config_class.__name__} got an unknown keyword argument {key}={kwargs[key]!r}, which no model "
            f"reads (it is kept as a plain attribute); did you mean {field}?"
        )
