"""The registry the conformance suite runs over; its remote-code lists are the file table of
docs/ARCHITECTURE.md, §6.

A family joins the suite by adding one `FamilySpec` to `FAMILIES`: a tiny fp32 config, its causal-LM
class, the LoRA targets it recommends, invalid config values that must raise, the remote code its
checkpoints carry, and — for families with learned boundaries — a context manager that forces a fixed
boundary pattern, so that comparisons whose two sides differ by rounding (eager vs sdpa) cannot flip a
boundary decision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


@contextlib.contextmanager
def no_forcing(model: torch.nn.Module) -> Iterator[None]:
    """For families without boundaries: nothing to force."""
    yield


@dataclass(frozen=True)
class FamilySpec:
    name: str
    # Returns a fresh tiny config; keyword overrides are applied on top (used for invalid values).
    make_config: Callable[..., Any]
    model_class: Callable[[], type]
    lora_target_modules: tuple[str, ...]
    # (field, bad value): constructing the config with it must raise ValueError naming the field.
    invalid_values: tuple[tuple[str, Any], ...]
    # The .py files of hf_concept.modeling a checkpoint of the family carries (one `*_CODE` tuple below).
    remote_code_files: tuple[str, ...]
    force_boundaries: Callable[[torch.nn.Module], contextlib.AbstractContextManager] = no_forcing
    # Output fields the Trainer must log for this family (besides the loss).
    logged_metrics: tuple[str, ...] = ()


# The remote code of each family: the auto_map modules (config, model, LSLM's tokenizer) and, transitively,
# the siblings they import with `from .x import`, which is what save_pretrained and the converters copy
# and what transformers loads. Declared here, once per family, so that an import that brings in (or drops)
# a file changes a family's checkpoints only together with this list (tests/test_remote_code_files.py).
BACKBONE_CODE = (
    "config_typos.py",
    "configuration_plain.py",
    "layers.py",
    "transformers_compat.py",
    "varlen.py",
)
PLAIN_CODE = (*BACKBONE_CODE, "causal_lm.py", "modeling_plain.py")
# The cache and loss-term plumbing of the families with a cache of their own (concept, Hidden Decoding, LSLM).
CACHE_CODE = ("family_cache.py", "forward_only_cache.py", "loss_terms.py")
# Documents, pooling and boundary math of the families with boundaries (concept, LSLM).
BOUNDARY_CODE = ("packing.py", "pooling.py", "ratio_step.py", "routing.py")
CONCEPT_CODE = (
    *BACKBONE_CODE,
    *CACHE_CODE,
    *BOUNDARY_CODE,
    "causal_lm.py",
    "concept_chunking.py",
    "concept_cache.py",
    "concept_config.py",
    "concept_ranking.py",
    "concept_stack.py",
    "concept_views.py",
    "modeling_plain.py",
    "concept_scan.py",
    "concept_smoothing.py",
)
CONCEPTMOE_CODE = (*CONCEPT_CODE, "configuration_conceptmoe.py", "modeling_conceptmoe.py")
DLCM_CODE = (
    *CONCEPT_CODE,
    "configuration_dlcm.py",
    "dlcm_stages.py",
    "modeling_dlcm.py",
    "dlcm_replication.py",
)
HIDDEN_DECODING_CODE = (
    *BACKBONE_CODE,
    *CACHE_CODE,
    "causal_lm.py",
    "configuration_hidden_decoding.py",
    "hidden_decoding_masks.py",
    "modeling_hidden_decoding.py",
    "hidden_decoding_cache.py",
    "hidden_decoding_layers.py",
    "hidden_decoding_streams.py",
)
LSLM_CODE = (
    *BACKBONE_CODE,
    *CACHE_CODE,
    *BOUNDARY_CODE,
    "lslm_boundary_rules.py",
    "configuration_lslm.py",
    "lslm_attention_layout.py",
    "lslm_generation.py",
    "lslm_layers.py",
    "lslm_layout.py",
    "lslm_loss.py",
    "lslm_outputs.py",
    "modeling_lslm.py",
    "lslm_segment_cache.py",
    "lslm_segmental.py",
    "lslm_estimators.py",
    "tokenization_lslm.py",
)


def _plain_config(**overrides: Any):
    from hf_concept.modeling.configuration_plain import PlainDecoderConfig

    values = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    values.update(overrides)
    return PlainDecoderConfig(**values)


def _plain_moe_config(**overrides: Any):
    values = dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        norm_topk_prob=False,
        qk_norm=True,
    )
    values.update(overrides)
    return _plain_config(**values)


def _plain_class() -> type:
    from hf_concept.modeling.modeling_plain import PlainDecoderForCausalLM

    return PlainDecoderForCausalLM


def _conceptmoe_config(**overrides: Any):
    from hf_concept.modeling.configuration_conceptmoe import ConceptMoEConfig

    values = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=5,
        encoder_layers=2,
        decoder_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        compression_ratio=2.0,
        pooling="first",
    )
    values.update(overrides)
    return ConceptMoEConfig(**values)


def _conceptmoe_mean_moe_config(**overrides: Any):
    values = dict(
        pooling="mean",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        norm_topk_prob=False,
        qk_norm=True,
        ratio_scope="sequence",
        # The concept layer (index 2) stays dense: with few concepts its experts see one row each, and
        # MKL's one-row products then depend on the weights' memory alignment, which differs after
        # loading (a 1e-8 drift that the bitwise fresh-process check would flag).
        mlp_only_layers=[2],
    )
    values.update(overrides)
    return _conceptmoe_config(**values)


def _conceptmoe_concept_topk_config(**overrides: Any):
    # §3.5 reallocation: a wider concept stack (in/out projections, more heads, wider experts) whose MoE
    # routes to more experts than the token stages.
    values = dict(
        num_experts=4,
        num_experts_per_tok=1,
        concept_num_experts_per_tok=3,
        moe_intermediate_size=16,
        concept_hidden_size=48,
        concept_num_attention_heads=6,
        concept_num_key_value_heads=3,
        concept_moe_intermediate_size=24,
        concept_intermediate_size=96,
        num_hidden_layers=5,
    )
    values.update(overrides)
    return _conceptmoe_config(**values)


def _conceptmoe_rank_window_config(**overrides: Any):
    # Decisions on local ranks (`concept_ranking`): a window shorter than the test sequences, so that the
    # cache carries a full window; "mean" pooling keeps an open chunk in the state as well. The dechunk
    # EMA is the conversion's (weight 1 in value, the probability's gradient), which it writes with ranks;
    # the fixed-chunk bonus reads absolute positions, which a cached call must continue.
    values = dict(
        pooling="mean",
        boundary_rank_window=4,
        boundary_noise="gaussian",
        dechunk_ema="straight_through",
        boundary_fixed_bonus=0.05,
    )
    values.update(overrides)
    return _conceptmoe_config(**values)


def _conceptmoe_class() -> type:
    from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM

    return ConceptMoEForCausalLM


@contextlib.contextmanager
def _fixed_chunks(model: torch.nn.Module) -> Iterator[None]:
    """ConceptMoE: every second token of each document opens a chunk while the context is open."""
    config = model.config
    saved = (config.chunking, config.compression_ratio)
    config.chunking, config.compression_ratio = "fixed", 2
    try:
        yield
    finally:
        config.chunking, config.compression_ratio = saved


def _hidden_decoding_config(**overrides: Any):
    from hf_concept.modeling.configuration_hidden_decoding import HiddenDecodingConfig

    values = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        num_streams=3,
        # Every kind once; a window of 5 expanded positions is shorter than the test sequences.
        stream_attention_layout=["intra", "local", "intra", "full"],
        sliding_window=5,
    )
    values.update(overrides)
    return HiddenDecodingConfig(**values)


def _hidden_decoding_token_block_config(**overrides: Any):
    """The conversion default: token-block cross-stream masks, token positions in every layer; the local
    window is 2 whole tokens (6 expanded positions)."""
    values = dict(
        cross_stream_mask="token_block",
        cross_stream_positions="token",
        intra_stream_positions="token",
        sliding_window=6,
    )
    values.update(overrides)
    return _hidden_decoding_config(**values)


def _hidden_decoding_shared_moe_config(**overrides: Any):
    values = dict(
        num_streams=2,
        stream_kv="shared",
        intra_stream_positions="token",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        norm_topk_prob=False,
        qk_norm=True,
    )
    values.update(overrides)
    return _hidden_decoding_config(**values)


def _hidden_decoding_class() -> type:
    from hf_concept.modeling.modeling_hidden_decoding import HiddenDecodingForCausalLM

    return HiddenDecodingForCausalLM


# ConceptMoE and DLCM log the sampled ratio, the inference one and the one expected under the sampler.
CONCEPT_METRICS = (
    "lm_loss",
    "aux_loss",
    "compression_ratio",
    "inference_compression_ratio",
    "sampled_compression_ratio",
)


def _dlcm_config(**overrides: Any):
    from hf_concept.modeling.configuration_dlcm import DLCMConfig

    values = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        # A wider concept stage with its own heads, and a cross-attention head dim of its own.
        concept_hidden_size=48,
        concept_num_attention_heads=6,
        concept_num_key_value_heads=3,
        cross_num_attention_heads=4,
        cross_num_key_value_heads=2,
        cross_head_dim=12,
        encoder_layers=1,
        concept_layers=2,
        decoder_layers=2,
        compression_ratio=2.0,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    values.update(overrides)
    return DLCMConfig(**values)


def _dlcm_rule_mup_config(**overrides: Any):
    # The W_s smoothing here, so that the suite covers both forms (the default spec runs "ema").
    values = dict(
        router="rule",
        rule_threshold=0.3,
        qk_norm=True,
        mup_base_width=16,
        ratio_scope="sequence",
        smoothing="linear",
    )
    values.update(overrides)
    return _dlcm_config(**values)


def _dlcm_rank_window_config(**overrides: Any):
    values = dict(boundary_rank_window=3, boundary_noise="none")
    values.update(overrides)
    return _dlcm_config(**values)


def _dlcm_class() -> type:
    from hf_concept.modeling.modeling_dlcm import DLCMForCausalLM

    return DLCMForCausalLM


def _lslm_config(**overrides: Any):
    from hf_concept.modeling.configuration_lslm import LSLMConfig

    values = dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        token_encoder_layers=2,
        segment_encoder_layers=2,
        decoder_layers=2,
        token_hidden_size=16,
        token_num_attention_heads=2,
        decoder_hidden_size=24,
        decoder_num_attention_heads=2,
        router_intermediate_size=32,
        max_position_embeddings=128,
        # A wider init spreads the untrained router's q away from 1/2, so segments have several bytes.
        initializer_range=0.1,
        boundary_threshold=0.45,
    )
    values.update(overrides)
    return LSLMConfig(**values)


def _lslm_hops_config(**overrides: Any):
    values = dict(pooling="hops:3", kl_weight=0.5, prior_alpha=1.0, prior_beta=3.0)
    values.update(overrides)
    return _lslm_config(**values)


def _lslm_class() -> type:
    from hf_concept.modeling.modeling_lslm import LSLMForCausalLM

    return LSLMForCausalLM


@contextlib.contextmanager
def _saturated_router(model: torch.nn.Module) -> Iterator[None]:
    """LSLM: the router's logits times 1e4, so q is 0 or 1 and rounding cannot move a decision."""
    router = model.model.router
    original = router.forward
    router.forward = lambda token_states: original(token_states) * 1e4
    try:
        yield
    finally:
        del router.forward


FAMILIES: list[FamilySpec] = [
    FamilySpec(
        name="plain",
        make_config=_plain_config,
        model_class=_plain_class,
        lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
        remote_code_files=PLAIN_CODE,
        invalid_values=(("num_key_value_heads", 3), ("hidden_size", 0), ("rms_norm_eps", -1.0)),
    ),
    FamilySpec(
        name="plain-moe",
        make_config=_plain_moe_config,
        model_class=_plain_class,
        lora_target_modules=("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"),
        remote_code_files=PLAIN_CODE,
        invalid_values=(("num_experts_per_tok", 9), ("moe_intermediate_size", 0)),
    ),
    FamilySpec(
        name="conceptmoe-first",
        make_config=_conceptmoe_config,
        model_class=_conceptmoe_class,
        lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
        remote_code_files=CONCEPTMOE_CODE,
        invalid_values=(("pooling", "max"), ("compression_ratio", 1.0), ("joint_decoding_layers", 3)),
        force_boundaries=_fixed_chunks,
        logged_metrics=CONCEPT_METRICS,
    ),
    FamilySpec(
        name="conceptmoe-mean",
        make_config=_conceptmoe_mean_moe_config,
        model_class=_conceptmoe_class,
        lora_target_modules=("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"),
        remote_code_files=CONCEPTMOE_CODE,
        invalid_values=(("dechunk_residual", "input"), ("concept_loop", [0, 2, 1]), ("encoder_layers", 4)),
        force_boundaries=_fixed_chunks,
        logged_metrics=CONCEPT_METRICS,
    ),
    FamilySpec(
        name="conceptmoe-concept-topk",
        make_config=_conceptmoe_concept_topk_config,
        model_class=_conceptmoe_class,
        lora_target_modules=("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"),
        remote_code_files=CONCEPTMOE_CODE,
        invalid_values=(
            ("concept_num_experts_per_tok", 5),
            ("concept_num_experts_per_tok", 0),
            ("concept_num_key_value_heads", 4),
            ("concept_moe_intermediate_size", -1),
        ),
        force_boundaries=_fixed_chunks,
        logged_metrics=CONCEPT_METRICS,
    ),
    FamilySpec(
        name="conceptmoe-rank-window",
        make_config=_conceptmoe_rank_window_config,
        model_class=_conceptmoe_class,
        lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
        remote_code_files=CONCEPTMOE_CODE,
        invalid_values=(
            ("boundary_rank_window", 1),
            ("boundary_rank_window", 4.5),
            ("boundary_noise", "bernoulli"),
            ("dechunk_ema", "none"),
            ("boundary_fixed_bonus", -1.0),
        ),
        force_boundaries=_fixed_chunks,
        logged_metrics=CONCEPT_METRICS,
    ),
    FamilySpec(
        name="hidden-decoding",
        make_config=_hidden_decoding_config,
        model_class=_hidden_decoding_class,
        lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
        remote_code_files=HIDDEN_DECODING_CODE,
        invalid_values=(
            ("num_streams", 0),
            ("stream_attention_layout", ["intra", "cross", "intra", "full"]),
            ("intra_stream_positions", "absolute"),
        ),
    ),
    FamilySpec(
        name="hidden-decoding-token-block",
        make_config=_hidden_decoding_token_block_config,
        model_class=_hidden_decoding_class,
        lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
        remote_code_files=HIDDEN_DECODING_CODE,
        invalid_values=(
            ("cross_stream_mask", "blockwise"),
            ("cross_stream_positions", "absolute"),
            ("sliding_window", 5),
        ),
    ),
    FamilySpec(
        name="hidden-decoding-shared-moe",
        make_config=_hidden_decoding_shared_moe_config,
        model_class=_hidden_decoding_class,
        lora_target_modules=("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"),
        remote_code_files=HIDDEN_DECODING_CODE,
        invalid_values=(("stream_kv", "pooled"), ("sliding_window", None), ("tie_word_embeddings", True)),
    ),
    FamilySpec(
        name="dlcm",
        make_config=_dlcm_config,
        model_class=_dlcm_class,
        lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
        remote_code_files=DLCM_CODE,
        invalid_values=(
            ("router", "linear"),
            ("concept_layers", 0),
            ("cross_head_dim", 7),
            ("smoothing", "mean"),
        ),
        force_boundaries=_fixed_chunks,
        logged_metrics=CONCEPT_METRICS,
    ),
    FamilySpec(
        name="dlcm-rank-window",
        make_config=_dlcm_rank_window_config,
        model_class=_dlcm_class,
        lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
        remote_code_files=DLCM_CODE,
        invalid_values=(("boundary_rank_window", 0), ("router", "rule")),
        force_boundaries=_fixed_chunks,
        logged_metrics=CONCEPT_METRICS,
    ),
    FamilySpec(
        name="dlcm-rule-mup",
        make_config=_dlcm_rule_mup_config,
        model_class=_dlcm_class,
        lora_target_modules=("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"),
        remote_code_files=DLCM_CODE,
        invalid_values=(("mup_base_width", 0), ("rule_threshold", 1.5), ("num_experts", 4)),
        force_boundaries=_fixed_chunks,
        logged_metrics=CONCEPT_METRICS,
    ),
    FamilySpec(
        name="lslm",
        make_config=_lslm_config,
        model_class=_lslm_class,
        lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
        remote_code_files=LSLM_CODE,
        invalid_values=(("pooling", "first"), ("prior_mean", 1.5), ("decoder_hidden_size", 30)),
        force_boundaries=_saturated_router,
        logged_metrics=("lm_loss", "kl_loss", "boundary_rate", "compression_ratio"),
    ),
    FamilySpec(
        name="lslm-every",
        make_config=lambda **overrides: _lslm_config(**{"boundary_source": "every", **overrides}),
        model_class=_lslm_class,
        lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
        remote_code_files=LSLM_CODE,
        invalid_values=(("boundary_source", "none"), ("boundary_seed", -1)),
        force_boundaries=_saturated_router,
        logged_metrics=("lm_loss", "kl_loss", "boundary_rate", "compression_ratio"),
    ),
    FamilySpec(
        name="lslm-random",
        make_config=lambda **overrides: _lslm_hops_config(**{"boundary_source": "random", **overrides}),
        model_class=_lslm_class,
        lora_target_modules=("q_proj", "v_proj", "fc_in", "fc_out"),
        remote_code_files=LSLM_CODE,
        invalid_values=(("boundary_source", "Router"),),
        force_boundaries=_saturated_router,
        logged_metrics=("lm_loss", "kl_loss", "boundary_rate", "compression_ratio"),
    ),
    FamilySpec(
        name="lslm-hops",
        make_config=_lslm_hops_config,
        model_class=_lslm_class,
        lora_target_modules=("q_proj", "v_proj", "fc_in", "fc_out"),
        remote_code_files=LSLM_CODE,
        invalid_values=(("kl_weight", -1.0), ("update_schedule", -1), ("boundary_threshold", 1.5)),
        force_boundaries=_saturated_router,
        logged_metrics=("lm_loss", "kl_loss", "boundary_rate", "compression_ratio"),
    ),
]
