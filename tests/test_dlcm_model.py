"""DLCM model family: the two forms of concept cross-attention agree, the null concept, smoothing, the
rule router, losses and configuration errors."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.testing import assert_close

from hf_concept.modeling.configuration_dlcm import DLCMConfig
from hf_concept.modeling.modeling_dlcm import DLCMForCausalLM, mup_stage_of
from hf_concept.modeling.routing import rule_boundaries

BACKBONE = dict(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    concept_hidden_size=48,
    concept_num_attention_heads=6,
    concept_num_key_value_heads=3,
    cross_num_attention_heads=4,
    cross_num_key_value_heads=2,
    cross_head_dim=12,
    encoder_layers=2,
    concept_layers=2,
    decoder_layers=2,
    compression_ratio=2.0,
    max_position_embeddings=128,
    pad_token_id=0,
)


def dlcm(seed: int = 0, attn: str = "sdpa", **overrides) -> DLCMForCausalLM:
    torch.manual_seed(seed)
    config = DLCMConfig(**{**BACKBONE, **overrides})
    config._attn_implementation = attn
    model = DLCMForCausalLM(config).eval()
    if model.model.smoothing is not None:
        with torch.no_grad():
            # Non-zero W_s, so that the tests see the linear smoothing act.
            model.model.smoothing.weight.normal_(0.0, 0.1)
    return model


def ids(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, BACKBONE["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, input_ids, use_cache: bool, **kwargs) -> torch.Tensor:
    return model(input_ids=input_ids, use_cache=use_cache, **kwargs).logits


@pytest.mark.parametrize(("router", "attn"), list(itertools.product(["cosine", "rule"], ["eager", "sdpa"])))
def test_replicated_and_counted_cross_attention_agree(router, attn):
    """Without a cache the K/V are replicated to positions (SDPA); with one (and the counted form forced),
    each concept is stored once with its count (+ log count). Left-padded and packed: equal within 1e-5."""
    model = dlcm(attn=attn, router=router, rule_threshold=0.3)
    input_ids = ids(2, 12)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0
    real = attention_mask.bool()
    results = {}
    for form in ("replicated", "counted"):
        model.config.cross_attention_form = form
        for use_cache in (False, True):
            results[form, use_cache] = logits(model, input_ids, use_cache, attention_mask=attention_mask)
    reference = results["replicated", False]
    for key, value in results.items():
        assert_close(value[real], reference[real], atol=1e-5, rtol=1e-5, msg=str(key))
    # Packed documents: both forms equal the documents run apart.
    packed_positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    for form in ("replicated", "counted"):
        model.config.cross_attention_form = form
        apart = torch.cat(
            [logits(model, input_ids[:1, :5], False), logits(model, input_ids[:1, 5:], False)], dim=1
        )
        for use_cache in (False, True):
            packed = logits(model, input_ids[:1], use_cache, position_ids=packed_positions)
            assert_close(packed, apart, atol=1e-5, rtol=1e-5)


def test_first_chunk_reads_the_null_concept_and_later_tokens_read_closed_chunks():
    model = dlcm(chunking="fixed", compression_ratio=4)
    input_ids = ids(1, 12)
    before = logits(model, input_ids, False)
    with torch.no_grad():
        model.model.null_concept.add_(1.0)
    after = logits(model, input_ids, False)
    moved = (after - before).abs().amax(dim=-1)[0]  # (L,)
    # Chunks open at 0, 4, 8: tokens 0-3 carry only the null concept; later tokens still weigh the null
    # positions of their document (replication: every position carried something), so all move.
    assert (moved[:4] > 1e-4).all() and (moved[4:] > 0).all()


def test_smoothing_is_the_identity_at_init_and_mixes_only_earlier_concepts():
    torch.manual_seed(0)
    fresh = DLCMForCausalLM(DLCMConfig(**BACKBONE, smoothing="linear")).eval()
    assert torch.count_nonzero(fresh.model.smoothing.weight) == 0
    model = dlcm(chunking="fixed", compression_ratio=2, smoothing="linear")
    input_ids = ids(1, 10)
    base = logits(model, input_ids, False)
    with torch.no_grad():
        model.model.smoothing.weight.zero_()
    unsmoothed = logits(model, input_ids, False)
    moved = (base - unsmoothed).abs().amax(dim=-1)[0]
    # Concepts 0 (tokens 0-1) and 1 (tokens 2-3) become readable at tokens 2 and 4; concept 1 is the first
    # with a predecessor to mix in, so smoothing first changes what token 4 reads.
    assert moved[:4].max() == 0 and moved[4:].min() > 1e-6


def test_rule_router_has_no_parameters_and_thresholds_the_dissimilarity():
    model = dlcm(router="rule", rule_threshold=0.2)
    assert not any(name.startswith("model.chunker.") for name, _ in model.named_parameters())
    input_ids = ids(2, 12)
    with torch.no_grad():
        outputs = model.model(input_ids=input_ids, use_cache=False)
    expected = rule_boundaries(outputs.boundary_probs, 0.2)
    expected[:, 0] = True
    assert torch.equal(outputs.boundaries, expected)


def test_loss_is_lm_plus_weighted_ratio_loss_and_linear_smoothing_keeps_the_lm_loss_off_the_router():
    model = dlcm(smoothing="linear").train()
    input_ids = ids(2, 12)
    outputs = model(input_ids=input_ids, labels=input_ids)
    assert_close(outputs.loss, outputs.lm_loss + model.config.aux_loss_weight * outputs.aux_loss)
    # Under the W_s form nothing downstream reads the probabilities: only the ratio loss trains the router.
    model.zero_grad()
    outputs = model(input_ids=input_ids)
    vocab = model.config.vocab_size
    lm_loss = torch.nn.functional.cross_entropy(
        outputs.logits[:, :-1].reshape(-1, vocab), input_ids[:, 1:].reshape(-1)
    )
    lm_loss.backward()
    assert model.model.concept_in_proj.weight.grad.abs().max() > 0
    router = model.model.chunker.boundary_query.weight.grad
    assert router is None or router.abs().max() == 0, "the LM loss reached the router"
    model.zero_grad()
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    assert model.model.chunker.boundary_query.weight.grad.abs().max() > 0, (
        "the ratio loss did not reach the router"
    )


def test_fixed_chunking_realises_the_ratio():
    model = dlcm(chunking="fixed", compression_ratio=4)
    outputs = model(input_ids=ids(2, 16), labels=ids(2, 16))
    assert outputs.compression_ratio.item() == 4.0 and outputs.aux_loss.item() == 0.0


def test_mup_stages_and_output_scaling():
    assert mup_stage_of("model.encoder_layers.0.self_attn.q_proj.weight") == "token"
    assert mup_stage_of("model.decoder_layers.1.cross_attn.q_proj.weight") == "token"
    assert mup_stage_of("model.decoder_layers.1.cross_attn.k_proj.weight") == "concept"
    assert mup_stage_of("model.concept_layers.0.mlp.up_proj.weight") == "concept"
    assert mup_stage_of("model.concept_in_proj.weight") == "concept"
    for other in ("model.embed_tokens.weight", "lm_head.weight", "model.null_concept", "model.norm.weight"):
        assert mup_stage_of(other) is None
    assert mup_stage_of("model.decoder_layers.1.cross_attn.k_norm.weight") is None
    standard, scaled = dlcm(seed=3), dlcm(seed=3, mup_base_width=16)
    scaled.load_state_dict(standard.state_dict())
    input_ids = ids(1, 8)
    # d_token = 32 = 2 × base: logits are halved.
    assert_close(logits(scaled, input_ids, False), logits(standard, input_ids, False) / 2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(num_hidden_layers=5), "num_hidden_layers=5"),
        (dict(router="linear"), "router='linear'"),
        (dict(concept_layers=0), "concept_layers=0"),
        (dict(cross_num_key_value_heads=3), "cross_num_key_value_heads=3"),
        (dict(concept_head_dim=7), "concept_head_dim=7"),
        (dict(sliding_window=4), "sliding_window=4"),
        (dict(num_experts=4), "num_experts=4"),
        (dict(compression_ratio=1.0), "compression_ratio=1.0"),
        (dict(chunking="fixed", compression_ratio=2.5), "compression_ratio=2.5"),
        (dict(mup_base_width=0), "mup_base_width=0"),
        (dict(mup_concept_learning_rate=0.0), "mup_concept_learning_rate=0.0"),
    ],
)
def test_invalid_configs_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        DLCMConfig(**{**BACKBONE, **overrides})


def test_derived_stage_defaults_and_round_trip(tmp_path):
    config = DLCMConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_attention_heads=4)
    assert config.num_hidden_layers == 8 and config.concept_hidden_size == 32
    assert (
        config.concept_head_dim == 8 and config.cross_head_dim == 8 and config.concept_intermediate_size == 64
    )
    wide = DLCMConfig(**{**BACKBONE, "concept_intermediate_size": None})
    assert wide.concept_intermediate_size == 48 * 48 // 32
    wide.save_pretrained(tmp_path)
    loaded = DLCMConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == wide.to_dict()


def test_decoder_mlp_width_is_its_own_field_and_the_planner_counts_it():
    from hf_concept.planning import DLCMSpec, parameter_count

    model = dlcm(decoder_intermediate_size=40)
    assert model.model.decoder_layers[0].mlp.up_proj.out_features == 40
    assert model.model.encoder_layers[0].mlp.up_proj.out_features == BACKBONE["intermediate_size"]
    expected = sum(parameter.numel() for parameter in model.parameters())
    assert parameter_count(DLCMSpec.from_config(model.config)) == expected


def test_gpu_varlen_wiring_gives_the_same_logits_with_a_stand_in_kernel():
    """Under attn_implementation="hf_concept_varlen" the replicated cross-attention (and every token and
    concept layer) packs documents for torch's varlen kernel; here `varlen_reference` of the same contract
    takes its place, and the logits equal the SDPA path (padded and packed)."""
    from hf_concept.modeling.varlen import use_varlen_kernel, varlen_reference

    # The replicated form is what the varlen kernel runs.
    model = dlcm(cross_attention_form="replicated")
    input_ids = ids(2, 12)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], list(range(12))])
    cases = [dict(attention_mask=attention_mask), dict(position_ids=position_ids)]
    expected = [logits(model, input_ids, False, **case) for case in cases]
    calls = []

    def stand_in(*args, **kwargs):
        calls.append(1)
        return varlen_reference(*args, **kwargs)

    model.set_attn_implementation("hf_concept_varlen")
    with use_varlen_kernel(stand_in):
        for case, reference in zip(cases, expected, strict=True):
            real = case.get("attention_mask", torch.ones_like(input_ids)).bool()
            assert_close(logits(model, input_ids, False, **case)[real], reference[real], atol=1e-5, rtol=1e-5)
    config = model.config
    layers = config.encoder_layers + config.concept_layers + 2 * config.decoder_layers
    assert len(calls) == 2 * layers


def test_a_fresh_cached_prefill_reads_by_replication_and_decodes_by_counts():
    """A prefill into an empty cache in the replicated form stores each row's counts at its last token
    without a (B, L, N) table; continuing calls use the counted form. Same logits."""
    model = dlcm(cross_attention_form="replicated")
    input_ids = ids(2, 14)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    full = logits(model, input_ids, False, attention_mask=attention_mask)
    with torch.no_grad():
        prefill = model(input_ids=input_ids[:, :9], attention_mask=attention_mask[:, :9], use_cache=True)
        assert prefill.cache.state.read_counts.shape[1] == 1 + prefill.cache.num_concept_slots
        rest = model(
            input_ids=input_ids[:, 9:],
            attention_mask=attention_mask,
            cache=prefill.cache,
            use_cache=True,
        ).logits
    real = attention_mask.bool()
    both = torch.cat([prefill.logits, rest], dim=1)
    assert_close(both[real], full[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "partial",
    [
        dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_attention_heads=4),
        dict(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            cross_num_attention_heads=8,
        ),
        dict(BACKBONE, concept_intermediate_size=None, decoder_intermediate_size=None, cross_head_dim=None),
    ],
)
def test_planner_and_config_derive_the_same_stage_defaults(partial):
    from hf_concept.planning import DLCMSpec

    spec, config = DLCMSpec.from_dict(partial), DLCMConfig(**partial)
    for name, value in spec.to_dict().items():
        assert value == getattr(config, name), name
