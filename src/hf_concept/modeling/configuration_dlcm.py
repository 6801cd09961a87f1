"""Configuration of the DLCM family (model_type "dlcm"): Dynamic Large Concept Models.

Token stages (encoder, and the decoder's self-attention and MLPs) use the plain family's fields at width
`hidden_size` (d_token); the decoder layers' MLP width is `decoder_intermediate_size` (default: the
encoder's `intermediate_size`). The concept stage has its own width `concept_hidden_size` (d_concept), heads,
head dim and MLP width; the decoder's cross-attention its own heads and common head dim
(`cross_head_dim`, eq. 12–13). `num_hidden_layers` is derived: encoder + concept + decoder layers.

Boundaries: a learned cosine router (`router="cosine"`) sampled in training (`boundary_noise`), or the
parameter-free rule router (`router="rule"`, boundary where ½(1 − cos(h_{t−1}, h_t)) > `rule_threshold`,
the §8.1 comparison); `chunking="fixed"` opens a chunk every `compression_ratio` tokens instead. The ratio
loss is global (`ratio_scope="global"`, the Global Parser: F and G over every token of the optimizer
step, all ranks and accumulated micro-batches; needs `hf_concept.training.ConceptTrainer`, which keeps the
step's running counts), per micro-batch (`"batch"`) or per sequence (`"sequence"`, "Normal", Table 4).

Smoothing (§3.5.1, `concept_smoothing.py`): `"ema"` (default) is H-Net's, which DLCM says it follows: z̃_m =
p_m z_m + (1 − p_m) z̃_{m−1} with p_m the opening token's boundary probability, and each token's
cross-attention output multiplied by the straight-through confidence of its decision (value 1). It is the
default because it is the only form through which the LM loss reaches the learned router — the gradient
§8.1 (eq. 24) is about; with the W_s form a learned router follows the ratio loss alone, blind to what
the LM needs. §3.3 and §8.1 warn that this gradient can pull a learned router below its target ratio
("creep-up"); for segmentation decoupled from the LM loss choose `router="rule"`, whose probabilities
enter the smoothing detached. `"linear"` is z̃_m = z_m + W_s z_{m−1} (W_s zero at init), the form of
checkpoints saved before this field existed: a saved config without the field loads as `"linear"`.

Cross-attention form of a call with nothing cached before it (training, a first prefill): `"replicated"`
(concept K/V gathered to token positions, causal attention over L keys: flash-attn's varlen kernel on GPU,
§4.1), `"counted"` (one K/V per concept with + log(count) scores, over N slots: the L × M form) or
`"auto"` (default: the form measured faster on the device at that size, `dlcm_replication.preferred_form`).
The two are equal up to rounding; a call that continues a cache always uses the counted form.

Decoupled μP (§6.1), active when `mup_base_width` is set: s_token = hidden_size / base and s_concept =
concept_hidden_size / base; hidden matrices of a stage start with variance σ²/s, logits are multiplied by
1/s_token (`mup_output_scaling`), and `hf_concept.training.mup_param_groups` gives each group its learning
rate (the `mup_*_learning_rate` fields are η_base).

`check_fields` raises `ValueError` naming the field and the value.

The fields both concept families have (layer split, boundaries, ratio loss, concept width and heads) and
their checks are `concept_config.ConceptConfig`'s, which this config extends.
"""

from __future__ import annotations

from typing import Any

from .concept_config import BOUNDARY_NOISE_KINDS, CHUNKING_KINDS, RATIO_SCOPES, ConceptConfig
from .configuration_plain import MAX_COUNT, MAX_SIZE, _check_int, _check_number, _is_int
from .dlcm_stages import fill_stage_defaults

ROUTER_KINDS = ("cosine", "rule")
SMOOTHING_KINDS = ("ema", "linear")
CROSS_ATTENTION_FORMS = ("auto", "replicated", "counted")


class DLCMConfig(ConceptConfig):
    """Config of `DLCMForCausalLM`; see the module docstring for the stages and options."""

    model_type = "dlcm"
    auto_model_entry = "modeling_dlcm.DLCMModel"

    concept_layers: int = 4
    num_hidden_layers: int | None = None
    concept_head_dim: int | None = None
    decoder_intermediate_size: int | None = None
    cross_num_attention_heads: int | None = None
    cross_num_key_value_heads: int | None = None
    cross_head_dim: int | None = None
    compression_ratio: float = 4.0
    rule_threshold: float = 0.5
    smoothing: str = "ema"
    cross_attention_form: str = "auto"
    mup_base_width: int | None = None
    mup_token_learning_rate: float = 1e-3
    mup_concept_learning_rate: float = 1e-3
    mup_other_learning_rate: float = 1e-3
    mup_output_scaling: bool = True

    def __post_init__(self, **kwargs: Any) -> None:
        self._fill_stage_defaults()
        super().__post_init__(**kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        # A saved DLCM config written before `smoothing` existed used the W_s form: keep its meaning.
        if config_dict.get("model_type") == cls.model_type and "smoothing" not in config_dict:
            config_dict = {**config_dict, "smoothing": "linear"}
        return super().from_dict(config_dict, **kwargs)

    def _fill_stage_defaults(self) -> None:
        split = (self.encoder_layers, self.concept_layers, self.decoder_layers)
        if all(_is_int(value) for value in split):
            total = sum(split)
            if self.num_hidden_layers is not None and self.num_hidden_layers != total:
                raise ValueError(
                    f"num_hidden_layers={self.num_hidden_layers!r} must equal encoder_layers + concept_layers"
                    f" + decoder_layers = {total} (leave it unset)"
                )
            self.num_hidden_layers = total
        fill_stage_defaults(self)

    @property
    def mup_token_scale(self) -> float:
        """s_token = d_token / d_base (1 without μP)."""
        return 1.0 if self.mup_base_width is None else self.hidden_size / self.mup_base_width

    @property
    def mup_concept_scale(self) -> float:
        """s_concept = d_concept / d_base (1 without μP)."""
        return 1.0 if self.mup_base_width is None else self.concept_hidden_size / self.mup_base_width

    def check_fields(self) -> None:
        # The split first: num_hidden_layers is its sum, so a bad stage would be reported under that name.
        for name in ("encoder_layers", "concept_layers", "decoder_layers"):
            _check_int(name, getattr(self, name), high=MAX_COUNT)
        super().check_fields()
        self._check_stages()
        self._check_choices()
        self._check_numbers()

    def _check_stages(self) -> None:
        for name in (
            "concept_hidden_size",
            "concept_num_attention_heads",
            "concept_num_key_value_heads",
            "concept_intermediate_size",
            "decoder_intermediate_size",
            "cross_num_attention_heads",
            "cross_num_key_value_heads",
        ):
            _check_int(name, getattr(self, name))
        for name in ("concept_head_dim", "cross_head_dim"):
            value = getattr(self, name)
            if not (_is_int(value) and 0 < value <= MAX_SIZE and value % 2 == 0):
                raise ValueError(f"{name}={value!r} must be an even integer in [2, {MAX_SIZE}]")
        for prefix in ("concept", "cross"):
            heads = getattr(self, f"{prefix}_num_attention_heads")
            kv_heads = getattr(self, f"{prefix}_num_key_value_heads")
            if heads % kv_heads:
                raise ValueError(
                    f"{prefix}_num_key_value_heads={kv_heads} must divide "
                    f"{prefix}_num_attention_heads={heads}"
                )
        if self.sliding_window is not None:
            raise ValueError(f"sliding_window={self.sliding_window!r}: DLCM has no sliding-window layers")
        if self.num_experts != 0:
            raise ValueError(f"num_experts={self.num_experts!r}: DLCM's stages are dense (use 0)")

    def _check_choices(self) -> None:
        self._check_one_of(
            {
                "router": ROUTER_KINDS,
                "chunking": CHUNKING_KINDS,
                "boundary_noise": BOUNDARY_NOISE_KINDS,
                "ratio_scope": RATIO_SCOPES,
                "smoothing": SMOOTHING_KINDS,
                "cross_attention_form": CROSS_ATTENTION_FORMS,
            }
        )
        if not isinstance(self.mup_output_scaling, bool):
            raise ValueError(f"mup_output_scaling={self.mup_output_scaling!r} must be a bool")

    def _check_numbers(self) -> None:
        self._check_compression_ratio()
        for name in ("rule_threshold", "boundary_threshold"):
            _check_number(name, getattr(self, name), 0, 1, brackets="(]")
        self._check_boundary_scales()
        _check_int("mup_base_width", self.mup_base_width, optional=True)
        for name in ("mup_token_learning_rate", "mup_concept_learning_rate", "mup_other_learning_rate"):
            _check_number(name, getattr(self, name), 0, brackets="(]")


DLCMConfig.register_for_auto_class()
