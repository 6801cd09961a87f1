"""LSLM (training pass): the vectorised segment layout against the loop reference, causality over bytes,
padding and packing, the ELBO's parts, and the interleaved optimisation under `Trainer`."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.testing import assert_close

from hf_concept.modeling.configuration_lslm import LSLMConfig
from hf_concept.modeling.modeling_lslm import LSLMForCausalLM, byte_view
from hf_concept.modeling.tokenization_lslm import ByteTokenizer
from hf_concept.reference.lslm import reference_logits
from hf_concept.training.lslm import InterleavedUpdates, is_inference_parameter

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    token_encoder_layers=1,
    segment_encoder_layers=2,
    decoder_layers=2,
    token_hidden_size=16,
    token_num_attention_heads=2,
    decoder_hidden_size=24,
    decoder_num_attention_heads=2,
    max_position_embeddings=256,
    # The untrained router's q sits near 1/2: this threshold gives segments of several bytes.
    boundary_threshold=0.505,
)
TOKENIZER = ByteTokenizer()


def lslm(seed: int = 0, attn: str = "sdpa", **overrides) -> LSLMForCausalLM:
    torch.manual_seed(seed)
    config = LSLMConfig(**{**TINY, **overrides})
    config._attn_implementation = attn
    return LSLMForCausalLM(config).eval()


def encode(*texts: str) -> dict[str, torch.Tensor]:
    return TOKENIZER(list(texts), padding=True, return_tensors="pt")


@pytest.mark.parametrize(("pooling", "attn"), list(itertools.product(["mean", "hops:2"], ["eager", "sdpa"])))
def test_parallel_pass_equals_the_segment_by_segment_reference(pooling, attn):
    model = lslm(attn=attn, pooling=pooling)
    first, second = encode("hello there, friend")["input_ids"], encode("你好, world!")["input_ids"]
    packed = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(first.shape[1]), torch.arange(second.shape[1])])[None]
    with torch.no_grad():
        outputs = model(packed, position_ids=positions, labels=packed)
    expected_logits, expected_loss = reference_logits(model, packed, positions)
    assert 1.2 < outputs.compression_ratio.item() < packed.shape[1], "the test needs multi-byte segments"
    assert_close(outputs.logits[0], expected_logits, atol=1e-5, rtol=1e-5)
    assert_close(outputs.lm_loss, expected_loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cut", [3, 9, 15])
def test_changing_later_bytes_never_moves_earlier_logits(cut):
    model = lslm()
    input_ids = encode("segments are learned, not given")["input_ids"]
    changed = input_ids.clone()
    changed[0, cut + 1 :] = torch.randint(
        5, 261, (changed.shape[1] - cut - 1,), generator=torch.Generator().manual_seed(cut)
    )
    with torch.no_grad():
        before, after = model(input_ids).logits, model(changed).logits
    assert_close(after[0, : cut + 1], before[0, : cut + 1], atol=1e-5, rtol=1e-5)
    assert (after[0, cut + 1 :] - before[0, cut + 1 :]).abs().max() > 0


def test_left_padded_rows_equal_rows_alone_and_packed_documents_equal_apart():
    model = lslm()
    batch = encode("a longer first row of text", "short")
    with torch.no_grad():
        padded = model(**batch).logits
        for row in range(2):
            real = batch["attention_mask"][row].bool()
            alone = model(batch["input_ids"][row : row + 1, real]).logits
            assert_close(padded[row, real], alone[0], atol=1e-5, rtol=1e-5)
        first, second = batch["input_ids"][0:1], batch["input_ids"][1:2, batch["attention_mask"][1].bool()]
        positions = torch.cat([torch.arange(first.shape[1]), torch.arange(second.shape[1])])[None]
        packed = model(torch.cat([first, second], dim=1), position_ids=positions).logits
        apart = torch.cat([model(first).logits, model(second).logits], dim=1)
    assert_close(packed, apart, atol=1e-5, rtol=1e-5)


def test_elbo_parts_and_forced_boundaries():
    model = lslm(kl_weight=0.5, prior_alpha=1.0, prior_beta=4.0, prior_loss="kl")
    input_ids = encode("bytes in, segments out")["input_ids"]
    with torch.no_grad():
        outputs = model(input_ids, labels=input_ids)
        mask = torch.ones_like(input_ids, dtype=torch.bool)
        starts = torch.zeros_like(mask)
        starts[:, 0] = True
        view = byte_view(input_ids, mask, starts, model.config)
        segmentation = model.model.segment(view, model.model.encode_tokens(view))
    assert model.config.prior_mean == pytest.approx(0.2)
    # <BoS> (first) and <eos> (last) always end a segment.
    assert segmentation.ends[0, 0] and segmentation.ends[0, -1] and segmentation.forced[0, [0, -1]].all()
    free = ~segmentation.forced[0]
    q = segmentation.probs[0, free].clamp(1e-6, 1 - 1e-6)
    kl = (q * torch.log(q / 0.2) + (1 - q) * torch.log((1 - q) / 0.8)).mean()
    assert_close(outputs.kl_loss, kl)
    # The negative ELBO per predicted byte (T - 1 of them: labels shift inside).
    with torch.no_grad():
        slot_targets = model.model.parallel_pass(input_ids, None).slots.targets
    # Every byte's target counts; the segments' <nxt> targets do not (no `segment_end_loss` by default).
    targets = ((slot_targets != -100) & (slot_targets != model.config.segment_end_token_id)).sum()
    assert targets == input_ids.shape[1] - 1
    elbo = outputs.lm_loss * targets + 0.5 * outputs.kl_loss * free.sum()
    assert_close(outputs.loss, elbo / (input_ids.shape[1] - 1))
    assert outputs.boundary_rate.item() == pytest.approx(segmentation.ends[0, free].float().mean().item())
    assert 0 < outputs.bits_per_byte.item() < 12


def test_training_lowers_the_loss_and_the_router_learns():
    model = lslm().train()
    batch = encode("the cat sat on the mat", "猫がマットに座った")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    # 30 steps: under the default prior (0.7) every step samples a fresh segmentation of the batch.
    for _ in range(30):
        outputs = model(**batch, labels=batch["input_ids"])
        optimizer.zero_grad()
        outputs.loss.backward()
        assert model.model.router.fc_in.weight.grad.abs().sum() > 0
        optimizer.step()
        losses.append(outputs.loss.item())
    assert losses[-1] < 0.8 * losses[0]


def moved_groups(tmp_path, update_schedule: int) -> list[tuple[bool, bool]]:
    """(router moved, anything else moved) at each of 6 `Trainer` steps under `InterleavedUpdates`."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model = lslm(update_schedule=update_schedule).train()
    batch = encode("interleaved updates", "交互に更新する")
    rows = [
        {"input_ids": ids[mask.bool()], "labels": ids[mask.bool()]}
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)
    ]
    snapshots = [{name: p.detach().clone() for name, p in model.named_parameters()}]

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            snapshots.append({name: p.detach().clone() for name, p in model.named_parameters()})

    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=1,
        learning_rate=1e-2,
        weight_decay=0.0,
        report_to=[],
        save_strategy="no",
        logging_steps=100,
        use_cpu=True,
    )
    callbacks = [InterleavedUpdates(), Record()]
    Trainer(model=model, args=args, train_dataset=rows * 3, callbacks=callbacks).train()
    moved = []
    for previous, snapshot in itertools.pairwise(snapshots):
        names = {name for name in snapshot if not torch.equal(snapshot[name], previous[name])}
        router = {name for name in names if is_inference_parameter(name)}
        moved.append((bool(router), bool(names - router)))
    return moved


def test_interleaved_updates_touch_one_group_per_step(tmp_path):
    """k = 2: optimizer steps 0, 1 update the generative model only, step 2 the router only, and so on."""
    expected = [(step % 3 == 2, step % 3 != 2) for step in range(6)]
    assert moved_groups(tmp_path, 2) == expected


def test_the_default_schedule_updates_both_groups_at_every_step(tmp_path):
    """update_schedule=0, the default: every optimizer step updates the generator and the router, so the
    generator gets as many updates as a baseline at equal steps."""
    assert LSLMConfig().update_schedule == 0
    assert moved_groups(tmp_path, 0) == [(True, True)] * 6


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(pooling="first"), "pooling='first'"),
        (dict(prior_mean=1.5), "prior_mean=1.5"),
        (dict(kl_weight=-1.0), "kl_weight=-1.0"),
        (dict(update_schedule=-1), "update_schedule=-1"),
        (dict(decoder_hidden_size=30), "decoder_hidden_size=30"),
        (dict(num_hidden_layers=3), "num_hidden_layers=3"),
    ],
)
def test_invalid_configs_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        LSLMConfig(**{**TINY, **overrides})
