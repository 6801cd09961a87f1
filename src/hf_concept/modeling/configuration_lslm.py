"""Configuration of the LSLM family (model_type "lslm"): Latent Segment Language Models over bytes.

Three stages (LSLM §2, Appendix B): a token (byte) encoder, a segment encoder over pooled segments, and a
segment decoder that writes each segment from `<bos>` to `<nxt>` with cross-attention to the encoded
segments before it. The segment encoder uses the plain fields (`hidden_size`, `num_attention_heads`,
`intermediate_size`, ...); the token encoder and the decoder have their own width, heads and MLP width
(`token_*`, `decoder_*`, default: the segment encoder's), with projections where widths differ.

Boundaries (z_t = 1: byte t ends a segment) come from the ffn-gumbel router p̂_t = sum(FFN(h_t)), sampled
in training as σ(p̂_t + g′ − g″) ≥ 0.5, thresholded at inference. `boundary_estimator` says how the LM
loss reaches the router: "straight_through" (default, the paper's §2.6: the hard sample passes its
gradient straight through into dynamic pooling's matrix, `lslm_estimators`), "straight_through_targets"
(also through the decoder's target at the byte's slot, `<nxt>` or the next byte; on the synthetic word
language it drives the rate to 0 or 1 unless the prior is strong, see docs/lslm.md), "confidence"
(each byte and decoder slot scaled by its decision's straight-through confidence, H-Net's multiplier,
the form before the straight-through default) or "segmental" (not the paper's: the router's gradient of
the expected objective under q, from every free byte's decision flipped against the rest of the training
sample, `lslm_segmental`).
An exact dynamic programme over segment layouts, as in segmental LMs, needs a segment's likelihood to
depend on where it starts and ends only; here the decoder reads the encoded segments s'_{0:m}, which
depend on every end before, so "segmental" is exact per decision given the sampled rest and unbiased over
it, at one more segment-encoder and decoder pass per free byte (no backward through them);
`segmental_flips` = k > 0 flips only k free bytes per row, drawn uniformly and weighted by n / k (still
unbiased, k + 1 passes per row; 0, the default, flips every free byte). Its gradient carries the
decoder's full preference for fewer ends: on the synthetic word language the paper's prior strength
(β = 1) lets it close no segment at all; a strong count prior holds the rate (`prior_loss="binomial"`,
`kl_weight` 10).

The objective is the ELBO of the paper's eq. 4: cross-entropy of the decoder's bytes + `kl_weight` (β) ·
the boundary prior's term. Eq. 4 sums log p(x_t | X_<t, Z_<t) over the bytes and scores z only by the KL
to the prior; `segment_end_loss=True` adds the cross-entropy of the decoder's `<nxt>` markers (the
log p(z_t | X_≤t, Z_<t) of eq. 1, which §2.3 has the decoder write to close a segment). It is off by
default because it slows the whole hierarchy: measured apart (every byte its own segment, where each
`<nxt>` is certain), the model with it trails the byte decoder of the same layers far behind and is
close to it without it, and the router's and random ends gain alike (REPRODUCTION.md). Inference closes
segments where the router (or the boundary source) does, not where the decoder writes `<nxt>`, so
nothing at inference needs the term. Configs saved before the default changed carry True, and those
saved before the field existed load with True, the objective they were trained on. `prior_loss` picks
the prior's term:
- "beta_binomial" (default, the paper's Beta(a, b) prior on the boundary rate): −log of the Beta-Binomial
  probability of each row's sampled number of ends, a = `prior_mean` · `prior_concentration`, b =
  (1 − `prior_mean`) · `prior_concentration` (or `prior_alpha`, `prior_beta` given directly). It scores
  the count only, so single bytes are free to be near 0 or 1;
- "beta_kl" (eq. 4 as written): KL(q(z_t) ‖ p) per free byte with the Beta(a, b) prior, read as the KL
  expected under the Beta, E_{π~Beta(a, b)}[KL(Bernoulli(q_t) ‖ Bernoulli(π))] = q log q + (1 − q)
  log(1 − q) − q (ψ(a) − ψ(a + b)) − (1 − q)(ψ(b) − ψ(a + b)) (`lslm_estimators.beta_expected_kl`).
  The other reading, the KL to the Beta-Bernoulli marginal Bernoulli(a / (a + b)), is "kl" exactly and
  leaves the concentration no part, where the paper takes the Beta "to capture a range of segmentation
  granularities"; the expected KL is the exact KL term of the ELBO when one rate π per row is drawn
  from the Beta and its posterior is taken to be the prior (q(Z, π) = q(Z) p(π)), so the objective stays
  a lower bound on log p(X). It pins every q_t at σ(ψ(a) − ψ(b)) (0.247 for a = 25, b = 75; the mean
  as a + b grows);
- "kl": KL(Bernoulli(q_t) ‖ Bernoulli(`prior_mean`)) per byte, the i.i.d. form, which pins every q_t at
  the prior mean;
- "binomial": DTP's count prior −log Binomial(k; n, `prior_mean`) (a Beta of infinite concentration).
`update_schedule`: 0 (default) updates the generator and the router together at every optimizer step,
so the generator gets as many updates as any baseline at equal steps; k ≥ 1 is the paper's interleaving
(§2.6), k generator steps then one inference-network step, which gives the generator only k/(k + 1)
of the updates. Saved configs carry their value, so a checkpoint trained interleaved resumes
interleaved. The other defaults follow the paper's best setting: prior mean 0.7, β = `kl_weight` = 1.

The segment decoder knows which segment it continues: with `decoder_latest_segment` (default True) the
latest encoded segment s'_m (the null segment before the first), projected to the decoder's width, is
added to the input of every slot of segment m + 1. The paper's decoder is conditioned on s'_{0:m}
(§2.3), but cross-attention alone carries no order: every segment's `<bos>` slot sends the same query
and cannot tell the latest segment from the others. Configs saved before these fields existed load with
the former behaviour (no latest-segment input, "kl", "confidence", the `<nxt>` term), as their weights
were trained.

Inference decides with `boundary_rule`. Training samples a boundary with probability q_t (σ(p̂ + g′ − g″)
≥ ½ is a Bernoulli(q_t) draw), so it closes Σ q_t bytes of a text in expectation. "rate" (default) closes
byte t when the running sum of q over the document passes a half-integer there (`lslm_boundary_rules`): the
same rate as training on every text, deterministic and causal, and the decision of a sure router (q near
0 or 1) unchanged. "threshold" closes where q_t ≥ `boundary_threshold`, which closes every byte or none
while the router is unsure (q_t ≈ 0.7 everywhere under the default prior); a threshold at or above
`prior_mean` is warned about. Checkpoints saved before `boundary_rule` existed load with "rate".

`boundary_source` says what decides the ends, so that the hierarchy can be measured without the router:
"router" (default, the paper's), "every" (every byte ends its segment: one byte per segment) or "random"
(byte t of a document ends its segment where a fixed hash of t and `boundary_seed` falls below the prior
mean: the same ends in training, evaluation and generation, `lslm_boundary_rules.random_ends`). With
"every" and "random" the router still runs (its q_t are logged and scored by the prior term) but decides
nothing. `<BoS>`, `<eos>`, markers and document ends close segments under every source.

`check_fields` raises `ValueError` naming the field and the value.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from transformers.utils import logging

from .configuration_plain import MAX_COUNT, PlainDecoderConfig, _check_int, _check_number, _is_int, _is_number
from .pooling import parse_pooling_method
from .transformers_compat import CACHE_KEYS

logger = logging.get_logger(__name__)

PRIOR_LOSSES = ("beta_binomial", "beta_kl", "kl", "binomial")
BOUNDARY_ESTIMATORS = ("straight_through", "straight_through_targets", "confidence", "segmental")
BOUNDARY_SOURCES = ("router", "every", "random")
# What a config saved before the Beta prior, the straight-through estimator and the latest-segment input
# existed meant by leaving these fields out.
LEGACY_FIELDS = {"prior_loss": "kl", "boundary_estimator": "confidence", "decoder_latest_segment": False}
BOUNDARY_RULES = ("rate", "threshold")

# The model tells padding, sequence start and end and the segment markers apart by id alone.
SPECIAL_ID_FIELDS = (
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "segment_start_token_id",
    "segment_end_token_id",
)


class LSLMConfig(PlainDecoderConfig):
    """Config of `LSLMForCausalLM`; defaults follow the paper's Appendix B (512 wide, 4 + 10 + 4 layers)."""

    model_type = "lslm"
    keys_to_ignore_at_inference: ClassVar[list[str]] = [
        *CACHE_KEYS,
        "lm_loss",
        "kl_loss",
        "boundary_rate",
        "expected_boundary_rate",
        "inference_boundary_rate",
        "bits_per_byte",
        "hidden_states",
        # Per-token figures to look at, not predictions: Trainer.predict would gather them as logits.
        "boundaries",
        "boundary_probs",
    ]

    vocab_size: int = 261
    hidden_size: int = 512
    intermediate_size: int = 2048
    num_attention_heads: int = 8
    num_hidden_layers: int | None = None
    token_encoder_layers: int = 4
    segment_encoder_layers: int = 10
    decoder_layers: int = 4
    token_hidden_size: int | None = None
    token_num_attention_heads: int | None = None
    token_intermediate_size: int | None = None
    decoder_hidden_size: int | None = None
    decoder_num_attention_heads: int | None = None
    decoder_intermediate_size: int | None = None
    router_intermediate_size: int | None = None
    pooling: str = "mean"
    prior_mean: float | None = None
    prior_alpha: float | None = None
    prior_beta: float | None = None
    prior_concentration: float = 100.0
    kl_weight: float = 1.0
    prior_loss: str = "beta_binomial"
    boundary_estimator: str = "straight_through"
    segmental_flips: int = 0
    segment_end_loss: bool = False
    decoder_latest_segment: bool = True
    update_schedule: int = 0
    boundary_threshold: float = 0.5
    boundary_rule: str = "rate"
    boundary_source: str = "router"
    boundary_seed: int = 0
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    segment_start_token_id: int = 3
    segment_end_token_id: int = 4

    def __post_init__(self, **kwargs: Any) -> None:
        self._fill_stage_defaults()
        auto_map = {"AutoModel": "modeling_lslm.LSLMModel"}
        auto_map.update(kwargs.pop("auto_map", None) or {})
        kwargs["auto_map"] = auto_map
        super().__post_init__(**kwargs)
        # Once per config (not in check_fields, which the model calls again).
        self._warn_unreachable_threshold()

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        """A saved config (it names its transformers version) that predates those fields keeps the
        behaviour its weights were trained with (`LEGACY_FIELDS`)."""
        if "transformers_version" in config_dict and "boundary_estimator" not in config_dict:
            config_dict = {**LEGACY_FIELDS, **config_dict}
        if "transformers_version" in config_dict:
            # Added after the fields above, while its default was True.
            config_dict = {"segment_end_loss": True, **config_dict}
        return super().from_dict(config_dict, **kwargs)

    def beta_prior(self) -> tuple[float, float]:
        """(a, b) of the Beta prior on the boundary rate: `prior_alpha`, `prior_beta` when given, else from
        `prior_mean` and `prior_concentration` (a + b)."""
        if self.prior_alpha is not None:
            return self.prior_alpha, self.prior_beta
        return self.prior_mean * self.prior_concentration, (1 - self.prior_mean) * self.prior_concentration

    def _fill_stage_defaults(self) -> None:
        split = (self.token_encoder_layers, self.segment_encoder_layers, self.decoder_layers)
        if all(_is_int(value) for value in split):
            total = sum(split)
            if self.num_hidden_layers is not None and self.num_hidden_layers != total:
                raise ValueError(
                    f"num_hidden_layers={self.num_hidden_layers!r} must equal token_encoder_layers + "
                    f"segment_encoder_layers + decoder_layers = {total} (leave it unset)"
                )
            self.num_hidden_layers = total
        for stage in ("token", "decoder"):
            for field, default in (
                ("hidden_size", self.hidden_size),
                ("num_attention_heads", self.num_attention_heads),
                ("intermediate_size", self.intermediate_size),
            ):
                if getattr(self, f"{stage}_{field}") is None:
                    setattr(self, f"{stage}_{field}", default)
        if self.router_intermediate_size is None:
            self.router_intermediate_size = self.token_intermediate_size
        alpha, beta = self.prior_alpha, self.prior_beta
        if self.prior_mean is None and _is_number(alpha) and _is_number(beta) and alpha > 0 and beta > 0:
            self.prior_mean = alpha / (alpha + beta)
        if self.prior_mean is None:
            # The paper's best setting (LSLM Table 1: p = 0.7 with β = kl_weight = 1 on zh and ja); a low
            # prior (long segments) hurts English and Chinese (§4.1).
            self.prior_mean = 0.7

    def stage_head_dim(self, stage: str) -> int:
        """Head dim of the "token" or "decoder" stage: its width over its heads."""
        return getattr(self, f"{stage}_hidden_size") // getattr(self, f"{stage}_num_attention_heads")

    def check_fields(self) -> None:
        # The split first: num_hidden_layers is its sum, so a bad stage would be reported under that name.
        for name in ("token_encoder_layers", "segment_encoder_layers", "decoder_layers"):
            _check_int(name, getattr(self, name), high=MAX_COUNT)
        super().check_fields()
        _check_int("update_schedule", self.update_schedule, low=0)
        self._check_stages()
        parse_pooling_method(self.pooling)
        if self.pooling not in ("mean",) and not self.pooling.startswith("hops:"):
            raise ValueError(f"pooling={self.pooling!r} must be 'mean' or 'hops:N'")
        self._check_special_ids()
        self._check_prior()
        _check_number("kl_weight", self.kl_weight)
        if self.prior_loss not in PRIOR_LOSSES:
            raise ValueError(f"prior_loss={self.prior_loss!r} must be one of {', '.join(PRIOR_LOSSES)}")
        # Beyond 1e6 the Beta-Binomial is the Binomial to float32 precision; lgamma of larger sums loses it.
        _check_number("prior_concentration", self.prior_concentration, 0, 1e6, brackets="(]")
        if self.boundary_estimator not in BOUNDARY_ESTIMATORS:
            estimators = ", ".join(BOUNDARY_ESTIMATORS)
            raise ValueError(f"boundary_estimator={self.boundary_estimator!r} must be one of {estimators}")
        self._check_segment_end_loss()
        _check_int("segmental_flips", self.segmental_flips, low=0)
        if not isinstance(self.decoder_latest_segment, bool):
            raise ValueError(f"decoder_latest_segment={self.decoder_latest_segment!r} must be True or False")
        # The "threshold" rule closes where q_t >= threshold: 0 would close every byte whatever the router
        # says; 1 closes only where the router is sure (q_t == 1), as in ConceptMoE and DLCM.
        _check_number("boundary_threshold", self.boundary_threshold, 0, 1, brackets="(]")
        if self.boundary_rule not in BOUNDARY_RULES:
            rules = ", ".join(BOUNDARY_RULES)
            raise ValueError(f"boundary_rule={self.boundary_rule!r} must be one of {rules}")
        if self.boundary_source not in BOUNDARY_SOURCES:
            sources = ", ".join(BOUNDARY_SOURCES)
            raise ValueError(f"boundary_source={self.boundary_source!r} must be one of {sources}")
        _check_int("boundary_seed", self.boundary_seed, low=0, high=2**31 - 1)
        if self.sliding_window is not None or self.num_experts != 0:
            raise ValueError(
                f"sliding_window={self.sliding_window!r}, num_experts={self.num_experts!r}: LSLM's stages "
                "are dense full-attention transformers"
            )

    def _check_segment_end_loss(self) -> None:
        if not isinstance(self.segment_end_loss, bool):
            raise ValueError(f"segment_end_loss={self.segment_end_loss!r} must be True or False")
        if not self.segment_end_loss and self.boundary_estimator == "straight_through_targets":
            # That estimator's gradient is ℓ(<nxt>) − ℓ(next byte): without the <nxt> term it would
            # follow a loss the objective does not have.
            raise ValueError(
                "segment_end_loss=False with boundary_estimator='straight_through_targets': that estimator "
                "passes each decision through the <nxt> target's loss, which the objective then leaves out; "
                "pass segment_end_loss=True with it"
            )

    def _warn_unreachable_threshold(self) -> None:
        """A fixed threshold at or above the prior mean is one the KL term pulls q_t away from: inference
        would close (almost) no segment while training samples them at about `prior_mean`."""
        if self.boundary_rule != "threshold" or self.prior_mean > self.boundary_threshold:
            return
        logger.warning(
            f"boundary_threshold={self.boundary_threshold!r} with prior_mean={self.prior_mean!r} and "
            "boundary_rule='threshold': the KL term pulls q_t toward the prior, below the threshold, so "
            "inference would close almost no segment. Use boundary_rule='rate' or a lower threshold."
        )

    def _check_stages(self) -> None:
        for stage in ("token", "decoder"):
            width, heads = (
                getattr(self, f"{stage}_hidden_size"),
                getattr(self, f"{stage}_num_attention_heads"),
            )
            _check_int(f"{stage}_hidden_size", width)
            _check_int(f"{stage}_num_attention_heads", heads)
            if width % heads or (width // heads) % 2:
                raise ValueError(
                    f"{stage}_hidden_size={width} must be {stage}_num_attention_heads={heads} times an even "
                    "head dim"
                )
        for name in ("token_intermediate_size", "decoder_intermediate_size", "router_intermediate_size"):
            _check_int(name, getattr(self, name))

    def _check_special_ids(self) -> None:
        """Each special id is in the vocabulary and no two are equal. The model fills padding with
        pad_token_id and finds the sequence start and the segment markers by id, so those cannot be None;
        eos_token_id may be (no byte then ends a document, and generate stops at max_new_tokens)."""
        vocab_size = self.vocab_size
        owners: dict[int, str] = {}
        for name in SPECIAL_ID_FIELDS:
            value = getattr(self, name)
            if value is None and name == "eos_token_id":
                continue
            ids = list(value) if isinstance(value, list | tuple) else [value]
            if not (ids and all(_is_int(token_id) and 0 <= token_id < vocab_size for token_id in ids)):
                optional = "None or " if name == "eos_token_id" else ""
                raise ValueError(f"{name}={value!r} must be {optional}an id in [0, vocab_size={vocab_size})")
            for token_id in ids:
                if token_id in owners:
                    raise ValueError(
                        f"{name}={value!r} must differ from {owners[token_id]}={token_id}: LSLM tells its "
                        "special tokens apart by id"
                    )
                owners[token_id] = name

    def _check_prior(self) -> None:
        """Bernoulli(prior_mean), given directly or as the mean a / (a + b) of a Beta(a, b) prior."""
        alpha, beta = self.prior_alpha, self.prior_beta
        _check_number("prior_alpha", alpha, 0, brackets="(]", optional=True)
        _check_number("prior_beta", beta, 0, brackets="(]", optional=True)
        if (alpha is None) != (beta is None):
            raise ValueError(
                f"prior_alpha={alpha!r} and prior_beta={beta!r} must be given together (a Beta prior)"
            )
        if alpha is not None:
            beta_mean = alpha / (alpha + beta)
            if not 0 < beta_mean < 1:
                raise ValueError(
                    f"prior_alpha={alpha!r}, prior_beta={beta!r} give a prior mean of {beta_mean!r}, "
                    "which must be in (0, 1)"
                )
        _check_number("prior_mean", self.prior_mean, 0, 1, brackets="()")
        if alpha is not None and not math.isclose(self.prior_mean, alpha / (alpha + beta), rel_tol=1e-9):
            raise ValueError(
                f"prior_mean={self.prior_mean!r} disagrees with prior_alpha={alpha!r}, prior_beta={beta!r} "
                f"(mean {alpha / (alpha + beta)!r}); give one or the other"
            )


LSLMConfig.register_for_auto_class()
