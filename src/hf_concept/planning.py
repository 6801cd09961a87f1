"""FLOPs, parameter and KV-cache planner: a DLCM against a Llama-style baseline (paper §6.3, Table 3).

Pure arithmetic on config fields (no torch): parameters, training and inference FLOPs per token and KV-cache
bytes per token for a dense baseline (`BaselineSpec`) and a DLCM (`DLCMSpec`, the fields of `DLCMConfig`),
and `search_dlcm`, which looks for DLCM shapes whose inference FLOPs per token match the baseline's at a
compression ratio R and a concept share P.

Counting conventions (every figure follows them):
- FLOPs: a multiply-add is 2 FLOPs, and only matrix products count: a weight matrix with n entries costs 2·n
  FLOPs per row it multiplies. Norms, activations, softmax, RoPE, bias adds, the router's cosine and
  pooling's mean are left out (O(D) per token each). The embedding lookup is free; the LM head counts.
- Attention map: one query head of dim K against one key costs 2·K (Q·Kᵀ) + 2·K (weights·V) = 4·K FLOPs.
- Inference FLOPs per token: one decoding step at context length L (`context_length`). A self-attention
  layer reads L keys. DLCM's concept stage (W_up on the pooled mean, the concept layers, smoothing and the
  decoder's cross-attention K/V projections) runs once per concept, i.e. 1/R of a run per token, and a
  concept layer reads M = L/R concepts. The decoder's cross-attention reads the counted form: M = L/R
  concept keys (one K/V per concept with its log-count bias, DESIGN §4), not L replicated keys. "Without
  attention map" drops every per-key term.
- Training FLOPs per token: 3 × the forward (backward ≈ 2 × forward) over a causal sequence of L tokens, so a
  query reads (L + 1)/2 keys on average, a concept (M + 1)/2 concepts. The cross-attention is counted in the
  replicated form the training kernel runs (`cross_attention="replicated"`: concept K/V repeated to the L
  token positions, (L + 1)/2 keys per query) or in the counted form (`"counted"`: (M + 1)/2 keys).
- Parameters: every tensor of the model, norms, biases and the null concept included. Embedding parameters
  are the input embedding plus the LM head when it is not tied; non-embedding parameters are the rest.
- Concept share P follows the paper: eq. 22 splits the total parameter count N into N·P for the concept
  model and N·(1 − P) for the rest, so P = (concept layers + concept norm) / total parameters, embeddings
  in the denominator. Table 3's DLCM (`DLCM_PRESETS["dlcm-paper-2.3b"]`) gives P ≈ 0.60, the paper's
  "P = 60%"; its share of the non-embedding parameters would be ≈ 0.73 (`concept_share(spec, of=...)`).
- KV-cache bytes per token: K and V of every token-level self-attention layer per token, plus the concept
  layers' K/V and the decoder's cross-attention K/V once per concept (÷ R per token); `dtype_bytes` per entry.
  `ConceptCache.num_bytes()` also holds per-concept counts and slots and per-row chunk state, left out here.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_concept.modeling.dlcm_stages import fill_stage_defaults

CROSS_ATTENTION_FORMS = ("replicated", "counted")
SHARE_DENOMINATORS = ("total", "non_embedding")
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
    """A DLCM's cost-relevant fields, named and defaulted as in `DLCMConfig` (DESIGN §4).

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


# ---- parameters ----


def _attention_parameters(width: int, heads: int, kv_heads: int, head_dim: int, spec: Any) -> int:
    """q/k/v/o projections of one self-attention, with the spec's biases and q/k norms."""
    query, key_value = heads * head_dim, kv_heads * head_dim
    count = width * query + 2 * width * key_value + query * width
    if spec.attention_bias:
        count += query + 2 * key_value
    if spec.attention_output_bias:
        count += width
    if spec.qk_norm:
        count += 2 * head_dim
    return count


def _layer_parameters(
    width: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, spec: Any
) -> int:
    """One decoder layer: attention, gated MLP (gate, up, down) and its two RMSNorms."""
    mlp = 3 * width * intermediate + (2 * intermediate + width if spec.mlp_bias else 0)
    return _attention_parameters(width, heads, kv_heads, head_dim, spec) + mlp + 2 * width


def _cross_attention_parameters(spec: DLCMSpec) -> int:
    """Q (d_token -> Hx·Kx), K/V (d_concept -> Gx·Kx), q/k RMSNorm over Kx, O, and the layer's norm."""
    query = spec.cross_num_attention_heads * spec.cross_head_dim
    key_value = spec.cross_num_key_value_heads * spec.cross_head_dim
    projections = 2 * spec.hidden_size * query + 2 * spec.concept_hidden_size * key_value
    return projections + 2 * spec.cross_head_dim + spec.hidden_size


def _token_layer(spec: BaselineSpec | DLCMSpec, intermediate: int | None = None) -> int:
    return _layer_parameters(
        spec.hidden_size,
        spec.num_attention_heads,
        spec.num_key_value_heads,
        spec.head_dim,
        spec.intermediate_size if intermediate is None else intermediate,
        spec,
    )


def _concept_layer(spec: DLCMSpec) -> int:
    return _layer_parameters(
        spec.concept_hidden_size,
        spec.concept_num_attention_heads,
        spec.concept_num_key_value_heads,
        spec.concept_head_dim,
        spec.concept_intermediate_size,
        spec,
    )


def parameter_groups(spec: BaselineSpec | DLCMSpec) -> dict[str, int]:
    """Parameter count per top-level module (the state-dict prefixes of the model)."""
    embedding = spec.vocab_size * spec.hidden_size
    lm_head = 0 if spec.tie_word_embeddings else embedding
    if isinstance(spec, BaselineSpec):
        layers = spec.num_hidden_layers * _token_layer(spec)
        return {
            "model.embed_tokens": embedding,
            "model.layers": layers,
            "model.norm": spec.hidden_size,
            "lm_head": lm_head,
        }
    width, concept_width = spec.hidden_size, spec.concept_hidden_size
    return {
        "model.embed_tokens": embedding,
        "model.encoder_layers": spec.encoder_layers * _token_layer(spec),
        "model.chunker": 2 * width * width if spec.router == "cosine" else 0,
        "model.concept_in_proj": concept_width * width,
        "model.null_concept": concept_width,
        "model.concept_layers": spec.concept_layers * _concept_layer(spec),
        "model.concept_norm": concept_width,
        "model.smoothing": concept_width * concept_width if spec.smoothing == "linear" else 0,
        "model.decoder_layers": spec.decoder_layers
        * (_token_layer(spec, spec.decoder_intermediate_size) + _cross_attention_parameters(spec)),
        "model.norm": width,
        "lm_head": lm_head,
    }


def parameter_count(spec: BaselineSpec | DLCMSpec, *, exclude_embeddings: bool = False) -> int:
    """Total parameters; `exclude_embeddings` drops the input embedding and an untied LM head."""
    groups = parameter_groups(spec)
    if exclude_embeddings:
        return sum(groups.values()) - groups["model.embed_tokens"] - groups["lm_head"]
    return sum(groups.values())


def concept_share(spec: DLCMSpec, *, of: str = "total") -> float:
    """P: the concept model's (concept layers + concept norm) share of all parameters, the paper's eq. 22
    reading (`of="total"`), or of the non-embedding parameters (`of="non_embedding"`)."""
    if of not in SHARE_DENOMINATORS:
        raise ValueError(f"of={of!r} must be one of {SHARE_DENOMINATORS}")
    groups = parameter_groups(spec)
    concept = groups["model.concept_layers"] + groups["model.concept_norm"]
    return concept / parameter_count(spec, exclude_embeddings=of == "non_embedding")


# ---- FLOPs and KV cache ----


@dataclass(frozen=True)
class Stage:
    """A group of identical work: `runs_per_token` runs, each multiplying by `matmul_weights` weight entries
    and, per query, reading `decode_keys` keys when decoding or `training_keys` on average in training,
    over `attention_width` = Σ over its layers of query heads × head dim; each run caches `kv_entries`."""

    name: str
    runs_per_token: float
    matmul_weights: int
    attention_width: int = 0
    decode_keys: float = 0.0
    training_keys: float = 0.0
    kv_entries: int = 0


def _check_context(context_length: Any) -> None:
    if not (_is_int(context_length) and context_length > 0):
        raise ValueError(f"context_length={context_length!r} must be a positive integer")


def _attention_matmul_weights(width: int, heads: int, kv_heads: int, head_dim: int) -> int:
    return 2 * width * heads * head_dim + 2 * width * kv_heads * head_dim


def _token_stage(
    spec: BaselineSpec | DLCMSpec,
    name: str,
    layers: int,
    context_length: int,
    intermediate: int | None = None,
) -> Stage:
    """`layers` plain layers at d_token: self-attention over the tokens and a gated MLP."""
    width, head_dim = spec.hidden_size, spec.head_dim
    intermediate = spec.intermediate_size if intermediate is None else intermediate
    weights = _attention_matmul_weights(width, spec.num_attention_heads, spec.num_key_value_heads, head_dim)
    return Stage(
        name=name,
        runs_per_token=1.0,
        matmul_weights=layers * (weights + 3 * width * intermediate),
        attention_width=layers * spec.num_attention_heads * head_dim,
        decode_keys=float(context_length),
        training_keys=(context_length + 1) / 2,
        kv_entries=layers * 2 * spec.num_key_value_heads * head_dim,
    )


def _concept_stage(spec: DLCMSpec, concepts: float) -> Stage:
    """The concept layers at d_concept: one run per concept, self-attention over the concepts."""
    width, heads, head_dim = spec.concept_hidden_size, spec.concept_num_attention_heads, spec.concept_head_dim
    attention = _attention_matmul_weights(width, heads, spec.concept_num_key_value_heads, head_dim)
    return Stage(
        name="concept_layers",
        runs_per_token=1.0 / spec.compression_ratio,
        matmul_weights=spec.concept_layers * (attention + 3 * width * spec.concept_intermediate_size),
        attention_width=spec.concept_layers * heads * head_dim,
        decode_keys=concepts,
        training_keys=(concepts + 1) / 2,
        kv_entries=spec.concept_layers * 2 * spec.concept_num_key_value_heads * head_dim,
    )


def _dlcm_stages(spec: DLCMSpec, context_length: int, cross_attention: str) -> list[Stage]:
    per_concept = 1.0 / spec.compression_ratio
    concepts = context_length / spec.compression_ratio
    width, concept_width, decoders = spec.hidden_size, spec.concept_hidden_size, spec.decoder_layers
    cross_query = spec.cross_num_attention_heads * spec.cross_head_dim
    cross_key_value = spec.cross_num_key_value_heads * spec.cross_head_dim
    replicated = cross_attention == "replicated"
    return [
        _token_stage(spec, "encoder", spec.encoder_layers, context_length),
        Stage("router", 1.0, 2 * width * width if spec.router == "cosine" else 0),
        Stage("concept_in_proj", per_concept, concept_width * width),
        _concept_stage(spec, concepts),
        # "ema" smoothing is elementwise (not counted, as norms are); "linear" multiplies W_s.
        Stage("smoothing", per_concept, concept_width * concept_width if spec.smoothing == "linear" else 0),
        Stage(
            name="cross_key_value",
            runs_per_token=per_concept,
            matmul_weights=decoders * 2 * concept_width * cross_key_value,
            kv_entries=decoders * 2 * cross_key_value,
        ),
        _token_stage(spec, "decoder_self", decoders, context_length, spec.decoder_intermediate_size),
        Stage(
            name="decoder_cross",
            runs_per_token=1.0,
            matmul_weights=decoders * 2 * width * cross_query,
            attention_width=decoders * cross_query,
            decode_keys=concepts,
            training_keys=(context_length + 1) / 2 if replicated else (concepts + 1) / 2,
        ),
    ]


def cost_stages(
    spec: BaselineSpec | DLCMSpec, context_length: int = 4096, cross_attention: str = "replicated"
) -> list[Stage]:
    """The model's work as `Stage`s, for a context of `context_length` tokens (module docstring)."""
    _check_context(context_length)
    if cross_attention not in CROSS_ATTENTION_FORMS:
        raise ValueError(f"cross_attention={cross_attention!r} must be one of {CROSS_ATTENTION_FORMS}")
    lm_head = Stage("lm_head", 1.0, spec.vocab_size * spec.hidden_size)
    if isinstance(spec, BaselineSpec):
        return [_token_stage(spec, "layers", spec.num_hidden_layers, context_length), lm_head]
    return [*_dlcm_stages(spec, context_length, cross_attention), lm_head]


def inference_flops_per_token(
    spec: BaselineSpec | DLCMSpec, context_length: int = 4096, *, include_attention: bool = True
) -> float:
    """FLOPs of one decoding step at `context_length` (attention map over the keys included or not)."""
    total = 0.0
    for stage in cost_stages(spec, context_length):
        keys = stage.decode_keys if include_attention else 0.0
        total += stage.runs_per_token * (2 * stage.matmul_weights + 4 * stage.attention_width * keys)
    return total


def training_flops_per_token(
    spec: BaselineSpec | DLCMSpec, context_length: int = 4096, *, cross_attention: str = "replicated"
) -> float:
    """Forward + backward FLOPs per token (3 × forward) over causal sequences of `context_length` tokens."""
    total = 0.0
    for stage in cost_stages(spec, context_length, cross_attention):
        total += stage.runs_per_token * (
            2 * stage.matmul_weights + 4 * stage.attention_width * stage.training_keys
        )
    return 3 * total


def kv_cache_bytes_per_token(spec: BaselineSpec | DLCMSpec, dtype_bytes: int = 2) -> float:
    """Cache bytes each token adds: token layers' K/V per token, concept and cross K/V per concept (÷ R)."""
    if not (_is_int(dtype_bytes) and dtype_bytes > 0):
        raise ValueError(f"dtype_bytes={dtype_bytes!r} must be a positive integer")
    entries = sum(stage.runs_per_token * stage.kv_entries for stage in cost_stages(spec, 1))
    return dtype_bytes * entries


@dataclass(frozen=True)
class CostReport:
    """Every figure the planner prints for one model (module docstring for the conventions)."""

    parameters: int
    non_embedding_parameters: int
    concept_share: float | None
    training_flops_per_token: float
    inference_flops_per_token: float
    inference_flops_per_token_without_attention: float
    kv_cache_bytes_per_token: float


def cost_report(
    spec: BaselineSpec | DLCMSpec,
    context_length: int = 4096,
    dtype_bytes: int = 2,
    cross_attention: str = "replicated",
) -> CostReport:
    return CostReport(
        parameters=parameter_count(spec),
        non_embedding_parameters=parameter_count(spec, exclude_embeddings=True),
        concept_share=concept_share(spec) if isinstance(spec, DLCMSpec) else None,
        training_flops_per_token=training_flops_per_token(
            spec, context_length, cross_attention=cross_attention
        ),
        inference_flops_per_token=inference_flops_per_token(spec, context_length),
        inference_flops_per_token_without_attention=inference_flops_per_token(
            spec, context_length, include_attention=False
        ),
        kv_cache_bytes_per_token=kv_cache_bytes_per_token(spec, dtype_bytes),
    )


# ---- search ----


@dataclass(frozen=True)
class Candidate:
    """A DLCM found by `search_dlcm`; `flops_error` = its matched FLOPs / the baseline's − 1."""

    spec: DLCMSpec
    flops_error: float
    concept_share: float


def _nearest_divisor(count: int, target: float) -> int:
    """The divisor of `count` nearest to `target` (the smaller one on a tie): KV heads for a GQA group."""
    divisors = [value for value in range(1, count + 1) if count % value == 0]
    return min(divisors, key=lambda value: (abs(value - target), value))


def _scaled_width(size: int, base_width: int, width: int) -> int:
    """`size` scaled by width / base_width, rounded to a multiple of 64 (at least 64)."""
    return max(64, round(size * width / base_width / 64) * 64)


def dlcm_like(
    baseline: BaselineSpec,
    token_width: int,
    concept_width: int,
    layers: tuple[int, int, int],
    compression_ratio: float,
) -> DLCMSpec:
    """A DLCM at the given widths and (encoder, concept, decoder) layers, otherwise shaped like `baseline`:
    its head dim everywhere, heads in proportion to width, its GQA group, MLP widths in its ratio to width,
    cross-attention with the token heads, untied or tied as the baseline."""
    head_dim = baseline.head_dim
    group = baseline.num_attention_heads / baseline.num_key_value_heads
    heads = max(1, round(baseline.num_attention_heads * token_width / baseline.hidden_size))
    concept_heads = max(1, round(baseline.num_attention_heads * concept_width / baseline.hidden_size))
    kv_heads = _nearest_divisor(heads, heads / group)
    base_mlp, base_width = baseline.intermediate_size, baseline.hidden_size
    return DLCMSpec(
        vocab_size=baseline.vocab_size,
        hidden_size=token_width,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_scaled_width(base_mlp, base_width, token_width),
        encoder_layers=layers[0],
        concept_layers=layers[1],
        decoder_layers=layers[2],
        concept_hidden_size=concept_width,
        concept_num_attention_heads=concept_heads,
        concept_num_key_value_heads=_nearest_divisor(concept_heads, concept_heads / group),
        concept_head_dim=head_dim,
        concept_intermediate_size=_scaled_width(base_mlp, base_width, concept_width),
        cross_num_attention_heads=heads,
        cross_num_key_value_heads=kv_heads,
        cross_head_dim=head_dim,
        compression_ratio=compression_ratio,
        tie_word_embeddings=baseline.tie_word_embeddings,
        attention_bias=baseline.attention_bias,
        attention_output_bias=baseline.attention_output_bias,
        mlp_bias=baseline.mlp_bias,
        qk_norm=baseline.qk_norm,
    )


@dataclass(frozen=True)
class _LinearCosts:
    """A figure as base + Σ count × per-layer for (encoder, concept, decoder) layer counts: every figure
    here is linear in the layer counts, the other fields fixed."""

    base: float
    per_layer: tuple[float, float, float]

    def at(self, layers: tuple[int, int, int]) -> float:
        return self.base + sum(count * cost for count, cost in zip(layers, self.per_layer, strict=True))


def _linear_costs(measure: Any, build: Any) -> _LinearCosts:
    """Fit base and per-layer costs of `measure(build(layers))` from four layer splits."""
    ones = measure(build((1, 1, 1)))
    steps = [
        measure(build(tuple(2 if axis == index else 1 for axis in range(3)))) - ones for index in range(3)
    ]
    return _LinearCosts(ones - sum(steps), (steps[0], steps[1], steps[2]))


def _width_pair_matches(
    build: Any, target: float, measure: Any, bounds: tuple[float, float, float, int, int]
) -> list[tuple[float, float, tuple[int, int, int]]]:
    """(flops error, share, layers) of every layer split at one width pair within the tolerances; the
    concept layer count is solved for (FLOPs are linear in it), rounded both ways and kept in the grid."""
    low, high, tolerance, max_token_layers, max_concept_layers = bounds
    flops = _linear_costs(measure, build)
    total = _linear_costs(parameter_count, build)
    concept = _linear_costs(lambda spec: parameter_groups(spec)["model.concept_layers"], build)
    concept_norm = build((1, 1, 1)).concept_hidden_size
    found = []
    for encoders in range(1, max_token_layers + 1):
        for decoders in range(1, max_token_layers + 1):
            rest = flops.at((encoders, 0, decoders))
            ideal = (target - rest) / flops.per_layer[1]
            # The nearest counts inside the grid: FLOPs are monotone in the count, so clamping is exact.
            nearest = {min(max(rounded(ideal), 1), max_concept_layers) for rounded in (math.floor, math.ceil)}
            for concepts in nearest:
                layers = (encoders, concepts, decoders)
                error = flops.at(layers) / target - 1
                share = (concept.at(layers) + concept_norm) / total.at(layers)
                if abs(error) <= tolerance and low <= share <= high:
                    found.append((error, share, layers))
    return found


def search_dlcm(
    baseline: BaselineSpec,
    compression_ratio: float,
    target_share: float | tuple[float, float],
    *,
    share_tolerance: float = 0.05,
    context_length: int = 4096,
    flops_tolerance: float = 0.05,
    include_attention: bool = True,
    token_widths: Sequence[int] | None = None,
    concept_widths: Sequence[int] | None = None,
    max_token_layers: int | None = None,
    max_concept_layers: int | None = None,
    top_k: int = 10,
) -> list[Candidate]:
    """DLCMs shaped by `dlcm_like` whose inference FLOPs per token (attention map at `context_length`
    included or not) are within `flops_tolerance` of the baseline's and whose concept share P lies in
    `target_share` (a (low, high) range, or a value ± `share_tolerance`); best first: closest FLOPs (in
    steps of a tenth of the tolerance), then P closest to the middle of the range.

    Grids (defaults): token widths from hidden_size/2 to hidden_size in steps of 128 (head_dim if larger,
    hidden_size/8 if smaller); concept widths from the token width to 4 × hidden_size in the same steps;
    encoder and decoder layers from 1 to num_hidden_layers/2 each; concept layers from 1 to
    2 × num_hidden_layers.
    """
    low, high = _share_range(target_share, share_tolerance)
    _check_search_numbers(compression_ratio, flops_tolerance, top_k)
    step = max(baseline.head_dim, min(128, baseline.hidden_size // 8))
    hidden, depth = baseline.hidden_size, baseline.num_hidden_layers
    token_widths = token_widths or range(max(step, (hidden // 2) // step * step), hidden + 1, step)
    max_token_layers = max_token_layers or max(1, depth // 2)
    max_concept_layers = max_concept_layers or 2 * depth
    _check_positive_ints_named(
        {"max_token_layers": max_token_layers, "max_concept_layers": max_concept_layers}
    )

    def measure(spec: DLCMSpec | BaselineSpec) -> float:
        return inference_flops_per_token(spec, context_length, include_attention=include_attention)

    target, middle = measure(baseline), (low + high) / 2
    # FLOPs errors within a tenth of the tolerance rank as equal, so that P decides between them.
    bucket = flops_tolerance / 10 or 1e-12
    bounds = (low, high, flops_tolerance, max_token_layers, max_concept_layers)
    ranked: list[tuple[int, float, int, int, tuple[int, int, int], float, float]] = []
    for token_width in token_widths:
        widths = concept_widths or range(token_width, 4 * hidden + 1, step)
        for concept_width in widths:
            _check_positive_ints_named({"token width": token_width, "concept width": concept_width})

            def build(
                layers: tuple[int, int, int], pair: tuple[int, int] = (token_width, concept_width)
            ) -> DLCMSpec:
                return dlcm_like(baseline, pair[0], pair[1], layers, compression_ratio)

            for error, share, layers in _width_pair_matches(build, target, measure, bounds):
                rank = (math.floor(abs(error) / bucket), abs(share - middle))
                ranked.append((*rank, token_width, concept_width, layers, error, share))
    best = heapq.nsmallest(top_k, ranked)
    return [
        Candidate(dlcm_like(baseline, item[2], item[3], item[4], compression_ratio), item[5], item[6])
        for item in best
    ]


def _share_range(target_share: float | tuple[float, float], tolerance: float) -> tuple[float, float]:
    if isinstance(target_share, tuple):
        low, high = target_share
    else:
        low, high = target_share - tolerance, target_share + tolerance
    if not (0 <= low <= high <= 1 and high > 0):
        raise ValueError(f"target_share={target_share!r} must be in (0, 1) (a value or a low <= high range)")
    return low, high


def _check_search_numbers(compression_ratio: float, flops_tolerance: float, top_k: int) -> None:
    if not (isinstance(compression_ratio, int | float) and compression_ratio > 1):
        raise ValueError(f"compression_ratio={compression_ratio!r} must be a number > 1")
    if not (isinstance(flops_tolerance, int | float) and flops_tolerance >= 0):
        raise ValueError(f"flops_tolerance={flops_tolerance!r} must be a non-negative number")
    if not (_is_int(top_k) and top_k > 0):
        raise ValueError(f"top_k={top_k!r} must be a positive integer")


def _check_positive_ints_named(values: Mapping[str, Any]) -> None:
    for name, value in values.items():
        if not (_is_int(value) and value > 0):
            raise ValueError(f"{name}={value!r} must be a positive integer")
