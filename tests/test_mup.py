"""Decoupled μP (DLCM §6.1): optimizer groups, their rates and ε, Trainer use, init variance, logit scale."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.testing import assert_close
from transformers import TrainingArguments, default_data_collator

from hf_concept.modeling.configuration_dlcm import DLCMConfig
from hf_concept.modeling.modeling_dlcm import DLCMForCausalLM, SmoothingLinear
from hf_concept.training import ConceptTrainer, mup_optimizer, mup_param_groups
from hf_concept.training.mup import base_parameter_name, mup_group_of

BASE = 32
RATES = {"token": 1e-3, "concept": 2e-3, "others": 5e-4}


def _config(width: int = 64, concept_width: int = 128, **overrides) -> DLCMConfig:
    fields = dict(
        vocab_size=61,
        hidden_size=width,
        intermediate_size=2 * width,
        num_attention_heads=width // 16,
        num_key_value_heads=width // 16,
        head_dim=16,
        concept_hidden_size=concept_width,
        concept_num_attention_heads=concept_width // 16,
        concept_head_dim=16,
        max_position_embeddings=64,
        encoder_layers=1,
        concept_layers=1,
        decoder_layers=1,
        attention_bias=True,
        mup_base_width=BASE,
        mup_token_learning_rate=RATES["token"],
        mup_concept_learning_rate=RATES["concept"],
        mup_other_learning_rate=RATES["others"],
    )
    fields.update(overrides)
    return DLCMConfig(**fields)


def _model(**overrides) -> DLCMForCausalLM:
    torch.manual_seed(0)
    return DLCMForCausalLM(_config(**overrides))


def _groups_by_name(groups: list[dict]) -> dict[str, dict]:
    assert len({group["name"] for group in groups}) == len(groups)
    return {group["name"]: group for group in groups}


def test_groups_partition_the_trainable_parameters():
    model = _model()
    groups = mup_param_groups(model)
    assert [group["name"] for group in groups] == ["token", "concept", "others"]
    grouped = [id(p) for group in groups for p in group["params"]]
    assert len(grouped) == len(set(grouped)), "a parameter sits in two groups"
    assert set(grouped) == {id(p) for p in model.parameters()}


def test_rates_and_eps_follow_eta_over_s():
    # d_token = 64, d_concept = 128 at base 32: s_token = 2, s_concept = 4.
    groups = _groups_by_name(mup_param_groups(_model(), eps=1e-6, weight_decay=0.1))
    expected = {"token": 2.0, "concept": 4.0, "others": 1.0}
    for name, scale in expected.items():
        assert groups[name]["width_scale"] == scale
        assert_close(groups[name]["lr"], RATES[name] / scale, rtol=1e-12, atol=0.0)
        assert_close(groups[name]["eps"], 1e-6 / scale, rtol=1e-12, atol=0.0)
    assert [groups[name]["weight_decay"] for name in expected] == [0.1, 0.1, 0.0]
    overridden = _groups_by_name(mup_param_groups(_model(), token_lr=0.4, concept_lr=0.8, other_lr=0.3))
    assert_close([overridden[name]["lr"] for name in expected], [0.2, 0.2, 0.3], rtol=1e-12, atol=0.0)


def test_standard_parametrisation_keeps_the_base_rates():
    groups = _groups_by_name(mup_param_groups(_model(mup_base_width=None)))
    assert {name: group["lr"] for name, group in groups.items()} == RATES
    assert {group["eps"] for group in groups.values()} == {1e-8}


def test_parameters_land_in_their_stage_group():
    # The W_s form: its smoothing matrix is a concept-stage parameter too.
    model = _model(smoothing="linear")
    by_hand = {
        "model.encoder_layers.0.self_attn.q_proj.weight": "token",
        "model.encoder_layers.0.mlp.down_proj.weight": "token",
        "model.chunker.boundary_key.weight": "token",
        "model.decoder_layers.0.cross_attn.q_proj.weight": "token",
        "model.decoder_layers.0.cross_attn.o_proj.weight": "token",
        "model.decoder_layers.0.mlp.up_proj.weight": "token",
        "model.concept_in_proj.weight": "concept",
        "model.concept_layers.0.self_attn.o_proj.weight": "concept",
        "model.concept_layers.0.mlp.gate_proj.weight": "concept",
        "model.smoothing.weight": "concept",
        "model.decoder_layers.0.cross_attn.k_proj.weight": "concept",
        "model.decoder_layers.0.cross_attn.v_proj.weight": "concept",
        "model.embed_tokens.weight": "others",
        "lm_head.weight": "others",
        "model.null_concept": "others",
        "model.norm.weight": "others",
        "model.concept_norm.weight": "others",
        "model.encoder_layers.0.self_attn.q_proj.bias": "others",
        "model.concept_layers.0.self_attn.k_proj.bias": "others",
        "model.decoder_layers.0.cross_attn.k_norm.weight": "others",
        "model.decoder_layers.0.cross_attention_layernorm.weight": "others",
    }
    parameters = dict(model.named_parameters())
    assert set(by_hand) <= set(parameters)
    membership = {id(p): group["name"] for group in mup_param_groups(model) for p in group["params"]}
    for name, group in by_hand.items():
        assert membership[id(parameters[name])] == group, name
    # The groups agree with the stage the model marks on each Linear (which also drives the init).
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module_name != "lm_head":
            assert membership[id(module.weight)] == (module.mup_stage or "others"), module_name


def test_frozen_parameters_are_left_out():
    model = _model()
    model.model.embed_tokens.weight.requires_grad_(False)
    for parameter in model.model.concept_layers.parameters():
        parameter.requires_grad_(False)
    grouped = {id(p) for group in mup_param_groups(model) for p in group["params"]}
    assert grouped == {id(p) for p in model.parameters() if p.requires_grad}
    assert id(model.model.embed_tokens.weight) not in grouped


def test_peft_adapters_take_the_rate_of_the_matrix_they_adapt():
    lora = LoraConfig(
        r=4,
        target_modules=["encoder_layers.0.self_attn.q_proj", "decoder_layers.0.cross_attn.k_proj"],
        modules_to_save=["lm_head"],
    )
    peft_model = get_peft_model(_model(), lora)
    names = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    token_lora = "base_model.model.model.encoder_layers.0.self_attn.q_proj.lora_A.default.weight"
    concept_lora = "base_model.model.model.decoder_layers.0.cross_attn.k_proj.lora_B.default.weight"
    head_copy = "base_model.model.lm_head.modules_to_save.default.weight"
    assert {token_lora, concept_lora, head_copy} <= names
    assert base_parameter_name(token_lora) == "model.encoder_layers.0.self_attn.q_proj.weight"
    assert [mup_group_of(n) for n in (token_lora, concept_lora, head_copy)] == ["token", "concept", "others"]
    groups = _groups_by_name(mup_param_groups(peft_model))
    grouped = [id(p) for group in groups.values() for p in group["params"]]
    assert sorted(grouped) == sorted(id(p) for p in peft_model.parameters() if p.requires_grad)
    assert len(groups["token"]["params"]) == 2 and len(groups["concept"]["params"]) == 2
    assert_close(groups["concept"]["lr"], RATES["concept"] / 4, rtol=1e-12, atol=0.0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"token_lr": 0.0}, "token_lr"),
        ({"concept_lr": -1e-3}, "concept_lr"),
        ({"other_lr": "1e-3"}, "other_lr"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"eps": 0.0}, "eps"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        mup_param_groups(_model(), **kwargs)


def test_a_model_without_mup_fields_is_refused():
    with pytest.raises(ValueError, match="model=Linear"):
        mup_param_groups(torch.nn.Linear(4, 4))


def test_trainer_steps_each_group_at_its_own_rate(tmp_path):
    model = _model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    row = torch.randint(0, 61, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=1,
        learning_rate=0.5,  # ignored: the μP groups carry their own rates
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    dataset = [{"input_ids": row, "attention_mask": [1] * len(row), "labels": row}] * 2
    trainer = ConceptTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=default_data_collator,
        optimizers=(mup_optimizer(model), None),
    )
    trainer.train()
    groups = _groups_by_name(trainer.optimizer.param_groups)
    scales = {"token": 2.0, "concept": 4.0, "others": 1.0}
    for name, scale in scales.items():
        assert_close(groups[name]["lr"], RATES[name] / scale, rtol=1e-12, atol=0.0)
    # Adam's first step moves every entry by lr · |g| / (|g| + ε) ≈ lr: the median move of a matrix reads
    # back the rate its group actually stepped with.
    probes = {
        "model.encoder_layers.0.mlp.up_proj.weight": "token",
        "model.decoder_layers.0.cross_attn.q_proj.weight": "token",
        "model.concept_layers.0.mlp.up_proj.weight": "concept",
        "model.decoder_layers.0.cross_attn.v_proj.weight": "concept",
        "model.norm.weight": "others",
        "lm_head.weight": "others",
    }
    parameters = dict(model.named_parameters())
    for name, group in probes.items():
        moved = (parameters[name].detach() - before[name]).abs().median()
        assert_close(moved.item(), RATES[group] / scales[group], rtol=1e-3, atol=0.0, msg=name)


def _stage_std(model: DLCMForCausalLM, stage: str) -> float:
    weights = [
        module.weight.detach().flatten()
        for module in model.modules()
        if getattr(module, "mup_stage", None) == stage and not isinstance(module, SmoothingLinear)
    ]
    return torch.cat(weights).std().item()


@pytest.mark.parametrize("mup", [True, False])
def test_init_std_of_each_stage_scales_as_one_over_sqrt_s(mup):
    base = BASE if mup else None
    narrow = _model(width=64, concept_width=64, mup_base_width=base)  # s_token = s_concept = 2
    wide = _model(width=256, concept_width=512, mup_base_width=base)  # s_token = 8, s_concept = 16
    sigma = narrow.config.initializer_range
    for model, s_token, s_concept in ((narrow, 2, 2), (wide, 8, 16)):
        expected_token = sigma / s_token**0.5 if mup else sigma
        expected_concept = sigma / s_concept**0.5 if mup else sigma
        # Tens of thousands of entries per stage: the sample std is within ~1% of the true one.
        assert_close(_stage_std(model, "token"), expected_token, rtol=0.03, atol=0.0)
        assert_close(_stage_std(model, "concept"), expected_concept, rtol=0.03, atol=0.0)
        # Embeddings and the LM head keep σ at every width.
        assert_close(model.model.embed_tokens.weight.std().item(), sigma, rtol=0.05, atol=0.0)
        assert_close(model.lm_head.weight.std().item(), sigma, rtol=0.05, atol=0.0)


def test_logits_are_scaled_by_one_over_s_token():
    scaled = _model(width=128, concept_width=64, boundary_noise="none").eval()  # s_token = 4
    unscaled = DLCMForCausalLM(
        _config(width=128, concept_width=64, boundary_noise="none", mup_output_scaling=False)
    )
    standard = DLCMForCausalLM(
        _config(width=128, concept_width=64, boundary_noise="none", mup_base_width=None)
    )
    for other in (unscaled, standard):
        other.load_state_dict(scaled.state_dict())
        other.eval()
    input_ids = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = scaled(input_ids=input_ids).logits
        plain = unscaled(input_ids=input_ids).logits
        assert_close(logits * 4, plain, rtol=1e-5, atol=1e-6)
        assert_close(standard(input_ids=input_ids).logits, plain, rtol=1e-5, atol=1e-6)
    assert plain.abs().max() > 1e-3, "logits too small for the comparison to see a factor"
