"""ConceptMoE model family: exactness against the plain family, causality, packing, padding, options."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from hf_concept.modeling.configuration_conceptmoe import ConceptMoEConfig
from hf_concept.modeling.configuration_plain import PlainDecoderConfig
from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM
from hf_concept.modeling.modeling_plain import PlainDecoderForCausalLM
from hf_concept.modeling.routing import RatioAccumulator, ratio_loss

BACKBONE = dict(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    pad_token_id=0,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
# Mistral-like: every layer sliding, window shorter than the test sequences.
SLIDING = dict(sliding_window=4)


def concept_model(seed: int = 0, **overrides) -> ConceptMoEForCausalLM:
    torch.manual_seed(seed)
    values = dict(BACKBONE, encoder_layers=2, decoder_layers=2, compression_ratio=2.0)
    values.update(overrides)
    return ConceptMoEForCausalLM(ConceptMoEConfig(**values)).eval()


def plain_to_concept_state(plain_state: dict, encoder: int, concept: int) -> dict:
    """Rename the plain family's tensors to ConceptMoE's module tree."""
    renamed = {}
    for name, tensor in plain_state.items():
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers.") :].split(".", 1)
            index = int(index)
            if index < encoder:
                name = f"model.encoder_layers.{index}.{rest}"
            elif index < encoder + concept:
                name = f"model.concept_layers.{index - encoder}.{rest}"
            else:
                name = f"model.decoder_layers.{index - encoder - concept}.{rest}"
        renamed[name] = tensor
    return renamed


def ids(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, BACKBONE["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("backbone", [{}, MOE, SLIDING], ids=["dense", "moe", "sliding"])
def test_every_token_a_concept_reproduces_the_plain_model(backbone):
    torch.manual_seed(0)
    plain = PlainDecoderForCausalLM(PlainDecoderConfig(**BACKBONE, **backbone)).eval()
    model = concept_model(
        seed=1, chunking="fixed", compression_ratio=1, pooling="first", dechunk_residual="delta", **backbone
    )
    missing, unexpected = model.load_state_dict(
        plain_to_concept_state(plain.state_dict(), 2, 2), strict=False
    )
    assert not unexpected
    assert all(name.startswith("model.chunker.") or ".concept_" in name for name in missing), missing
    input_ids = ids(2, 12)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :5] = 0
    with torch.no_grad():
        expected = plain(input_ids=input_ids, attention_mask=attention_mask).logits
        actual = model(input_ids=input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    assert_close(actual[real], expected[real], atol=1e-5, rtol=0)
    packed_positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with torch.no_grad():
        expected = plain(input_ids=input_ids[:1], position_ids=packed_positions).logits
        actual = model(input_ids=input_ids[:1], position_ids=packed_positions).logits
    assert_close(actual, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pooling", ["first", "sum", "mean"])
@pytest.mark.parametrize("router", ["cosine", "linear"])
def test_changing_later_tokens_never_moves_earlier_logits(pooling, router):
    model = concept_model(pooling=pooling, router=router)
    input_ids = ids(2, 14, seed=2)
    with torch.no_grad():
        reference = model(input_ids=input_ids)
        assert 1.0 < float(reference.compression_ratio) < 14.0
        for cut in (0, 3, 8):
            perturbed = input_ids.clone()
            perturbed[:, cut + 1 :] = ids(2, 13 - cut, seed=3 + cut)
            changed = model(input_ids=perturbed).logits
            assert_close(changed[:, : cut + 1], reference.logits[:, : cut + 1], atol=1e-6, rtol=0)
            assert not torch.allclose(changed[:, cut + 1 :], reference.logits[:, cut + 1 :])


@pytest.mark.parametrize("pooling", ["first", "sum", "mean"])
def test_packed_row_equals_documents_alone_and_left_padding_equals_row_alone(pooling):
    model = concept_model(pooling=pooling, **MOE)
    documents = [ids(6, seed=4), ids(9, seed=5), ids(3, seed=6)]
    packed = torch.cat(documents)[None]
    positions = torch.cat([torch.arange(len(doc)) for doc in documents])[None]
    with torch.no_grad():
        packed_logits = model(input_ids=packed, position_ids=positions).logits
        separate = torch.cat([model(input_ids=doc[None]).logits for doc in documents], dim=1)
        assert_close(packed_logits, separate, atol=1e-5, rtol=0)
        row = documents[1]
        padded = torch.cat([torch.zeros(4, dtype=torch.long), row])[None]
        mask = torch.cat([torch.zeros(4, dtype=torch.long), torch.ones_like(row)])[None]
        padded_logits = model(input_ids=padded, attention_mask=mask).logits[:, 4:]
        assert_close(padded_logits, model(input_ids=row[None]).logits, atol=1e-5, rtol=0)


def test_first_pooling_reads_own_chunk_and_sum_waits_for_the_chunk_to_close():
    """With fixed chunks of 2, token 1's logits depend on token 0 through the concept path for "first"
    only: under "sum" token 1 may not read its own (still open) chunk, so removing the concept stack's
    contribution changes nothing there."""
    for pooling, reads_own_chunk in (("first", True), ("sum", False)):
        model = concept_model(chunking="fixed", pooling=pooling, joint_decoding_layers=0)
        input_ids = ids(1, 6, seed=7)
        with torch.no_grad():
            reference = model(input_ids=input_ids).logits
            for parameter in model.model.concept_layers.parameters():
                parameter.mul_(2.0)
            changed = model(input_ids=input_ids).logits
        moved = not torch.allclose(changed[0, 1], reference[0, 1])
        assert moved == reads_own_chunk, pooling
        # Token 2 opens the second chunk: it reads concept 0 (sum) or concept 1 (first).
        assert not torch.allclose(changed[0, 2], reference[0, 2])


def test_fixed_chunking_has_no_aux_loss_and_realises_the_ratio():
    model = concept_model(chunking="fixed", compression_ratio=3)
    input_ids = ids(2, 12, seed=8)
    outputs = model(input_ids=input_ids, labels=input_ids, output_hidden_states=True)
    assert list(outputs.keys())[:2] == ["loss", "logits"]
    # Embeddings, then one per layer (transformers' count): 2 encoder, 2 concept, 2 decoder (normed last).
    assert len(outputs.hidden_states) == model.config.num_hidden_layers + 1 == 7
    assert float(outputs.aux_loss) == 0.0
    assert_close(outputs.compression_ratio, torch.tensor(3.0))
    assert_close(outputs.loss, outputs.lm_loss + 0.0, atol=1e-6, rtol=0)


@pytest.mark.parametrize("scope", ["global", "batch", "sequence"])
def test_loss_adds_the_weighted_ratio_loss(scope):
    model = concept_model(ratio_scope=scope, aux_loss_weight=0.5, boundary_noise="none").train()
    input_ids = ids(2, 10, seed=9)
    outputs = model(input_ids=input_ids, labels=input_ids, output_hidden_states=False)
    base = model.model(input_ids=input_ids)
    mask = torch.ones_like(input_ids, dtype=torch.bool)
    expected = ratio_loss(
        base.boundary_probs, base.boundaries, mask, target_ratio=2.0, scope=scope, starts=base.document_starts
    ).loss
    assert_close(outputs.aux_loss, expected.detach(), atol=1e-6, rtol=0)
    assert_close(outputs.loss, outputs.lm_loss + 0.5 * expected, atol=1e-6, rtol=0)
    if scope == "global":
        # Under a Trainer (num_items_in_batch given) without the step's running counts, a micro-batch of a
        # larger step (18 of 36 label tokens) takes its own statistics: the batch scope's share.
        unplanned = model(input_ids=input_ids, labels=input_ids, num_items_in_batch=36)
        assert_close(unplanned.aux_loss, expected.detach() * 18 / 36, atol=1e-6, rtol=0)
        model.ratio_accumulator = RatioAccumulator(1)
        model.ratio_accumulator.reset(step_token_count=input_ids.numel())
    scaled = model(input_ids=input_ids, labels=input_ids, num_items_in_batch=36)
    # The global share is the whole step's loss (one micro-batch); the others weigh 18 of 36 labels.
    factor = 1.0 if scope == "global" else 18 / 36
    assert_close(scaled.aux_loss, expected.detach() * factor, atol=1e-6, rtol=0)
    scaled.loss.backward()
    assert model.model.chunker.boundary_query.weight.grad.abs().sum() > 0


def test_concept_loop_and_wider_concept_model_run_and_train():
    model = concept_model(concept_loop=[0, 2, 2], concept_hidden_size=48, num_hidden_layers=6).train()
    assert model.config.concept_layer_schedule() == [0, 1, 0, 1, 0, 1]
    assert model.model.concept_in_proj.weight.shape == (48, 32)
    assert model.model.concept_layers[0].self_attn.q_proj.weight.shape == (32, 48)
    input_ids = ids(2, 10, seed=10)
    outputs = model(input_ids=input_ids, labels=input_ids)
    outputs.loss.backward()
    assert torch.isfinite(outputs.loss)
    assert model.model.concept_out_proj.weight.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        full = model(input_ids=input_ids).logits
        prefix = model(input_ids=input_ids[:, :4], use_cache=True)
        cache = prefix.cache
        steps = [model(input_ids=input_ids[:, t : t + 1], cache=cache).logits for t in range(4, 10)]
    assert len(cache.concept_keys) == 6
    assert_close(torch.cat([prefix.logits, *steps], dim=1), full, atol=1e-5, rtol=0)


def test_joint_projectors_and_router_initialisation():
    model = concept_model(
        decoder_layers=3, num_hidden_layers=6, joint_decoding_layers=2, router_init="identity"
    )
    attentions = [layer.self_attn for layer in model.model.decoder_layers]
    assert [hasattr(attention, "concept_q_proj") for attention in attentions] == [False, True, True]
    for attention in attentions[1:]:
        for projection in (attention.concept_q_proj, attention.concept_k_proj, attention.concept_v_proj):
            assert torch.count_nonzero(projection.weight) == 0
    assert torch.equal(model.model.chunker.boundary_query.weight, torch.eye(32))
    names = set(model.state_dict())
    assert "model.decoder_layers.2.self_attn.concept_v_proj.weight" in names
    assert "model.chunker.boundary_key.weight" in names
    linear = concept_model(router="linear")
    assert {"model.chunker.score.weight", "model.chunker.score.bias"} <= set(linear.state_dict())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("encoder_layers", 5),
        ("decoder_layers", -1),
        ("compression_ratio", 1.0),
        ("chunking", "random"),
        ("router", "mlp"),
        ("router_init", "zeros"),
        ("boundary_noise", "uniform"),
        ("boundary_tau", 0),
        ("boundary_threshold", 1.5),
        ("pooling", "max"),
        ("dechunk_residual", "input"),
        ("joint_decoding_layers", 3),
        ("concept_loop", [1, 1, 2]),
        ("concept_hidden_size", 0),
        ("aux_loss_weight", -1.0),
        ("ratio_scope", "step"),
    ],
)
def test_bad_config_values_raise_naming_the_field(field, value):
    values = dict(BACKBONE, encoder_layers=2, decoder_layers=2)
    values[field] = value
    with pytest.raises(ValueError) as error:
        ConceptMoEConfig(**values)
    assert field in str(error.value) and str(value) in str(error.value)


def test_fixed_ratio_must_be_an_integer():
    with pytest.raises(ValueError, match=r"compression_ratio=2\.5"):
        ConceptMoEConfig(**BACKBONE, chunking="fixed", compression_ratio=2.5)


def test_concept_layers_route_to_their_own_top_k():
    from tests.conformance.families import _conceptmoe_concept_topk_config

    torch.manual_seed(0)
    model = ConceptMoEForCausalLM(_conceptmoe_concept_topk_config()).eval()
    top_ks = {
        stage: {layer.mlp.top_k for layer in getattr(model.model, f"{stage}_layers")}
        for stage in ("encoder", "concept", "decoder")
    }
    assert top_ks == {"encoder": {1}, "concept": {3}, "decoder": {1}}
    # Strategy 3: wider concept layers — 6 query / 3 key-value heads of the token head dim 8 at width 48,
    # experts 24 wide — behind the in/out projections.
    concept = model.model.concept_layers[0]
    assert concept.self_attn.q_proj.weight.shape == (6 * 8, 48)
    assert concept.self_attn.k_proj.weight.shape == (3 * 8, 48)
    assert concept.mlp.experts[0].gate_proj.weight.shape == (24, 48)
    assert model.model.encoder_layers[0].self_attn.q_proj.weight.shape == (4 * 8, 32)
    input_ids = ids(2, 12, seed=4)
    with torch.no_grad():
        wide = model(input_ids=input_ids).logits
        for layer in model.model.concept_layers:
            layer.mlp.top_k = 1
        narrow = model(input_ids=input_ids).logits
    # The concept layers' top-k is what they run: routing to one expert there changes later logits.
    assert (wide - narrow).abs().max() > 1e-5
    assert ConceptMoEConfig(num_experts=4, num_experts_per_tok=2).concept_top_k == 2
