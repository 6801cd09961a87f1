"""Configuration of the plain decoder family: a Llama/Mistral/Qwen2/Qwen3/Mixtral/Qwen-MoE style stack.

Every field is explicit (RoPE included: `rope_theta` and `rope_scaling`, never transformers'
`rope_parameters`), filled in `__post_init__` where it has a derived default, and checked in one place,
`check_fields`, which raises `ValueError` naming the field and the value.
"""

from __future__ import annotations

from typing import Any, ClassVar

from transformers import PretrainedConfig
from transformers.activations import ACT2FN

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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


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
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values", "router_logits", "aux_loss"]

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
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        heads, width = self.num_attention_heads, self.hidden_size
        if self.head_dim is None and _is_int(width) and _is_int(heads) and heads > 0 and width % heads == 0:
            self.head_dim = width // heads
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        if self.mlp_only_layers is None:
            self.mlp_only_layers = []
        if self.layer_types is None and _is_int(self.num_hidden_layers):
            default_type = "full_attention" if self.sliding_window is None else "sliding_attention"
            self.layer_types = [default_type] * self.num_hidden_layers
        self.rope_scaling = _normalise_rope_scaling(self.rope_scaling, self.max_position_embeddings)
        # save_pretrained adds AutoConfig / AutoModelForCausalLM; the base model is pre-seeded here.
        auto_map = {"AutoModel": "modeling_plain.PlainDecoderModel"}
        auto_map.update(kwargs.pop("auto_map", None) or getattr(self, "auto_map", None) or {})
        self.auto_map = auto_map
        self.check_fields()
        super().__post_init__(**kwargs)

    def check_fields(self) -> None:
        """Raise ValueError naming the first invalid field and its value."""
        self._check_sizes()
        self._check_attention()
        self._check_rope()
        self._check_experts()
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings={self.tie_word_embeddings!r} must be a bool")
        pad = self.pad_token_id
        if pad is not None and not (_is_int(pad) and 0 <= pad < self.vocab_size):
            raise ValueError(
                f"pad_token_id={pad!r} must be None or an id in [0, vocab_size={self.vocab_size})"
            )

    def _check_sizes(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            value = getattr(self, name)
            if not (_is_int(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not a known activation")
        for name in ("max_position_embeddings",):
            value = getattr(self, name)
            if not (_is_int(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not (_is_number(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps!r} must be a positive number")
        if not (_is_number(self.initializer_range) and self.initializer_range >= 0):
            raise ValueError(f"initializer_range={self.initializer_range!r} must be a non-negative number")

    def _check_attention(self) -> None:
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        if not (_is_int(heads) and heads > 0):
            raise ValueError(f"num_attention_heads={heads!r} must be a positive integer")
        if not (_is_int(kv_heads) and kv_heads > 0):
            raise ValueError(f"num_key_value_heads={kv_heads!r} must be a positive integer")
        if heads % kv_heads != 0:
            raise ValueError(f"num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
        if self.head_dim is None:
            raise ValueError(
                f"head_dim=None needs num_attention_heads={heads} to divide hidden_size={self.hidden_size}"
            )
        if not (_is_int(self.head_dim) and self.head_dim > 0 and self.head_dim % 2 == 0):
            raise ValueError(f"head_dim={self.head_dim!r} must be a positive even integer (RoPE)")
        if not (_is_number(self.attention_dropout) and 0 <= self.attention_dropout < 1):
            raise ValueError(f"attention_dropout={self.attention_dropout!r} must be in [0, 1)")
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
        window = self.sliding_window
        if window is not None and not (_is_int(window) and window > 0):
            raise ValueError(f"sliding_window={window!r} must be None or a positive integer")
        if window is None and "sliding_attention" in layer_types:
            raise ValueError(
                f"sliding_window=None but layer_types={layer_types!r} has sliding_attention layers"
            )

    def _check_rope(self) -> None:
        if not (_is_number(self.rope_theta) and self.rope_theta > 0):
            raise ValueError(f"rope_theta={self.rope_theta!r} must be a positive number")
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
            raise ValueError(f"rope_scaling factor={scaling['factor']!r} must be a positive number")
        if rope_type == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
            raise ValueError(
                f"rope_scaling high_freq_factor={scaling['high_freq_factor']!r} must exceed "
                f"low_freq_factor={scaling['low_freq_factor']!r}"
            )

    def _check_experts(self) -> None:
        experts = self.num_experts
        if not (_is_int(experts) and experts >= 0):
            raise ValueError(f"num_experts={experts!r} must be a non-negative integer (0 = dense)")
        shared = self.shared_expert_intermediate_size
        if not (_is_int(shared) and shared >= 0):
            raise ValueError(f"shared_expert_intermediate_size={shared!r} must be a non-negative integer")
        if experts == 0:
            if shared > 0:
                raise ValueError(f"shared_expert_intermediate_size={shared} needs num_experts > 0, got 0")
            return
        top_k = self.num_experts_per_tok
        if not (_is_int(top_k) and 1 <= top_k <= experts):
            raise ValueError(f"num_experts_per_tok={top_k!r} must be in [1, num_experts={experts}]")
        size = self.moe_intermediate_size
        if not (_is_int(size) and size > 0):
            raise ValueError(f"moe_intermediate_size={size!r} must be a positive integer")
        step = self.decoder_sparse_step
        if not (_is_int(step) and step >= 1):
            raise ValueError(f"decoder_sparse_step={step!r} must be a positive integer")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"norm_topk_prob={self.norm_topk_prob!r} must be a bool")
        layers = self.mlp_only_layers
        if not isinstance(layers, list) or not all(
            _is_int(index) and 0 <= index < self.num_hidden_layers for index in layers
        ):
            raise ValueError(
                f"mlp_only_layers={layers!r} must list layer indices in [0, {self.num_hidden_layers})"
            )


PlainDecoderConfig.register_for_auto_class()
