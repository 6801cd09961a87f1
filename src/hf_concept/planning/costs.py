"""Parameters, FLOPs per token and KV-cache bytes per token of a spec (the conventions are in the package
docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .specs import BaselineSpec, DLCMSpec, _is_int

CROSS_ATTENTION_FORMS = ("replicated", "counted")
SHARE_DENOMINATORS = ("total", "non_embedding")

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
