"""ConceptTrainer: the global ratio loss under gradient accumulation gives the update of one big batch."""

from __future__ import annotations

import torch
from torch.testing import assert_close
from transformers import TrainingArguments, default_data_collator

from hf_concept.modeling.configuration_conceptmoe import ConceptMoEConfig
from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM
from hf_concept.training import ConceptTrainer


def _model() -> ConceptMoEForCausalLM:
    torch.manual_seed(0)
    config = ConceptMoEConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        encoder_layers=1,
        decoder_layers=1,
        compression_ratio=3.0,
        ratio_scope="global",
        # Deterministic decisions, so both runs see the same boundaries.
        boundary_noise="none",
        # A large weight makes a doubled aux term visible in the router's update.
        aux_loss_weight=1.0,
    )
    return ConceptMoEForCausalLM(config)


def _train_one_step(tmp_path, batch_size: int, accumulation: int) -> ConceptMoEForCausalLM:
    model = _model()
    row = torch.randint(3, 61, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    # Identical rows: every micro-batch has the step's boundary fraction, where the running F is exact.
    dataset = [{"input_ids": row, "attention_mask": [1] * len(row), "labels": row}] * 4
    args = TrainingArguments(
        output_dir=str(tmp_path / f"run-{batch_size}x{accumulation}"),
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = ConceptTrainer(
        model=model, args=args, train_dataset=dataset, data_collator=default_data_collator
    )
    trainer.train()
    assert model.ratio_accumulator is None, "the model kept a step accumulator after training"
    accumulator = trainer.ratio_accumulator
    assert accumulator.num_micro_batches == accumulation
    assert accumulator.micro_batches_seen == accumulation
    assert accumulator.step_token_count == 4 * len(row)
    return model


def test_accumulated_micro_batches_update_like_one_batch(tmp_path):
    accumulated = _train_one_step(tmp_path, batch_size=2, accumulation=2)
    single = _train_one_step(tmp_path, batch_size=4, accumulation=1)
    untouched = _model()
    router = "model.chunker.boundary_query.weight"
    moved = dict(single.named_parameters())[router] - dict(untouched.named_parameters())[router]
    assert moved.abs().max() > 1e-4, "the router did not move: the test would not see a doubled aux term"
    for name, parameter in single.named_parameters():
        assert_close(dict(accumulated.named_parameters())[name], parameter, atol=1e-6, rtol=1e-5, msg=name)


def test_evaluation_never_touches_the_accumulator():
    model = _model().eval()
    model.ratio_accumulator = None
    batch = torch.randint(3, 61, (2, 10), generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        model(input_ids=batch, labels=batch)
    assert model.ratio_accumulator is None
