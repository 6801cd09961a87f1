"""Config fields of a baseline and a DLCM as plain specs (`BaselineSpec`, `DLCMSpec`), presets, and
reading them from a config.json or a preset name."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_concept.modeling.dlcm_stages import fill_stage_defaults

# model_type -> (q/k/v bias key or a constant, o_proj bias follows q/k/v, q/k norm), as conversion reads them.
_SOURCE_ATTENTION_RULES: dict[str, tuple[str | bool, bool, bool]] = {
    "llama": ("attention_bias", True, False),
    "qwen2": (True, False, False),
    "qwen3": ("attention_bias", True, True),
    "mistral": (False, False, False),
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_positive_ints(spec: Any, names: Iterable[str]) -> None:
    for name in names:
        value = getattr(spec, name)
        if not (_is_int(value) and value > 0):
            raise ValueError(f"{name}={value!r} must be a positive integer")


def _check_bools(spec: Any, names: Iterable[str]) -> None:
    for name in names:
        if not isinstance(getattr(spec, name), bool):
            raise ValueError(f"{name}={getattr(spec, name)!r} must be a bool")


def _check_heads(heads: int, kv_heads: int, heads_name: str, kv_name: str) -> None:
    if heads % kv_heads:
        raise ValueError(f"{kv_name}={kv_heads} must divide {heads_name}={heads}")


def _read_fields(cls: type, values: Mapping[str, Any], required: Sequence[str]) -> dict[str, Any]:
    """The dataclass's fields found in `values`; a missing required one is a ValueError naming it."""
    missing = [name for name in required if values.get(name) is None]
    if missing:
        raise ValueError(f"config has no {missing[0]!r} (needed: {', '.join(required)})")
    names = {item.name for item in dataclasses.fields(cls)}
    return {name: value for name, value in values.items() if name in names and value is not None}


def _attention_flags(values: Mapping[str, Any]) -> dict[str, bool]:
    """Bias and q/k-norm flags with each source family's meaning (as `conversion.sources` reads them)."""
    rule = _SOURCE_ATTENTION_RULES.get(values.get("model_type"))
    if rule is None:
        names = ("attention_bias", "attention_output_bias", "mlp_bias", "qk_norm")
        return {name: bool(values.get(name, False)) for name in names}
    qkv_source, output_follows, qk_norm = rule
    qkv_bias = bool(values.get(qkv_source, False)) if isinstance(qkv_source, str) else qkv_source
    return dict(
        attention_bias=qkv_bias,
        attention_output_bias=qkv_bias and output_follows,
        mlp_bias=bool(values.get("mlp_bias", False)),
        qk_norm=qk_norm,
    )


def _check_dense_full_attention(values: Mapping[str, Any]) -> None:
    """The planner counts dense MLPs and full causal attention; refuse configs that are neither."""
    for name in ("num_experts", "num_local_experts"):
        if values.get(name):
            raise ValueError(f"{name}={values[name]!r}: the planner handles dense models only")
    layer_types = values.get("layer_types")
    window = values.get("sliding_window")
    sliding = (
        "sliding_attention" in layer_types
        if isinstance(layer_types, list)
        else bool(window) and values.get("use_sliding_window", True) is not False
    )
    if sliding:
        raise ValueError(f"sliding_window={window!r}: the planner counts full attention only")


def _config_values(config: Any) -> dict[str, Any]:
    """A dict of a config object's fields (transformers configs through `to_dict`)."""
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    return dict(to_dict()) if callable(to_dict) else dict(vars(config))


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The dict in `path` (a config.json file, or a folder holding one)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"path={str(path)!r} is neither a config.json file nor a folder with one")
    try:
        values = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{file}: not valid JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(values).__name__}")
    return values


@dataclass
class BaselineSpec:
    """A dense Llama-style decoder: the fields of `PlainDecoderConfig` / `LlamaConfig` that set its cost.

    `num_key_value_heads` defaults to `num_attention_heads`, `head_dim` to hidden_size / heads.
    `attention_bias` biases q/k/v, `attention_output_bias` o_proj (PlainDecoderConfig's meaning).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_output_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and _is_int(self.hidden_size) and _is_int(self.num_attention_heads):
            self.head_dim = self.hidden_size // max(self.num_attention_heads, 1)
        _check_positive_ints(self, _BASELINE_SIZES)
        _check_heads(self.num_attention_heads, self.num_key_value_heads, *_HEAD_NAMES)
        _check_bools(self, _FLAGS)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> BaselineSpec:
        """From a config dict (a config.json's content); MoE and sliding-window configs are refused."""
        _check_dense_full_attention(values)
        fields = _read_fields(cls, values, _BASELINE_REQUIRED)
        fields.update(_attention_flags(values))
        fields.setdefault("tie_word_embeddings", False)
        return cls(**fields)

    @classmethod
    def from_config(cls, config: Any) -> BaselineSpec:
        """From a config object (`PlainDecoderConfig`, `LlamaConfig`, ...) or a dict."""
        return cls.from_dict(_config_values(config))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> BaselineSpec:
        """From a checkpoint folder's config.json, or a config.json file."""
        return cls.from_dict(read_config_json(path))


_BASELINE_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
)
_BASELINE_SIZES = (*_BASELINE_REQUIRED, "num_key_value_heads", "head_dim")
_HEAD_NAMES = ("num_attention_heads", "num_key_value_heads")
_FLAGS = ("tie_word_embeddings", "attention_bias", "attention_output_bias", "mlp_bias", "qk_norm")


@dataclass
class DLCMSpec:
    """A DLCM's cost-relevant fields, named and defaulted as in `DLCMConfig`.

    Token stages (encoder, decoder self-attention and MLPs) use the plain fields at d_token = hidden_size;
    the concept stage its `concept_*` fields at d_concept; the decoder's cross-attention its `cross_*`
    fields (Q from d_token, K/V from d_concept, a common head dim).
    """

    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    encoder_layers: int = 2
    concept_layers: int = 4
    decoder_layers: int = 2
    concept_hidden_size: int | None = None
    concept_num_attention_heads: int | None = None
    concept_num_key_value_heads: int | None = None
    concept_head_dim: int | None = None
    concept_intermediate_size: int | None = None
    decoder_intermediate_size: int | None = None
    cross_num_attention_heads: int | None = None
    cross_num_key_value_heads: int | None = None
    cross_head_dim: int | None = None
    compression_ratio: float = 4.0
    router: str = "cosine"
    smoothing: str = "ema"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_output_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        self._fill_defaults()
        _check_positive_ints(self, _DLCM_SIZES)
        _check_heads(self.num_attention_heads, self.num_key_value_heads, *_HEAD_NAMES)
        for prefix in ("concept", "cross"):
            names = (f"{prefix}_num_attention_heads", f"{prefix}_num_key_value_heads")
            _check_heads(getattr(self, names[0]), getattr(self, names[1]), *names)
        ratio = self.compression_ratio
        if not (isinstance(ratio, int | float) and not isinstance(ratio, bool) and ratio > 1):
            raise ValueError(f"compression_ratio={ratio!r} must be a number > 1")
        if self.router not in ("cosine", "rule"):
            raise ValueError(f"router={self.router!r} must be one of ('cosine', 'rule')")
        if self.smoothing not in ("ema", "linear"):
            raise ValueError(f"smoothing={self.smoothing!r} must be one of ('ema', 'linear')")
        _check_bools(self, _FLAGS)

    def _fill_defaults(self) -> None:
        """`DLCMConfig`'s derived defaults: its stage rules (shared code), then the plain parent's KV heads
        and head dim, in the same order."""
        fill_stage_defaults(self)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and _is_int(self.hidden_size) and _is_int(self.num_attention_heads):
            self.head_dim = self.hidden_size // max(self.num_attention_heads, 1)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DLCMSpec:
        """From a DLCM config dict (a config.json's content)."""
        _check_dense_full_attention(values)
        fields = _read_fields(cls, values, _DLCM_REQUIRED)
        fields.setdefault("tie_word_embeddings", False)
        # As DLCMConfig reads it: a saved config from before the field existed used the W_s form.
        if values.get("model_type") == "dlcm":
            fields.setdefault("smoothing", "linear")
        return cls(**fields)

    @classmethod
    def from_config(cls, config: Any) -> DLCMSpec:
        """From a `DLCMConfig` (or any object or dict with its fields)."""
        return cls.from_dict(_config_values(config))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> DLCMSpec:
        """From a DLCM checkpoint folder's config.json, or a config.json file."""
        return cls.from_dict(read_config_json(path))

    def to_dict(self) -> dict[str, Any]:
        """Keyword arguments for `DLCMConfig` (every field here is one of its fields)."""
        return dataclasses.asdict(self)


_DLCM_REQUIRED = ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size")
_DLCM_SIZES = (
    *_DLCM_REQUIRED,
    "num_key_value_heads",
    "head_dim",
    "encoder_layers",
    "concept_layers",
    "decoder_layers",
    "concept_hidden_size",
    "concept_num_attention_heads",
    "concept_num_key_value_heads",
    "concept_head_dim",
    "concept_intermediate_size",
    "decoder_intermediate_size",
    "cross_num_attention_heads",
    "cross_num_key_value_heads",
    "cross_head_dim",
)

# Table 3 of the paper. Baseline: LLaMA-1.3B (d 1536, 32 layers, 24 heads of dim 64, MLP 4096, vocab
# 128,815; untied, since tied embeddings would give 1.1B rather than 1.3B). DLCM 2.3B: d_token 1536,
# d_concept 3072, 10 / 16 / 6 layers, token heads 24 with 12 KV heads, backbone 48 heads with 24 KV heads
# (head dim 64 throughout). Table 3's MLP widths, "4,096 / 6,144 (Self)" and "– / 6,144 (Cross)", are read
# here as token MLPs at 4096 (DLCMConfig has one token MLP width) and concept MLPs at 6144; the
# cross-attention takes the token heads (24, 12 KV, dim 64). With the default ("ema", parameter-free)
# smoothing this gives 2.24B parameters and P = 0.608 (2.25B and 0.605 with a W_s); reading 6144 as the
# token MLP width instead gives 2.40B and P = 0.57.
PRESETS: dict[str, BaselineSpec] = {
    "dlcm-paper-baseline-1.3b": BaselineSpec(
        vocab_size=128815,
        hidden_size=1536,
        num_hidden_layers=32,
        num_attention_heads=24,
        num_key_value_heads=24,
        head_dim=64,
        intermediate_size=4096,
    ),
}
DLCM_PRESETS: dict[str, DLCMSpec] = {
    "dlcm-paper-2.3b": DLCMSpec(
        vocab_size=128815,
        hidden_size=1536,
        num_attention_heads=24,
        num_key_value_heads=12,
        head_dim=64,
        intermediate_size=4096,
        encoder_layers=10,
        concept_layers=16,
        decoder_layers=6,
        concept_hidden_size=3072,
        concept_num_attention_heads=48,
        concept_num_key_value_heads=24,
        concept_head_dim=64,
        concept_intermediate_size=6144,
        cross_num_attention_heads=24,
        cross_num_key_value_heads=12,
        cross_head_dim=64,
        compression_ratio=4.0,
    ),
}


def load_spec(source: str | Path) -> BaselineSpec | DLCMSpec:
    """A preset name, a config.json file or a checkpoint folder; model_type "dlcm" gives a `DLCMSpec`."""
    name = str(source)
    if name in PRESETS:
        return dataclasses.replace(PRESETS[name])
    if name in DLCM_PRESETS:
        return dataclasses.replace(DLCM_PRESETS[name])
    if not Path(name).exists():
        presets = ", ".join([*PRESETS, *DLCM_PRESETS])
        raise ValueError(f"{name!r} is neither a preset ({presets}) nor an existing path")
    values = read_config_json(name)
    if values.get("model_type") == "dlcm":
        return DLCMSpec.from_dict(values)
    return BaselineSpec.from_dict(values)
