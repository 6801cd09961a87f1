"""The ratio loss under the trainers users pair the concept families with:
the three scopes, a clear error where the global scope would be counted once per accumulated micro-batch,
and TRL's SFTTrainer, which drops the model's own ratio loss, against `ConceptSFTTrainer`, which keeps it."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_concept.modeling.configuration_conceptmoe import ConceptMoEConfig
from hf_concept.modeling.configuration_dlcm import DLCMConfig
from hf_concept.modeling.tokenization_lslm import VOCAB_SIZE, ByteTokenizer
from hf_concept.training import ConceptTrainer
from tests.conformance.families import _conceptmoe_class, _conceptmoe_config, _dlcm_class, _dlcm_config

FAMILIES = {"conceptmoe": (_conceptmoe_class, _conceptmoe_config), "dlcm": (_dlcm_class, _dlcm_config)}
TEXTS = ["bytes in, concepts out", "a tiny corpus of lines", "of four short lines", "for a few steps"]


def build(family: str, seed: int = 0, **overrides):
    model_class, make_config = FAMILIES[family]
    torch.manual_seed(seed)
    # The byte tokenizer's ids (pad 0, bos 1, eos 2) fit every family; no noise unless asked: a pass is
    # then deterministic.
    overrides = {"boundary_noise": "none", **overrides}
    config = make_config(vocab_size=VOCAB_SIZE, max_position_embeddings=256, **overrides)
    return model_class()(config)


@pytest.mark.parametrize("config_class", [ConceptMoEConfig, DLCMConfig])
def test_every_scope_is_a_choice_and_a_bad_one_is_named(config_class):
    for scope in ("global", "batch", "sequence"):
        assert config_class(ratio_scope=scope).ratio_scope == scope
    with pytest.raises(ValueError, match="ratio_scope='step'"):
        config_class(ratio_scope="step")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batch_scope_shares_add_up_to_the_token_weighted_micro_batch_losses(family):
    model = build(family, ratio_scope="batch").train()
    input_ids = torch.randint(3, VOCAB_SIZE, (4, 24), generator=torch.Generator().manual_seed(1))
    halves = input_ids[:2], input_ids[2:]
    items = torch.tensor(4 * 23)
    shares = [model(input_ids=half, labels=half, num_items_in_batch=items).aux_loss for half in halves]
    alone = [model(input_ids=half, labels=half).aux_loss for half in halves]
    # Equal label counts per half: the step's figure is the mean of the micro-batches' own losses.
    torch.testing.assert_close(sum(shares), sum(alone) / 2, rtol=1e-6, atol=1e-7)


def plain_trainer_run(family: str, scope: str, tmp_path, accumulation: int, steps: int = 1):
    """`steps` optimizer steps of a plain `Trainer` over 8 rows, batches of 4 // `accumulation`; the loss
    logged at the first step and the router's gradients as the optimizer gets them."""
    tokens = torch.randint(3, 200, (8, 16), generator=torch.Generator().manual_seed(5))
    rows = [{"input_ids": ids, "labels": ids} for ids in tokens.tolist()]
    callback = _GradientsBeforeTheStep()
    args = TrainingArguments(
        output_dir=str(tmp_path / scope), per_device_train_batch_size=4 // accumulation,
        gradient_accumulation_steps=accumulation, max_steps=steps, learning_rate=1e-3, max_grad_norm=0.0,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    model = build(family, ratio_scope=scope, compression_ratio=4.0)
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback])
    trainer.train()
    return trainer.state.log_history[0]["loss"], callback.gradients


def scope_warnings(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if "ratio_scope='global'" in record.getMessage()]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_plain_trainer_trains_the_global_scope_as_the_batch_scope_without_a_word(family, tmp_path, caplog):
    """One process, no accumulation: the step is the batch, so the global scope is the batch scope exactly
    (the same loss and router gradients) and nothing is said."""
    with caplog.at_level(logging.WARNING):
        global_loss, global_grads = plain_trainer_run(family, "global", tmp_path, accumulation=1)
    batch_loss, batch_grads = plain_trainer_run(family, "batch", tmp_path, accumulation=1)
    assert global_loss == batch_loss
    assert global_grads[0].abs().max() > 0, "the ratio loss must reach the router"
    torch.testing.assert_close(global_grads[0], batch_grads[0], atol=0, rtol=0)
    assert scope_warnings(caplog) == []


def test_a_plain_trainer_with_accumulation_falls_back_to_the_batch_scope_with_one_warning(tmp_path, caplog):
    """Accumulation 2 over two optimizer steps (four micro-batches): each micro-batch uses its own
    statistics, as the batch scope does, and the model says so once, naming the trainers that plan."""
    with caplog.at_level(logging.WARNING):
        global_loss, global_grads = plain_trainer_run("dlcm", "global", tmp_path, accumulation=2, steps=2)
    batch_loss, batch_grads = plain_trainer_run("dlcm", "batch", tmp_path, accumulation=2, steps=2)
    assert global_loss == batch_loss
    for planned, batch in zip(global_grads, batch_grads, strict=True):
        torch.testing.assert_close(planned, batch, atol=0, rtol=0)
    (message,) = scope_warnings(caplog)
    assert "ConceptTrainer" in message and "ConceptSFTTrainer" in message and "ratio_scope='batch'" in message


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_several_processes_without_a_plan_take_the_batch_scope_with_one_warning(family, monkeypatch, caplog):
    """A process group of two (average_tokens_across_devices off: num_items_in_batch is the local count)."""
    model = build(family, ratio_scope="global", compression_ratio=4.0).train()
    input_ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(3))
    items = torch.tensor(2 * 15)
    alone = model(input_ids=input_ids, labels=input_ids, num_items_in_batch=items)
    assert scope_warnings(caplog) == []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            ranked = model(input_ids=input_ids, labels=input_ids, num_items_in_batch=items)
    assert len(scope_warnings(caplog)) == 1
    model.config.ratio_scope = "batch"
    batch = model(input_ids=input_ids, labels=input_ids, num_items_in_batch=items)
    torch.testing.assert_close(ranked.loss, batch.loss, atol=0, rtol=0)
    torch.testing.assert_close(alone.loss, batch.loss, atol=0, rtol=0)


def test_concept_trainer_plans_the_global_scope_with_accumulation_without_a_warning(tmp_path, caplog):
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 200, (8, 16)).tolist()]
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING):
        ConceptTrainer(model=build("conceptmoe", ratio_scope="global"), args=args, train_dataset=rows).train()
    assert scope_warnings(caplog) == []


def sft_run(trainer_class, family: str, tmp_path, accumulation: int = 1, **overrides):
    """One SFT step over the four texts in one batch; the model, its loss on that batch before the step,
    and the trainer's log."""
    trl = pytest.importorskip("trl", reason="trl is not installed (pip install trl) — SFTTrainer not checked")
    from datasets import Dataset

    model = build(family, **overrides)
    tokenizer = ByteTokenizer()
    config = trl.SFTConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4 // accumulation,
        gradient_accumulation_steps=accumulation, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False, max_length=64,
        dataloader_num_workers=0, disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = trainer_class(
        model=model, args=config, train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=tokenizer
    )
    batch = next(iter(trainer.get_train_dataloader()))
    model.train()
    with torch.no_grad():
        expected = model(**batch)
    trainer.train()
    return expected, trainer.state.log_history[0]


def dropped_warnings(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if "not in the loss" in record.getMessage()]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sft_trainer_drops_the_ratio_loss_and_concept_sft_trainer_keeps_it(family, tmp_path, caplog):
    trl = pytest.importorskip("trl", reason="trl is not installed (pip install trl) — SFTTrainer not checked")
    from hf_concept.training.sft import ConceptSFTTrainer

    with caplog.at_level(logging.WARNING):
        expected, kept = sft_run(
            ConceptSFTTrainer, family, tmp_path / "kept", ratio_scope="batch", compression_ratio=4.0
        )
    assert dropped_warnings(caplog) == []
    weight = expected.loss - expected.lm_loss
    assert float(weight) > 1e-4, "the ratio term must be visible for this test to mean anything"
    # The logged loss is the model's own: LM + λ · ratio loss, and the concept metrics are logged.
    assert kept["loss"] == pytest.approx(float(expected.loss), rel=1e-4)
    assert {"aux_loss", "compression_ratio", "inference_compression_ratio"} <= set(kept)
    with caplog.at_level(logging.WARNING):
        _, dropped = sft_run(
            trl.SFTTrainer, family, tmp_path / "dropped", ratio_scope="batch", compression_ratio=4.0
        )
    # TRL's fused head scores the LM loss alone: the ratio term is gone, and the model says so once.
    assert dropped["loss"] == pytest.approx(float(expected.lm_loss), rel=1e-4)
    assert not math.isclose(dropped["loss"], kept["loss"], rel_tol=1e-4)
    (message,) = dropped_warnings(caplog)
    assert "the ratio loss (aux_loss_weight=" in message and "ConceptSFTTrainer" in message


def test_concept_sft_trainer_runs_the_global_scope_with_accumulation(tmp_path):
    from hf_concept.training.sft import ConceptSFTTrainer

    pytest.importorskip("trl")
    _, log = sft_run(ConceptSFTTrainer, "dlcm", tmp_path, accumulation=2, ratio_scope="global")
    assert math.isfinite(log["loss"]) and "aux_loss" in log


class _GradientsBeforeTheStep:
    """Trainer callback: the router's gradients as the optimizer is about to use them (clipping off)."""

    def __init__(self) -> None:
        self.gradients: list[torch.Tensor] = []

    def __getattr__(self, name):
        # Every other TrainerCallback event does nothing.
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        # The router's, or for the rule router (no parameters) the encoder's, which the ratio loss shapes.
        names = [name for name, _ in model.named_parameters() if "chunker" in name] or [
            name for name, _ in model.named_parameters() if "encoder" in name
        ]
        parameters = dict(model.named_parameters())
        self.gradients.append(torch.cat([parameters[name].grad.flatten() for name in names]))


# (trainer, scope, family, config overrides). "bernoulli" noise samples the training decisions: the
# planned global step must replay the very decisions it counted.
SPLITS = [
    ("Trainer", "sequence", "conceptmoe", {}),
    ("Trainer", "batch", "conceptmoe", {}),
    ("ConceptTrainer", "sequence", "conceptmoe", {}),
    ("ConceptTrainer", "global", "conceptmoe", {}),
    ("ConceptTrainer", "global", "conceptmoe", dict(boundary_noise="bernoulli")),
    ("ConceptTrainer", "global", "dlcm", dict(boundary_noise="bernoulli")),
    ("ConceptTrainer", "global", "dlcm", dict(router="rule")),
]


@pytest.mark.parametrize(("trainer_name", "scope", "family", "overrides"), SPLITS)
def test_accumulation_four_equals_one_batch_four_times_as_large(
    trainer_name, scope, family, overrides, tmp_path
):
    """One optimizer step on 8 equal-length rows: 4 micro-batches of 2 against 1 batch of 8. Same loss and
    router gradients within 1e-5 where the scope's statistic does not depend on how the step is split
    (per sequence; over the step with ConceptTrainer's planned step). The per-micro-batch "batch" scope
    is a different statistic when split, so its figures are compared for what they are: not equal."""
    trainer_class = {"Trainer": Trainer, "ConceptTrainer": ConceptTrainer}[trainer_name]
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 200, (8, 24)).tolist()]
    results = []
    for batch, accumulation in ((8, 1), (2, 4)):
        callback = _GradientsBeforeTheStep()
        args = TrainingArguments(
            output_dir=str(tmp_path / str(batch)), per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=1e-3, max_grad_norm=0.0,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
        )  # fmt: skip
        model = build(family, ratio_scope=scope, compression_ratio=4.0, **overrides)
        trainer = trainer_class(model=model, args=args, train_dataset=rows, callbacks=[callback])
        trainer.train()
        results.append((trainer.state.log_history[0], callback.gradients[0]))
    (big_log, big_grad), (split_log, split_grad) = results
    if scope == "batch":
        assert (big_grad - split_grad).abs().max() > 1e-5
        return
    assert split_log["loss"] == pytest.approx(big_log["loss"], abs=1e-5)
    if trainer_name == "ConceptTrainer":
        assert split_log["aux_loss"] == pytest.approx(big_log["aux_loss"], abs=1e-5)
        # Tokens per concept of the step: its tokens over its concepts, however it is split.
        assert split_log["compression_ratio"] == pytest.approx(big_log["compression_ratio"], rel=1e-5)
    torch.testing.assert_close(split_grad, big_grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("scope", ["sequence", "global"])
def test_concept_sft_trainer_accumulation_four_equals_one_batch_four_times_as_large(scope, tmp_path):
    """ConceptSFTTrainer on the four texts: 4 micro-batches of 1 against 1 batch of 4 (padded to its longest
    text), the same loss, ratio loss and router gradients within 1e-5. Decisions are thresholded (no
    noise): random draws over differently padded shapes are different draws."""
    trl = pytest.importorskip("trl", reason="trl is not installed (pip install trl) — SFTTrainer not checked")
    from datasets import Dataset

    from hf_concept.training.sft import ConceptSFTTrainer

    results = []
    for batch, accumulation in ((4, 1), (1, 4)):
        callback = _GradientsBeforeTheStep()
        config = trl.SFTConfig(
            output_dir=str(tmp_path / str(batch)), max_steps=1, per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulation, learning_rate=1e-3, max_grad_norm=0.0,
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False, max_length=64,
            dataloader_num_workers=0, disable_tqdm=True, seed=0,
        )  # fmt: skip
        trainer = ConceptSFTTrainer(
            model=build("dlcm", ratio_scope=scope, compression_ratio=4.0),
            args=config, train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=ByteTokenizer(),
            callbacks=[callback],
        )  # fmt: skip
        trainer.train()
        results.append((trainer.state.log_history[0], callback.gradients[0]))
    (big_log, big_grad), (split_log, split_grad) = results
    assert split_log["loss"] == pytest.approx(big_log["loss"], abs=1e-5)
    assert split_log["aux_loss"] == pytest.approx(big_log["aux_loss"], abs=1e-5)
    torch.testing.assert_close(split_grad, big_grad, atol=1e-5, rtol=1e-4)
