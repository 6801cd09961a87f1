"""Configuration of the plain decoder family: a Llama/Mistral/Qwen2/Qwen3/Mixtral/Qwen-MoE style stack.

Every field is explicit (RoPE included: `rope_theta` and `rope_scaling`, never transformers'
`rope_parameters`), filled in `__post_init__` where it has a derived default, and checked in one place,
`check_fields`, which raises `ValueError` naming the field and the value. Numbers must be finite (nan
and inf are refused everywhere), sizes are integers up to `MAX_SIZE`, counts of layers or experts up to
`MAX_COUNT`, token ids lie in [0, vocab_size).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from .config_typos import loading_saved_config, warn_misspelt_keys
from .transformers_compat import CACHE_KEYS

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# Required and optional keys of `rope_scaling` per `rope_type` (transformers' names).
ROPE_SCALING_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    ),
}


# Largest size a field may hold (widths, vocabulary, positions, windows): beyond int32, index arithmetic in
# attention kernels overflows, and no weight matrix with such a side fits in memory.
MAX_SIZE = 2**31 - 1
# Most layers, experts, streams or loop repeats: each is a module or a list entry built one by one.
MAX_COUNT = 2**16
# Largest standard deviation of initial weights (see PlainDecoderConfig._check_sizes).
MAX_INITIALIZER_RANGE = 1e4


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite real number (int or float, not bool): nan and inf are never a valid setting."""
    if isinstance(value, bool):
        return False
    # Ints are finite however large (math.isfinite would overflow on them).
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def _check_int(name: str, value: Any, low: int = 1, high: int = MAX_SIZE, *, optional: bool = False) -> None:
    """Raise ValueError naming the field unless `value` is an int (not a bool) in [low, high]
    (or None when `optional`)."""
    if (optional and value is None) or (_is_int(value) and low <= value <= high):
        return
    prefix = "None or " if optional else ""
    raise ValueError(f"{name}={value!r} must be {prefix}an integer in [{low}, {high}]")


def _check_number(
    name: str,
    value: Any,
    low: float = 0,
    high: float = math.inf,
    *,
    brackets: str = "[]",
    optional: bool = False,
) -> None:
    """Raise ValueError naming the field unless `value` is a finite real number between low and high;
    `brackets` says which ends are included ("[]", "(]", "[)" or "()"); high=inf means no upper bound."""
    if optional and value is None:
        return
    if _is_number(value):
        above = value >= low if brackets[0] == "[" else value > low
        below = value <= high if brackets[1] == "]" else value < high
        if above and below:
            return
    if high == math.inf:
        rule = f"{'>=' if brackets[0] == '[' else '>'} {low:g}"
    else:
        rule = f"in {brackets[0]}{low:g}, {high:g}{brackets[1]}"
    prefix = "None or " if optional else ""
    raise ValueError(f"{name}={value!r} must be {prefix}a finite number {rule}")


def _normalise_rope_scaling(rope_scaling: Any, max_position_embeddings: int) -> Any:
    """None for plain RoPE; otherwise a copy with `rope_type` (legacy `type` accepted) and yarn's default
    `original_max_position_embeddings` (= max_position_embeddings, as transformers does)."""
    if not isinstance(rope_scaling, dict):
        return rope_scaling
    scaling = dict(rope_scaling)
    if "rope_type" not in scaling and "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("rope_theta", None)
    if scaling.get("rope_type", "default") == "default" and len(scaling) <= 1:
        return None
    if scaling.get("rope_type") == "yarn":
        scaling.setdefault("original_max_position_embeddings", max_position_embeddings)
    return scaling


class PlainDecoderConfig(PretrainedConfig):
    """Config of `PlainDecoderForCausalLM` (model_type "hf_concept_plain").

    Dense by default; `num_experts > 0` makes layers sparse following Qwen-MoE's placement rule
    (`decoder_sparse_step`, `mlp_only_layers`). `attention_bias` puts biases on q/k/v (Qwen2),
    `attention_output_bias` on o_proj (Llama/Qwen3 with attention_bias). `layer_types` lists
    "full_attention" / "sliding_attention" per layer; it defaults to all sliding when `sliding_window`
    is set (Mistral), else all full.
    """

    model_type = "hf_concept_plain"
    keys_to_ignore_at_inference: ClassVar[list[str]] = [*CACHE_KEYS, "router_logits", "aux_loss"]

    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    attention_output_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    attention_dropout: float = 0.0
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] | None = None
    output_router_logits: bool = False
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2

    def __post_init__(self, **kwargs: Any) -> None:
        # Every family's __post_init__ ends here with the keyword arguments that are not fields.
        warn_misspelt_keys(type(self), kwargs)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        heads, width = self.num_attention_heads, self.hidden_size
        if self.head_dim is None and _is_int(width) and _is_int(heads) and heads > 0 and width % heads == 0:
            self.head_dim = width // heads
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        if self.mlp_only_layers is None:
            self.mlp_only_layers = []
        # A layer count out of range is left for check_fields to name, not turned into a huge list.
        layers = self.num_hidden_layers
        if self.layer_types is None and _is_int(layers) and 0 < layers <= MAX_COUNT:
            default_type = "full_attention" if self.sliding_window is None else "sliding_attention"
            self.layer_types = [default_type] * self.num_hidden_layers
        self.rope_scaling = _normalise_rope_scaling(self.rope_scaling, self.max_position_embeddings)
        # save_pretrained adds AutoConfig / AutoModelForCausalLM; the base model is pre-seeded here.
        auto_map = {"AutoModel": "modeling_plain.PlainDecoderModel"}
        auto_map.update(kwargs.pop("auto_map", None) or getattr(self, "auto_map", None) or {})
        self.auto_map = auto_map
        self.check_fields()
        super().__post_init__(**kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        # A saved config's keys are not checked for misspellings, the caller's overrides are (unless
        # from_pretrained of a model passes its own keyword arguments through, return_unused_kwargs).
        if not kwargs.get("return_unused_kwargs"):
            warn_misspelt_keys(cls, kwargs)
        with loading_saved_config():
            return super().from_dict(config_dict, **kwargs)

    def check_fields(self) -> None:
        """Raise ValueError naming the first invalid field and its value."""
        self._check_sizes()
        self._check_token_ids()
        self._check_attention()
        self._check_rope()
        self._check_experts()
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings={self.tie_word_embeddings!r} must be a bool")

    def _check_sizes(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "max_position_embeddings"):
            _check_int(name, getattr(self, name))
        _check_int("num_hidden_layers", self.num_hidden_layers, high=MAX_COUNT)
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not a known activation")
        # eps keeps RMSNorm's division finite on an all-zero vector, so it must be > 0; a large eps only
        # damps small activations (unusual, not broken), so there is no upper bound.
        _check_number("rms_norm_eps", self.rms_norm_eps, 0, brackets="(]")
        # The standard deviation of initial weights (0.02 typically). A large one is unusual, not broken,
        # until products of initial weights overflow float32 (the tiny test models' forward turns inf
        # between 1e8 and 1e15); MAX_INITIALIZER_RANGE keeps a wide margin for wider models.
        _check_number("initializer_range", self.initializer_range, 0, MAX_INITIALIZER_RANGE)

    def _check_token_ids(self) -> None:
        vocab_size = self.vocab_size
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            several = name == "eos_token_id" and isinstance(value, list | tuple)
            ids = list(value) if several else [value]
            if value is None or (ids and all(_is_int(i) and 0 <= i < vocab_size for i in ids)):
                continue
            rule = f"an id in [0, vocab_size={vocab_size})"
            if name == "eos_token_id":
                rule += " or a non-empty list of such ids"
            raise ValueError(f"{name}={value!r} must be None or {rule}")

    def _check_attention(self) -> None:
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        _check_int("num_attention_heads", heads)
        _check_int("num_key_value_heads", kv_heads)
        if heads % kv_heads != 0:
            raise ValueError(f"num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
        head_dim = self.head_dim
        if head_dim is None:
            raise ValueError(
                f"head_dim=None needs num_attention_heads={heads} to divide hidden_size={self.hidden_size}"
            )
        if not (_is_int(head_dim) and 0 < head_dim <= MAX_SIZE and head_dim % 2 == 0):
            raise ValueError(f"head_dim={head_dim!r} must be an even integer in [2, {MAX_SIZE}] (RoPE)")
        _check_number("attention_dropout", self.attention_dropout, 0, 1, brackets="[)")
        for name in ("attention_bias", "attention_output_bias", "mlp_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        layer_types = self.layer_types
        if not isinstance(layer_types, list) or len(layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types={layer_types!r} must be a list of "
                f"num_hidden_layers={self.num_hidden_layers} entries"
            )
        unknown = sorted({kind for kind in layer_types if kind not in ATTENTION_LAYER_TYPES})
        if unknown:
            raise ValueError(f"layer_types={layer_types!r} has {unknown}; allowed: {ATTENTION_LAYER_TYPES}")
        _check_int("sliding_window", self.sliding_window, optional=True)
        if self.sliding_window is None and "sliding_attention" in layer_types:
            raise ValueError(
                f"sliding_window=None but layer_types={layer_types!r} has sliding_attention layers"
            )

    def _check_rope(self) -> None:
        _check_number("rope_theta", self.rope_theta, 0, brackets="(]")
        scaling = self.rope_scaling
        if scaling is None:
            return
        if not isinstance(scaling, dict):
            raise ValueError(f"rope_scaling={scaling!r} must be None or a dict")
        rope_type = scaling.get("rope_type")
        if rope_type not in ROPE_SCALING_KEYS:
            raise ValueError(
                f"rope_scaling rope_type={rope_type!r} is not supported; choose one of "
                f"{('default', *ROPE_SCALING_KEYS)}"
            )
        required, optional = ROPE_SCALING_KEYS[rope_type]
        missing = [key for key in required if scaling.get(key) is None]
        unknown = sorted(set(scaling) - set(required) - set(optional) - {"rope_type"})
        if missing or unknown:
            raise ValueError(f"rope_scaling={scaling!r}: missing keys {missing}, unknown keys {unknown}")
        if not (_is_number(scaling["factor"]) and scaling["factor"] > 0):
            raise ValueError(f"rope_scaling factor={scaling['factor']!r} must be a finite number > 0")
        if rope_type == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
            raise ValueError(
                f"rope_scaling high_freq_factor={scaling['high_freq_factor']!r} must exceed "
                f"low_freq_factor={scaling['low_freq_factor']!r}"
            )

    def _check_experts(self) -> None:
        experts, shared = self.num_experts, self.shared_expert_intermediate_size
        # 0 experts = dense. The expert fields are checked even then: a bad value must not wait in a saved
        # config until experts are switched on.
        _check_int("num_experts", experts, 0, MAX_COUNT)
        _check_int("shared_expert_intermediate_size", shared, 0)
        _check_int("moe_intermediate_size", self.moe_intermediate_size)
        _check_int("decoder_sparse_step", self.decoder_sparse_step, high=MAX_COUNT)
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"norm_topk_prob={self.norm_topk_prob!r} must be a bool")
        top_k = self.num_experts_per_tok
        if experts == 0:
            _check_int("num_experts_per_tok", top_k)
            if shared > 0:
                raise ValueError(f"shared_expert_intermediate_size={shared} needs num_experts > 0, got 0")
            return
        if not (_is_int(top_k) and 1 <= top_k <= experts):
            raise ValueError(f"num_experts_per_tok={top_k!r} must be in [1, num_experts={experts}]")
        layers = self.mlp_only_layers
        if not isinstance(layers, list) or not all(
            _is_int(index) and 0 <= index < self.num_hidden_layers for index in layers
        ):
            raise ValueError(
                f"mlp_only_layers={layers!r} must list layer indices in [0, {self.num_hidden_layers})"
            )


PlainDecoderConfig.register_for_auto_class()
