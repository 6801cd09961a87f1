"""What the configs of the two concept families, ConceptMoE and DLCM, share: `ConceptConfig`.

Both split a token encoder and decoder around a concept stage, place boundaries with a router (or fixed
chunks) trained towards a compression ratio, and optionally give the concept stage its own width and
heads. The fields for that, the outputs `generate` and evaluation leave out, and the checks of those
fields are written here once; each family's config subclasses `ConceptConfig`, declares its own
`compression_ratio` default, routers and remaining fields, and orders its checks.

Only the concept families import this module, so only their checkpoints carry it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .configuration_plain import PlainDecoderConfig, _check_number, _is_int, _is_number
from .transformers_compat import CACHE_KEYS

CHUNKING_KINDS = ("dynamic", "fixed")
BOUNDARY_NOISE_KINDS = ("bernoulli", "gaussian", "none")
RATIO_SCOPES = ("global", "batch", "sequence")


class ConceptConfig(PlainDecoderConfig):
    """Fields and checks of a concept-level config; a family's config sets `auto_model_entry`, the
    "module.Class" of its `AutoModel` entry in `auto_map`.

    `boundary_rank_window` (default None): W > 1 makes the learned router's decisions read each
    probability's rank among its document's last W tokens instead of the probability itself
    (`concept_ranking`): `boundary_threshold` = 1 − 1/R then opens about one concept per R tokens in every
    text of W tokens or more, whatever its language, where one threshold on the probabilities spends the
    ratio unevenly over a mix. Needs `chunking="dynamic"`, a learned router (not DLCM's "rule") and
    `boundary_noise` "none" or "gaussian" (a Bernoulli draw of a rank would open one token in two).

    `boundary_fixed_bonus` (default 0): b > 0 adds b to the router's probability at the tokens where fixed
    chunks open (every R-th token of a document, R = `compression_ratio`, an integer) before the
    probabilities are ranked, so that a learned router starts from fixed chunks' regular layout and moves
    a concept off it only where its probabilities differ by more than b; the straight-through factor and
    the ratio loss still read the probability itself. Why: on a compressed conversion, a freely learned
    router fell behind fixed chunks while one held near them did not (REPRODUCTION.md, SmolLM2 section).
    Needs `boundary_rank_window`.
    """

    auto_model_entry: ClassVar[str]
    keys_to_ignore_at_inference: ClassVar[list[str]] = [
        *CACHE_KEYS,
        "lm_loss",
        "aux_loss",
        "compression_ratio",
        "inference_compression_ratio",
        "sampled_compression_ratio",
        "boundary_prob_mean",
        "hidden_states",
    ]

    encoder_layers: int = 2
    decoder_layers: int = 2
    chunking: str = "dynamic"
    router: str = "cosine"
    boundary_noise: str = "bernoulli"
    boundary_tau: float = 6.0
    boundary_sigma: float = 0.1
    boundary_threshold: float = 0.5
    boundary_rank_window: int | None = None
    boundary_fixed_bonus: float = 0.0
    concept_hidden_size: int | None = None
    concept_num_attention_heads: int | None = None
    concept_num_key_value_heads: int | None = None
    concept_intermediate_size: int | None = None
    aux_loss_weight: float = 0.03
    ratio_scope: str = "global"

    def __post_init__(self, **kwargs: Any) -> None:
        # The parent merges this with any saved auto_map and keeps the family's AutoModel entry.
        auto_map = {"AutoModel": self.auto_model_entry}
        auto_map.update(kwargs.pop("auto_map", None) or {})
        kwargs["auto_map"] = auto_map
        super().__post_init__(**kwargs)

    def _check_one_of(self, choices: dict[str, tuple[str, ...]]) -> None:
        """Raise ValueError naming the first field (in `choices` order) whose value is not allowed."""
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name}={value!r} must be one of {allowed}")

    def _check_compression_ratio(self, dynamic_rule_note: str = "") -> None:
        """R tokens per concept: an integer in [1, max_position_embeddings] for fixed chunks, a number in
        (1, max_position_embeddings] for learned ones (`dynamic_rule_note` ends the latter's rule in the
        error message)."""
        ratio, limit = self.compression_ratio, self.max_position_embeddings
        # Beyond max_position_embeddings not even the longest sequence holds one concept. The ratio loss
        # divides by R - 1, so learned boundaries need R > 1; fixed chunks have no ratio loss, and R = 1
        # (one concept per token) is well defined there.
        if self.chunking == "fixed":
            valid = _is_number(ratio) and 1 <= ratio <= limit and float(ratio).is_integer()
            rule = f"an integer in [1, max_position_embeddings={limit}] for chunking='fixed'"
        else:
            valid = _is_number(ratio) and 1 < ratio <= limit
            rule = f"a finite number in (1, max_position_embeddings={limit}]{dynamic_rule_note}"
        if not valid:
            raise ValueError(f"compression_ratio={ratio!r} must be {rule} (tokens per concept)")

    def _check_boundary_scales(self) -> None:
        # τ sharpens p to p^(1/τ) and σ scales Gaussian noise: any finite positive value is meaningful.
        _check_number("boundary_tau", self.boundary_tau, 0, brackets="(]")
        _check_number("boundary_sigma", self.boundary_sigma)
        _check_number("aux_loss_weight", self.aux_loss_weight)
        self._check_rank_window()
        self._check_fixed_bonus()

    def _check_fixed_bonus(self) -> None:
        bonus = self.boundary_fixed_bonus
        _check_number("boundary_fixed_bonus", bonus)
        if not bonus:
            return
        # The bonus marks fixed chunks' openings among ranked probabilities: both must exist.
        if not self.boundary_rank_window:
            raise ValueError(
                f"boundary_fixed_bonus={bonus!r} shifts probabilities before they are ranked: it needs "
                "boundary_rank_window"
            )
        ratio = self.compression_ratio
        if not (_is_number(ratio) and float(ratio).is_integer()):
            raise ValueError(
                f"boundary_fixed_bonus={bonus!r} marks every R-th token: it needs an integer "
                f"compression_ratio, not {ratio!r}"
            )

    def _check_rank_window(self) -> None:
        window = self.boundary_rank_window
        if window is None:
            return
        limit = self.max_position_embeddings
        if not (_is_int(window) and 2 <= window <= limit):
            raise ValueError(
                f"boundary_rank_window={window!r} must be None or an integer in [2, "
                f"max_position_embeddings={limit}]"
            )
        clash = {
            "chunking": (self.chunking, "fixed"),
            "router": (getattr(self, "router", None), "rule"),
            "boundary_noise": (self.boundary_noise, "bernoulli"),
        }
        for name, (value, refused) in clash.items():
            if value == refused:
                raise ValueError(
                    f"boundary_rank_window={window} ranks a learned router's probabilities: it needs "
                    f"{name} other than {refused!r} (boundary_noise 'none' or 'gaussian', chunking "
                    "'dynamic', a learned router)"
                )
