"""LSLM's Hugging Face contracts: the base model's `forward`, `labels` with causal-LM
semantics, the loss per predicted byte under gradient accumulation and DDP, `hidden_states`, the
`use_cache` default, `inputs_embeds` refused, and `trl.SFTTrainer` training a saved checkpoint."""

from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from transformers import Trainer
from transformers.modeling_outputs import BaseModelOutput

from hf_concept.modeling import modeling_lslm
from hf_concept.modeling.lslm_segment_cache import SegmentCache
from hf_concept.modeling.modeling_lslm import LSLMForCausalLM, LSLMModel, label_targets
from hf_concept.modeling.tokenization_lslm import ByteTokenizer
from hf_concept.training.trainer import ConceptTrainer
from tests.test_lslm_generation import random_row
from tests.test_lslm_model import encode, lslm
from tests.workers.lslm_trainer_worker import (
    build_model,
    build_rows,
    train_one_step,
    zero_gumbel_noise,
)

NXT, BOS_MARKER, PAD = 4, 3, 0
WORKER = Path(__file__).parent / "workers" / "lslm_trainer_worker.py"


def marked_batch() -> dict[str, torch.Tensor]:
    """Two left-padded rows with `<BoS>`, `<eos>` and `<nxt>`/`<bos>` markers."""
    generator = torch.Generator().manual_seed(11)
    long, short = random_row(generator, 26, marker_share=0.2), random_row(generator, 15, marker_share=0.2)
    pad = long.shape[1] - short.shape[1]
    input_ids = torch.cat([long, F.pad(short, (pad, 0), value=PAD)])
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :pad] = 0
    assert (input_ids == NXT).any() and (input_ids == BOS_MARKER).any()
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def packed_batch() -> dict[str, torch.Tensor]:
    """One row of two documents (position ids restart), markers included."""
    generator = torch.Generator().manual_seed(12)
    first, second = random_row(generator, 21), random_row(generator, 14)
    positions = torch.cat([torch.arange(first.shape[1]), torch.arange(second.shape[1])])[None]
    return {"input_ids": torch.cat([first, second], dim=1), "position_ids": positions}


BATCHES = {"markers_and_padding": marked_batch, "packed": packed_batch}


@pytest.mark.parametrize("make_batch", BATCHES.values(), ids=BATCHES.keys())
def test_base_model_states_are_what_the_lm_head_projects(make_batch):
    model, batch = lslm(), make_batch()
    with torch.no_grad():
        base = model.model(**batch)
        logits = model(**batch).logits
        as_tuple = model.model(**batch, return_dict=False)
    assert isinstance(base, BaseModelOutput) and base.hidden_states is None
    assert base.last_hidden_state.shape == (*batch["input_ids"].shape, model.config.decoder_hidden_size)
    assert_close(model.lm_head(base.last_hidden_state), logits, atol=1e-6, rtol=1e-6)
    assert torch.equal(as_tuple[0], base.last_hidden_state)


def test_base_model_loads_from_a_causal_lm_checkpoint(tmp_path):
    """What `AutoModel` gives for an LSLM checkpoint: the backbone, every weight found, the same states."""
    model, batch = lslm(), marked_batch()
    model.save_pretrained(tmp_path)
    base, info = LSLMModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        assert_close(base.eval()(**batch).last_hidden_state, model.model(**batch).last_hidden_state)


def test_hidden_states_are_the_token_encoder_states_at_the_input_columns():
    model, batch = lslm(token_encoder_layers=2), marked_batch()
    input_ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    with torch.no_grad():
        causal = model(**batch, output_hidden_states=True)
        base = model.model(**batch, output_hidden_states=True)
        layout = model.model.parallel_pass(input_ids, batch["attention_mask"])
        token_states = model.model.encode_tokens(layout.view)
        embeddings = model.model.embed_tokens(input_ids)
        assert model(**batch).hidden_states is None
    states = causal.hidden_states
    assert len(states) == model.config.token_encoder_layers + 1
    for ours, theirs in zip(states, base.hidden_states, strict=True):
        assert ours.shape == (*input_ids.shape, model.config.token_hidden_size)
        assert torch.equal(ours, theirs)
    is_byte = mask & (input_ids != NXT) & (input_ids != BOS_MARKER)
    # Columns without a byte (pads, markers) hold no token-encoder state.
    assert all((layer[~is_byte] == 0).all() for layer in states)
    assert_close(states[0][is_byte], embeddings[is_byte])
    view = layout.view
    final = torch.zeros_like(states[-1]).scatter_(
        1, view.order[..., None].expand_as(token_states), token_states
    )
    assert_close(states[-1][is_byte], final[is_byte])


def test_use_cache_none_reads_the_config_and_generate_still_works():
    model = lslm()
    input_ids = encode("cache me")["input_ids"]
    packed = packed_batch()
    with torch.no_grad():
        assert isinstance(model(input_ids).cache, SegmentCache)
        assert model(input_ids, use_cache=False).cache is None
        model.config.use_cache = False
        assert model(input_ids).cache is None
        model.config.use_cache = True
        # An implicit cache is skipped for packed rows (generation continues one document per row) ...
        assert model(**packed).cache is None
        # ... an explicit one is refused.
        with pytest.raises(ValueError, match="packed documents"):
            model(**packed, use_cache=True)
        model.train()
        assert model(input_ids, labels=input_ids).cache is None
        model.eval()
        prompt = ByteTokenizer(append_eos_token=False)(["generate"], return_tensors="pt")["input_ids"]
        settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD)
        assert torch.equal(
            model.generate(prompt, **settings), model.generate(prompt, use_cache=False, **settings)
        )


def test_inputs_embeds_and_mismatched_labels_are_refused():
    model = lslm()
    input_ids = encode("refuse")["input_ids"]
    message = re.escape("LSLM reads byte ids: inputs_embeds is not supported, pass input_ids")
    embeds = torch.zeros(*input_ids.shape, model.config.token_hidden_size)
    with pytest.raises(ValueError, match=message):
        model(input_ids, inputs_embeds=embeds)
    with pytest.raises(ValueError, match=message):
        model.model(input_ids, inputs_embeds=embeds)
    shape, short = tuple(input_ids.shape), tuple(input_ids[:, :-1].shape)
    with pytest.raises(ValueError, match=re.escape(f"{short}") + ".*" + re.escape(f"{shape}")):
        model(input_ids, labels=input_ids[:, :-1])


def _layout_and_ends(model, batch):
    """The parallel pass's layout and its `ends` at the input columns."""
    with torch.no_grad():
        layout = model.model.parallel_pass(
            batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids")
        )
    ends = torch.zeros_like(layout.mask).scatter_(1, layout.view.order, layout.segmentation.ends)
    return layout, ends


@pytest.mark.parametrize("make_batch", BATCHES.values(), ids=BATCHES.keys())
def test_labels_equal_to_input_ids_give_the_targets_of_input_ids(make_batch):
    model, batch = lslm(), make_batch()
    layout, _ = _layout_and_ends(model, batch)
    targets = label_targets(layout, batch["input_ids"], model.config.segment_end_token_id)
    assert torch.equal(targets, layout.slots.targets)


def reference_kept_targets(ids, labels, ends, documents, config) -> list[int]:
    """The targets one unpadded row keeps, in slot order, walked over its input columns.

    Segments are runs of bytes (markers are not bytes) cut after every byte that ends one. A segment's
    `<bos>` slot predicts its first byte; each byte predicts the next byte of its segment or, when it
    ends the segment, `<nxt>`; nothing is predicted in `<BoS>`'s segment nor after `<eos>`, nor after a
    row's last byte that leaves its segment open. Labels (HF causal-LM): a byte target takes the label
    at the predicted byte's column; `<nxt>` is governed by the next input column (none at the row's
    end); a governing label of -100 drops the target.
    """
    markers = (config.segment_start_token_id, config.segment_end_token_id)
    segments: list[list[int]] = []
    for column, token in enumerate(ids):
        if token in markers:
            continue
        previous = segments[-1][-1] if segments else None
        if previous is None or ends[previous] or documents[previous] != documents[column]:
            segments.append([])
        segments[-1].append(column)
    kept: list[int] = []

    def keep(governing: int | None, value: int) -> None:
        if governing is None or labels[governing] != -100:
            kept.append(value)

    for segment in segments:
        if ids[segment[0]] == config.bos_token_id:
            continue
        keep(segment[0], labels[segment[0]])
        for here, following in zip(segment, [*segment[1:], None], strict=True):
            if ids[here] == config.eos_token_id:
                continue
            if following is not None:
                keep(following, labels[following])
            elif ends[here]:
                keep(here + 1 if here + 1 < len(ids) else None, config.segment_end_token_id)
    return kept


@pytest.mark.parametrize("make_batch", BATCHES.values(), ids=BATCHES.keys())
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_labels_follow_the_loop_reference(make_batch, seed):
    model, batch = lslm(), make_batch()
    input_ids = batch["input_ids"]
    mask = batch.get("attention_mask", torch.ones_like(input_ids)).bool()
    generator = torch.Generator().manual_seed(seed)
    draw = torch.rand(input_ids.shape, generator=generator)
    labels = input_ids.masked_fill(draw < 0.3, -100)
    relabelled = torch.randint(5, 261, input_ids.shape, generator=generator)
    labels = torch.where((draw > 0.8) & (labels >= 5), relabelled, labels).masked_fill(~mask, -100)
    layout, ends = _layout_and_ends(model, batch)
    targets = label_targets(layout, labels, model.config.segment_end_token_id)
    for row in range(input_ids.shape[0]):
        real = mask[row]
        expected = reference_kept_targets(
            input_ids[row, real].tolist(),
            labels[row, real].tolist(),
            ends[row, real].tolist(),
            layout.view.input_documents[row, real].tolist(),
            model.config,
        )
        assert targets[row][targets[row] != -100].tolist() == expected
    assert (targets != -100).sum() < (layout.slots.targets != -100).sum()


def scored(targets: torch.Tensor, config) -> torch.Tensor:
    """The decoder targets the objective counts: every kept one, `<nxt>` only with `segment_end_loss`."""
    kept = targets != -100
    return kept if config.segment_end_loss else kept & (targets != config.segment_end_token_id)


@pytest.mark.parametrize("segment_end_loss", [False, True])
def test_forward_trains_the_labelled_targets(segment_end_loss):
    model, batch = lslm(segment_end_loss=segment_end_loss), marked_batch()
    labels = batch["input_ids"].masked_fill(torch.rand(batch["input_ids"].shape) < 0.3, -100)
    with torch.no_grad():
        outputs = model(**batch, labels=labels)
        layout = model.model.parallel_pass(batch["input_ids"], batch["attention_mask"])
        slot_logits = model.lm_head(layout.slot_states)
    targets = label_targets(layout, labels, model.config.segment_end_token_id)
    kept = scored(targets, model.config)
    assert bool((targets[targets != -100] == model.config.segment_end_token_id).any())
    assert_close(outputs.lm_loss, F.cross_entropy(slot_logits[kept], targets[kept]))


@pytest.mark.parametrize("segment_end_loss", [False, True])
def test_loss_is_the_negative_elbo_per_predicted_byte(segment_end_loss):
    model = lslm(kl_weight=0.5, prior_alpha=1.0, prior_beta=4.0, segment_end_loss=segment_end_loss)
    batch = encode("two rows of", "rather different lengths")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with torch.no_grad():
        outputs = model(**batch, labels=labels)
        shared = model(**batch, labels=labels, num_items_in_batch=torch.tensor(7))
        layout = model.model.parallel_pass(batch["input_ids"], batch["attention_mask"])
    predicted = (labels[:, 1:] != -100).sum()
    targets = scored(layout.slots.targets, model.config).sum()
    free = (layout.view.mask & ~layout.segmentation.forced).sum()
    negative_elbo = outputs.lm_loss * targets + 0.5 * outputs.kl_loss * free
    assert_close(outputs.loss, negative_elbo / predicted)
    assert_close(shared.loss, negative_elbo / 7)
    # The metrics keep their per-target / per-byte meaning whatever the normaliser.
    for name in ("lm_loss", "kl_loss", "bits_per_byte", "boundary_rate", "compression_ratio"):
        assert torch.equal(getattr(shared, name), getattr(outputs, name)), name


def _per_row_mean_loss() -> float:
    """What per-micro-batch means averaged over the step would give (the wrong normalisation)."""
    model = build_model().train()
    losses = []
    with mock.patch.object(modeling_lslm, "sample_gumbel_noise", zero_gumbel_noise), torch.no_grad():
        for row in build_rows():
            input_ids = torch.tensor([row["input_ids"]])
            losses.append(model(input_ids, labels=input_ids).loss.item())
    return sum(losses) / len(losses)


@pytest.mark.parametrize("trainer_class", [Trainer, ConceptTrainer], ids=["Trainer", "ConceptTrainer"])
def test_gradient_accumulation_equals_one_large_batch(trainer_class, tmp_path):
    large = train_one_step(trainer_class, tmp_path / "large", per_device=4, accumulation=1)
    accumulated = train_one_step(trainer_class, tmp_path / "accumulated", per_device=1, accumulation=4)
    assert abs(accumulated["loss"].item() - large["loss"].item()) <= 1e-5
    assert abs(_per_row_mean_loss() - large["loss"].item()) > 1e-3, "rows must weigh differently"
    assert large["grads"].keys() == accumulated["grads"].keys()
    assert any(".router." in name for name in large["grads"])
    for name, grad in large["grads"].items():
        assert_close(accumulated["grads"][name], grad, atol=1e-5, rtol=0, msg=name)
        assert_close(accumulated["parameters"][name], large["parameters"][name], atol=1e-5, rtol=0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_two_process_ddp_equals_one_process_on_the_whole_batch(tmp_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2"]
    address = ["--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    root = str(Path(__file__).parents[1])
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    )
    completed = subprocess.run(
        [*launcher, *address, str(WORKER), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=root,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    single = train_one_step(Trainer, tmp_path / "single", per_device=4, accumulation=1)
    for result in ranks:
        assert result["world_size"] == 2
        assert abs(result["loss"].item() - single["loss"].item()) <= 1e-5
        for name, grad in single["grads"].items():
            assert_close(result["grads"][name], grad, atol=1e-5, rtol=0, msg=name)
            assert_close(result["parameters"][name], single["parameters"][name], atol=1e-5, rtol=0)


def test_concept_sft_trainer_trains_an_lslm_checkpoint_on_its_elbo(tmp_path):
    """TRL's own SFTTrainer would score the LM loss alone (its fused head); `ConceptSFTTrainer` keeps the
    model's ELBO, KL term included, and logs it."""
    trl = pytest.importorskip("trl", reason="trl is not installed (pip install trl) — SFTTrainer not checked")
    from datasets import Dataset

    from hf_concept.training.sft import ConceptSFTTrainer

    folder = tmp_path / "checkpoint"
    build_model().save_pretrained(folder)
    ByteTokenizer().save_pretrained(folder)
    model = LSLMForCausalLM.from_pretrained(folder)
    router = {name: value.detach().clone() for name, value in model.model.router.named_parameters()}
    texts = ["bytes in, segments out", "a tiny corpus", "of four lines", "for two steps"]
    config = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        max_length=64,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = ConceptSFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_dict({"text": texts}),
        processing_class=ByteTokenizer.from_pretrained(folder),
    )
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2 and all(math.isfinite(log["loss"]) for log in logs)
    # The ELBO: decoder loss + β·KL (β = kl_weight), both logged.
    assert all({"lm_loss", "kl_loss"} <= set(log) and log["kl_loss"] > 0 for log in logs)
    moved = [
        name for name, value in model.model.router.named_parameters() if not torch.equal(value, router[name])
    ]
    assert moved


@pytest.mark.parametrize("side", ["left", "right"])
def test_the_padding_collator_labels_only_predicted_tokens(side):
    """Trainer counts labels[..., 1:] != -100 as the step's predicted tokens: with either padding side that
    is each row's length - 1, the tokens the model predicts."""
    from hf_concept.training.data import PaddingCollator

    rows = [{"input_ids": [1, 10, 11, 12, 2]}, {"input_ids": [1, 20, 2]}]
    batch = PaddingCollator(pad_token_id=0, padding_side=side)(rows)
    assert int((batch["labels"][:, 1:] != -100).sum()) == (5 - 1) + (3 - 1)
    assert torch.equal(batch["labels"] != -100, batch["attention_mask"].bool() & (batch["labels"] != -100))
