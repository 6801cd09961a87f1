"""Configuration of the ConceptMoE family (model_type "conceptmoe").

Every backbone field is the plain family's (same names, same meaning, same checks); the ConceptMoE
fields split the `num_hidden_layers` layers into encoder / concept / decoder stacks and describe the chunk
module, pooling, dechunking, joint decoding and compute reallocation (docs/ARCHITECTURE.md, §3.1).
`check_fields` raises `ValueError` naming the field and the value.

The fields both concept families have (layer split, boundaries, ratio loss, concept width and heads) and
their checks are `concept_config.ConceptConfig`'s, which this config extends.
"""

from __future__ import annotations

from typing import Any

from .concept_config import BOUNDARY_NOISE_KINDS, CHUNKING_KINDS, RATIO_SCOPES, ConceptConfig
from .configuration_plain import MAX_COUNT, _check_int, _check_number, _is_int

ROUTER_KINDS = ("cosine", "linear")
ROUTER_INITS = ("random", "identity")
POOLING_KINDS = ("first", "sum", "mean")
DECHUNK_RESIDUALS = ("output", "delta")
DECHUNK_EMAS = ("probability", "straight_through")
# Joint decoding on the last J decoder layers; None means min(DEFAULT_JOINT_LAYERS, decoder_layers).
DEFAULT_JOINT_LAYERS = 4
# What a config saved before `joint_decoding_norm` existed meant by leaving it out.
LEGACY_FIELDS = {"joint_decoding_norm": False}


class ConceptMoEConfig(ConceptConfig):
    """Config of `ConceptMoEForCausalLM`.

    `num_hidden_layers` = encoder_layers + concept layers + decoder_layers; the concept layers are the
    rest and there must be at least one. Each layer keeps its index in that flat numbering for
    `layer_types` (sliding windows).

    `joint_decoding_norm` (default True) puts an RMSNorm before the joint-decoding projections: the concept
    a token reads is a residual-stream quantity (for a converted checkpoint, the concept layers' summed
    update, with per-token norms in the hundreds and outliers in the tens of thousands on SmolLM2), and
    the gradient of a linear map scales with what it reads, so unnormalised they dominated the gradient
    norm by ~1000x. The projections stay zero-initialised, so the norm changes nothing at step 0. Configs
    saved before the field existed load with False, as their weights were trained.

    `dechunk_ema` picks the weight of each concept in the dechunk EMA (eq. 8, z̃_m = w_m z_m + (1 − w_m)
    z̃_{m−1}): "probability" (default, the paper's) w_m = p_m, its opening token's boundary probability;
    "straight_through" w_m = 1 in value with p_m's gradient (`routing.straight_through`), so each token
    reads its own concept unblurred while the LM loss still reaches the router through the EMA. A router
    that decides on local ranks (`boundary_rank_window`) opens concepts where p is high *for its
    neighbourhood*, not where p is near 1, so the paper's EMA mixes a share of every concept's predecessor
    into it, where fixed chunks (p = 1) mix nothing (measured on SmolLM2 in REPRODUCTION.md).
    """

    model_type = "conceptmoe"
    auto_model_entry = "modeling_conceptmoe.ConceptMoEModel"

    num_hidden_layers: int = 6
    compression_ratio: float = 2.0
    router_init: str = "random"
    pooling: str = "first"
    dechunk_residual: str = "output"
    dechunk_ema: str = "probability"
    joint_decoding_layers: int | None = None
    joint_decoding_norm: bool = True
    concept_loop: list[int] | None = None
    concept_num_experts_per_tok: int | None = None
    concept_moe_intermediate_size: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        if isinstance(self.concept_loop, tuple):
            self.concept_loop = list(self.concept_loop)
        super().__post_init__(**kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        """A saved config (it names its transformers version) that predates `joint_decoding_norm` keeps
        the behaviour its weights were trained with (`LEGACY_FIELDS`)."""
        if "transformers_version" in config_dict and "joint_decoding_norm" not in config_dict:
            config_dict = {**LEGACY_FIELDS, **config_dict}
        return super().from_dict(config_dict, **kwargs)

    @property
    def num_concept_layers(self) -> int:
        return self.num_hidden_layers - self.encoder_layers - self.decoder_layers

    @property
    def num_joint_layers(self) -> int:
        if self.joint_decoding_layers is None:
            return min(DEFAULT_JOINT_LAYERS, self.decoder_layers)
        return self.joint_decoding_layers

    @property
    def concept_width(self) -> int:
        return self.hidden_size if self.concept_hidden_size is None else self.concept_hidden_size

    def concept_overrides(self) -> dict[str, int]:
        """The fields the concept layers see differently from the token stages (§3.5 Strategy 3: a wider
        concept stack — width, heads, MLP and expert widths — and Strategy 1: its own top-k); the
        head dim stays the token stages' (one RoPE table)."""
        overrides = {"hidden_size": self.concept_width} if self.concept_width != self.hidden_size else {}
        if self.concept_top_k != self.num_experts_per_tok:
            overrides["num_experts_per_tok"] = self.concept_top_k
        for name in (
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "moe_intermediate_size",
        ):
            value = getattr(self, f"concept_{name}")
            if value is not None:
                overrides[name] = value
        return overrides

    @property
    def concept_top_k(self) -> int:
        """Experts per token in the concept layers (§3.5 Strategy 1: raised where compute was saved);
        `num_experts_per_tok` unless `concept_num_experts_per_tok` is set."""
        value = self.concept_num_experts_per_tok
        return self.num_experts_per_tok if value is None else value

    def concept_layer_schedule(self) -> list[int]:
        """Concept-layer indices (within the concept stack) in the order they run, loops unrolled."""
        order = list(range(self.num_concept_layers))
        if self.concept_loop is None:
            return order
        start, end, extra = self.concept_loop
        return order[:end] + list(range(start, end)) * extra + order[end:]

    def check_fields(self) -> None:
        super().check_fields()
        self._check_layer_split()
        self._check_choices()
        self._check_numbers()
        self._check_compute_reallocation()

    def _check_layer_split(self) -> None:
        for name in ("encoder_layers", "decoder_layers"):
            _check_int(name, getattr(self, name), 0, MAX_COUNT)
        if self.num_concept_layers < 1:
            raise ValueError(
                f"num_hidden_layers={self.num_hidden_layers} must exceed encoder_layers={self.encoder_layers}"
                f" + decoder_layers={self.decoder_layers} (at least one concept layer)"
            )
        joint = self.joint_decoding_layers
        if joint is not None and not (_is_int(joint) and 0 <= joint <= self.decoder_layers):
            raise ValueError(
                f"joint_decoding_layers={joint!r} must be None or in "
                f"[0, decoder_layers={self.decoder_layers}]"
            )
        if not isinstance(self.joint_decoding_norm, bool):
            raise ValueError(f"joint_decoding_norm={self.joint_decoding_norm!r} must be True or False")

    def _check_choices(self) -> None:
        self._check_one_of(
            {
                "chunking": CHUNKING_KINDS,
                "router": ROUTER_KINDS,
                "router_init": ROUTER_INITS,
                "boundary_noise": BOUNDARY_NOISE_KINDS,
                "pooling": POOLING_KINDS,
                "dechunk_residual": DECHUNK_RESIDUALS,
                "dechunk_ema": DECHUNK_EMAS,
                "ratio_scope": RATIO_SCOPES,
            }
        )

    def _check_numbers(self) -> None:
        self._check_compression_ratio(" for chunking='dynamic'")
        self._check_boundary_scales()
        _check_number("boundary_threshold", self.boundary_threshold, 0, 1, brackets="(]")

    def _check_compute_reallocation(self) -> None:
        loop = self.concept_loop
        if loop is not None:
            valid = (
                isinstance(loop, list)
                and len(loop) == 3
                and all(_is_int(value) for value in loop)
                and 0 <= loop[0] < loop[1] <= self.num_concept_layers
                and 1 <= loop[2] <= MAX_COUNT
            )
            if not valid:
                raise ValueError(
                    f"concept_loop={loop!r} must be None or [start, end, extra] with "
                    f"0 <= start < end <= {self.num_concept_layers} concept layers and extra in "
                    f"[1, {MAX_COUNT}]"
                )
        top_k = self.concept_num_experts_per_tok
        if top_k is not None and not (
            self.num_experts > 0 and _is_int(top_k) and 1 <= top_k <= self.num_experts
        ):
            raise ValueError(
                f"concept_num_experts_per_tok={top_k!r} must be None or an integer in "
                f"[1, num_experts={self.num_experts}] (a MoE backbone)"
            )
        for name in ("concept_intermediate_size", "concept_moe_intermediate_size"):
            _check_int(name, getattr(self, name), optional=True)
        for name in ("concept_num_attention_heads", "concept_num_key_value_heads"):
            _check_int(name, getattr(self, name), high=MAX_COUNT, optional=True)
        # Unset concept fields are the token stages' (key/value heads included).
        heads = self.concept_num_attention_heads or self.num_attention_heads
        kv_heads = self.concept_num_key_value_heads or self.num_key_value_heads
        if _is_int(heads) and _is_int(kv_heads) and heads % kv_heads:
            raise ValueError(
                f"concept_num_key_value_heads={kv_heads!r} must divide concept_num_attention_heads={heads!r}"
            )
        # A width other than hidden_size gets projections in and out of the concept stack, narrower as well
        # as wider (§3.5 Strategy 3 widens it); the concept heads keep the token stages' head_dim, so the
        # width need not be a multiple of the heads.
        _check_int("concept_hidden_size", self.concept_hidden_size, optional=True)


ConceptMoEConfig.register_for_auto_class()
