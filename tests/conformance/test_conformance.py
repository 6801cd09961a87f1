"""What every family must pass, parametrised over `families.FAMILIES`.

All models are tiny, fp32 and seeded; comparisons state their tolerances. Token ids are drawn from
[3, vocab) so that pad (0), bos (1) and eos (2) never appear by chance.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.testing import assert_close

from hf_concept.modeling.transformers_compat import enable_activation_checkpointing
from tests.conformance.families import FAMILIES, FamilySpec

ATOL = 1e-5
PAD = 0


@pytest.fixture(params=FAMILIES, ids=lambda spec: spec.name)
def spec(request) -> FamilySpec:
    return request.param


def build(spec: FamilySpec, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = spec.model_class()(spec.make_config(**overrides)).eval()
    # Generation runs to max_new_tokens: an eos sampled by chance must not end a comparison early.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model


def random_ids(spec: FamilySpec, *shape: int, seed: int = 1) -> torch.Tensor:
    vocab_size = spec.make_config().vocab_size
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, shape, generator=generator)


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids and mask with each row right-aligned (pads on the left)."""
    length = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), length), PAD, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, length - len(row) :] = row
        attention_mask[index, length - len(row) :] = 1
    return input_ids, attention_mask


@torch.no_grad()
def logits_of(model, input_ids, **kwargs) -> torch.Tensor:
    return model(input_ids=input_ids, **kwargs).logits.float()


def test_forward_backward_finite(spec):
    model = build(spec).train()
    input_ids, attention_mask = left_pad([random_ids(spec, 12, seed=1), random_ids(spec, 7, seed=2)])
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    outputs = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    assert torch.isfinite(outputs.loss)
    assert torch.isfinite(outputs.logits).all()
    outputs.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert grads, "no parameter received a gradient"
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), f"non-finite gradient in {name}"
    assert model.get_input_embeddings().weight.grad.abs().sum() > 0


@pytest.mark.parametrize("cut", [0, 4, 9])
def test_causality_probe(spec, cut):
    """Changing the tokens after position `cut` never moves the logits at positions <= cut."""
    model = build(spec)
    input_ids, attention_mask = left_pad([random_ids(spec, 14, seed=3), random_ids(spec, 11, seed=4)])
    reference = logits_of(model, input_ids, attention_mask=attention_mask)
    perturbed = input_ids.clone()
    tail = random_ids(spec, *perturbed[:, cut + 1 :].shape, seed=5)
    perturbed[:, cut + 1 :] = tail
    changed = logits_of(model, perturbed, attention_mask=attention_mask)
    # Pad columns have no causal meaning (an all-masked row may attend anywhere): compare real tokens.
    kept = attention_mask[:, : cut + 1].bool()
    assert_close(changed[:, : cut + 1][kept], reference[:, : cut + 1][kept], atol=1e-6, rtol=0)
    assert not torch.allclose(changed[0, cut + 1 :], reference[0, cut + 1 :]), "perturbation had no effect"


def _generate(model, input_ids, **kwargs):
    kwargs.setdefault("max_new_tokens", 8)
    kwargs.setdefault("do_sample", False)
    return model.generate(input_ids, return_dict_in_generate=True, output_logits=True, **kwargs)


def test_cached_greedy_equals_recompute(spec):
    model = build(spec)
    prompt = random_ids(spec, 1, 7, seed=6)
    cached = _generate(model, prompt, use_cache=True)
    uncached = _generate(model, prompt, use_cache=False)
    assert torch.equal(cached.sequences, uncached.sequences)
    # Each cached step's logits equal one full forward over the final sequence.
    full = logits_of(model, cached.sequences)
    steps = torch.stack(cached.logits, dim=1).float()
    assert_close(steps, full[:, prompt.shape[1] - 1 : -1], atol=ATOL, rtol=0)
    assert_close(torch.stack(uncached.logits, dim=1).float(), steps, atol=ATOL, rtol=0)


def test_cached_beam_and_sampling_equal_recompute(spec):
    model = build(spec)
    prompt = random_ids(spec, 1, 6, seed=7)
    beam = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6)
    assert torch.equal(
        _generate(model, prompt, use_cache=True, **beam).sequences,
        _generate(model, prompt, use_cache=False, **beam).sequences,
    )
    sampled = []
    for use_cache in (True, False):
        torch.manual_seed(11)
        sampled.append(_generate(model, prompt, use_cache=use_cache, do_sample=True, top_k=0).sequences)
    assert torch.equal(sampled[0], sampled[1])


def test_chunked_prefill_equals_prefill(spec):
    model = build(spec)
    prompt = random_ids(spec, 1, 11, seed=8)
    normal = _generate(model, prompt)
    chunked = _generate(model, prompt, prefill_chunk_size=4)
    assert torch.equal(normal.sequences, chunked.sequences)
    assert_close(torch.stack(chunked.logits, 1), torch.stack(normal.logits, 1), atol=ATOL, rtol=0)


def test_left_padded_batch_equals_rows_alone(spec):
    model = build(spec)
    rows = [random_ids(spec, 5, seed=9), random_ids(spec, 10, seed=10), random_ids(spec, 8, seed=12)]
    input_ids, attention_mask = left_pad(rows)
    batched = _generate(model, input_ids, attention_mask=attention_mask)
    batched_logits = logits_of(model, input_ids, attention_mask=attention_mask)
    for index, row in enumerate(rows):
        alone = _generate(model, row[None])
        assert torch.equal(batched.sequences[index, -8:], alone.sequences[0, -8:]), f"row {index}"
        step_logits = torch.stack([step[index] for step in batched.logits])
        assert_close(step_logits, torch.stack(alone.logits, 1)[0], atol=ATOL, rtol=0)
        row_logits = logits_of(model, row[None])[0]
        assert_close(batched_logits[index, -len(row) :], row_logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_packed_equals_separate(spec, attn_implementation):
    """A row packed as DataCollatorWithFlattening does (positions restart at 0) = its documents apart."""
    model = build(spec)
    model.set_attn_implementation(attn_implementation)
    documents = [random_ids(spec, 6, seed=13), random_ids(spec, 9, seed=14), random_ids(spec, 4, seed=15)]
    packed = torch.cat(documents)[None]
    position_ids = torch.cat([torch.arange(len(doc)) for doc in documents])[None]
    packed_logits = logits_of(model, packed, position_ids=position_ids)
    separate = torch.cat([logits_of(model, doc[None]) for doc in documents], dim=1)
    assert_close(packed_logits, separate, atol=ATOL, rtol=0)


def test_save_load_identical(spec, tmp_path):
    model = build(spec)
    input_ids, attention_mask = left_pad([random_ids(spec, 9, seed=16), random_ids(spec, 6, seed=17)])
    model.save_pretrained(tmp_path)
    loaded = spec.model_class().from_pretrained(tmp_path).eval()
    saved, reloaded = model.state_dict(), loaded.state_dict()
    assert saved.keys() == reloaded.keys()
    assert all(torch.equal(saved[name], reloaded[name]) for name in saved)
    # The weights are bitwise equal; the logits only within ATOL: loaded tensors stay memory-mapped at the
    # file's offsets, and CPU kernels sum in another order when a tensor is not 64-byte aligned.
    assert_close(
        logits_of(loaded, input_ids, attention_mask=attention_mask),
        logits_of(model, input_ids, attention_mask=attention_mask),
        atol=ATOL,
        rtol=0,
    )


FRESH_PROCESS_SCRIPT = textwrap.dedent(
    """
    import sys
    # Block the package even though it is installed in this environment: remote code must not need it.
    sys.modules["hf_concept"] = None
    import json
    import torch
    from transformers import AutoModelForCausalLM

    checkpoint, probe = sys.argv[1], sys.argv[2]
    try:
        import hf_concept  # noqa: F401
        raise SystemExit("hf_concept is importable in the fresh process")
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True).eval()
    module = type(model).__module__
    assert module.startswith("transformers_modules"), module
    data = torch.load(probe)
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits
    # Not bit-exact: one-row expert matmuls may round differently once weights sit elsewhere in memory.
    torch.testing.assert_close(logits, data["logits"], atol=1e-6, rtol=0)
    model.generation_config.eos_token_id = None
    sequences = model.generate(data["input_ids"][:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    labels = data["input_ids"].masked_fill(data["attention_mask"] == 0, -100)
    loss = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"], labels=labels).loss
    loss.backward()
    optimizer.step()
    print(json.dumps({"module": module, "generated": sequences.shape[1], "loss": float(loss)}))
    """
)


def test_remote_code_load_in_fresh_process(spec, tmp_path):
    model = build(spec)
    checkpoint = tmp_path / "checkpoint"
    model.save_pretrained(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    assert "AutoModelForCausalLM" in config["auto_map"], config.get("auto_map")
    assert list(checkpoint.glob("*.py")), "save_pretrained copied no remote-code files"
    input_ids, attention_mask = left_pad([random_ids(spec, 9, seed=18), random_ids(spec, 5, seed=19)])
    probe = tmp_path / "probe.pt"
    logits = logits_of(model, input_ids, attention_mask=attention_mask)
    torch.save({"input_ids": input_ids, "attention_mask": attention_mask, "logits": logits}, probe)
    script = tmp_path / "fresh.py"
    script.write_text(FRESH_PROCESS_SCRIPT)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    env["HF_HUB_OFFLINE"] = "1"
    result = subprocess.run(
        [sys.executable, "-I", str(script), str(checkpoint), str(probe)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["generated"] == input_ids.shape[1] + 4
    assert math.isfinite(report["loss"]), report


def _repeated_dataset(spec: FamilySpec, rows: int = 4, length: int = 16) -> list[dict[str, list[int]]]:
    input_ids = random_ids(spec, rows, length, seed=20)
    return [{"input_ids": row.tolist(), "labels": row.tolist()} for row in input_ids]


def test_trainer_lowers_loss_and_logs_metrics(spec, tmp_path):
    from transformers import TrainingArguments, default_data_collator

    from hf_concept.training import ConceptTrainer

    model = build(spec).train()
    dataset = _repeated_dataset(spec) * 6
    batch = default_data_collator(dataset[:4])
    with torch.no_grad():
        before = model(**batch).loss.item()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=12,
        learning_rate=1e-2,
        logging_steps=4,
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
    with torch.no_grad():
        after = model(**batch).loss.item()
    assert after < before * 0.9, (before, after)
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged, trainer.state.log_history
    for name in spec.logged_metrics:
        assert all(name in entry for entry in logged), (name, logged)
    # Evaluation reports the same figures (the ratio loss is a training term only).
    evaluated = trainer.evaluate(eval_dataset=dataset[:4])
    for name in spec.logged_metrics:
        assert name == "aux_loss" or f"eval_{name}" in evaluated, (name, evaluated)


def _gradients(model, batch) -> dict[str, torch.Tensor]:
    model.zero_grad()
    torch.manual_seed(21)
    model(**batch).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_gives_equal_gradients(spec):
    model = build(spec).train()
    input_ids, attention_mask = left_pad([random_ids(spec, 12, seed=22), random_ids(spec, 8, seed=23)])
    batch = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        labels=input_ids.masked_fill(attention_mask == 0, -100),
    )
    plain = _gradients(model, batch)
    enable_activation_checkpointing(model)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    checkpointed = _gradients(model, batch)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)


def test_peft_lora_wraps_trains_generates_merges(spec):
    from peft import LoraConfig, get_peft_model

    model = build(spec)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(spec.lora_target_modules))
    peft_model = get_peft_model(model, lora)
    trainable = [name for name, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    input_ids = random_ids(spec, 2, 12, seed=24)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    peft_model.train()
    losses = []
    for _ in range(8):
        loss = peft_model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    peft_model.eval()
    prompt = input_ids[:1, :5]
    cached = _generate(peft_model, prompt, use_cache=True)
    uncached = _generate(peft_model, prompt, use_cache=False)
    assert torch.equal(cached.sequences, uncached.sequences)
    adapted = logits_of(peft_model, input_ids)
    merged = peft_model.merge_and_unload()
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    assert_close(logits_of(merged, input_ids), adapted, atol=ATOL, rtol=1e-5)


def test_bf16_forward_finite(spec):
    model = build(spec).to(torch.bfloat16)
    input_ids, attention_mask = left_pad([random_ids(spec, 12, seed=25), random_ids(spec, 7, seed=26)])
    outputs = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)
    assert outputs.logits.dtype == torch.bfloat16
    assert torch.isfinite(outputs.logits).all()
    assert torch.isfinite(outputs.loss)


def test_eager_equals_sdpa(spec):
    model = build(spec)
    input_ids, attention_mask = left_pad([random_ids(spec, 13, seed=27), random_ids(spec, 6, seed=28)])
    results = {}
    with spec.force_boundaries(model):
        for implementation in ("eager", "sdpa"):
            model.set_attn_implementation(implementation)
            results[implementation] = logits_of(model, input_ids, attention_mask=attention_mask)
    real = attention_mask.bool()
    assert_close(results["sdpa"][real], results["eager"][real], atol=ATOL, rtol=0)


INVALID_CASES = [(spec, field, value) for spec in FAMILIES for field, value in spec.invalid_values]


@pytest.mark.parametrize(
    ("case_spec", "field", "value"),
    INVALID_CASES,
    ids=[f"{spec.name}-{field}" for spec, field, _ in INVALID_CASES],
)
def test_invalid_config_value_raises_naming_field(case_spec, field, value):
    with pytest.raises(ValueError) as error:
        case_spec.make_config(**{field: value})
    message = str(error.value)
    assert field in message and str(value) in message, message


def test_registry_names_are_unique():
    names = [spec.name for spec in FAMILIES]
    assert len(names) == len(set(names)), names
