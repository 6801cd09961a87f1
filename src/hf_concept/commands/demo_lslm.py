"""The demo's LSLM stage: a small byte-level LSLM trained from scratch on the bundled corpus with
`ConceptTrainer` and the paper's interleaved updates, its learned segmentation of a sentence, and the
boundary rate inference gives on the validation split next to the rate training sampled at.

Training closes byte t with probability q_t; inference closes bytes by the config's `boundary_rule`
("rate": where the running sum of q passes a half-integer, `LSLMConfig`'s docstring). The stage prints
both rates and whether they agree within ±20%: a segmentation learned in training that generation does not
reproduce would be a silent error.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

AGREEMENT = 0.2  # inference rate within ±20% of the training rate


@dataclass(frozen=True)
class LSLMDemoSizes:
    """Widths, depths and step counts of the demo's LSLM (the paper's p = 0.7, β = 1 are the defaults)."""

    hidden_size: int = 128
    stage_hidden_size: int = 64
    layers: tuple[int, int, int] = (1, 2, 1)
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 200
    lr: float = 2e-3
    eval_rows: int = 32


LSLM_QUICK = LSLMDemoSizes(
    hidden_size=32, stage_hidden_size=32, seq_len=64, batch_size=8, steps=12, eval_rows=8
)


def lslm_config(sizes: LSLMDemoSizes):
    from hf_concept.modeling.configuration_lslm import LSLMConfig

    token, segment, decoder = sizes.layers
    narrow = sizes.stage_hidden_size
    return LSLMConfig(
        hidden_size=sizes.hidden_size,
        intermediate_size=4 * sizes.hidden_size,
        num_attention_heads=sizes.hidden_size // 32,
        token_encoder_layers=token,
        segment_encoder_layers=segment,
        decoder_layers=decoder,
        token_hidden_size=narrow,
        token_num_attention_heads=narrow // 32,
        token_intermediate_size=4 * narrow,
        decoder_hidden_size=narrow,
        decoder_num_attention_heads=narrow // 32,
        decoder_intermediate_size=4 * narrow,
        max_position_embeddings=max(256, sizes.seq_len),
    )


def byte_rows(tokenizer, split: str, seq_len: int, count: int, seed: int) -> list[list[int]]:
    """`count` rows of `seq_len` byte ids: seeded crops of the corpus split, each document `<BoS> ... <eos>`
    (validation: evenly spaced, so the rows cover prose, code and the zh/ja samples)."""
    import torch

    from hf_concept.data.corpus import corpus_documents

    ids: list[int] = []
    for document in tokenizer([text for _, text in corpus_documents(split)])["input_ids"]:
        ids += document
    ids_tensor = torch.tensor(ids)
    last = len(ids) - seq_len
    if split == "train":
        generator = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, last, (count,), generator=generator)
    else:
        starts = torch.linspace(0, last, count).long()
    return [ids_tensor[start : start + seq_len].tolist() for start in starts.tolist()]


def train_lslm(sizes: LSLMDemoSizes, seed: int, work: Path) -> tuple[Any, Any, dict[str, float]]:
    """(model, tokenizer, figures): train with ConceptTrainer + InterleavedUpdates (the config's schedule)
    on byte crops."""
    import torch
    from transformers import default_data_collator

    from hf_concept.commands.demo_training import training_arguments
    from hf_concept.modeling.modeling_lslm import LSLMForCausalLM
    from hf_concept.modeling.tokenization_lslm import ByteTokenizer
    from hf_concept.training.lslm import InterleavedUpdates
    from hf_concept.training.trainer import ConceptTrainer

    tokenizer = ByteTokenizer()
    torch.manual_seed(seed)
    model = LSLMForCausalLM(lslm_config(sizes))
    parameters = sum(p.numel() for p in model.parameters())
    shape = f"{sizes.steps} steps of {sizes.batch_size} x {sizes.seq_len} bytes"
    print(f"  {parameters / 1e6:.2f} M parameters, {shape}")
    rows = byte_rows(tokenizer, "train", sizes.seq_len, sizes.steps * sizes.batch_size, seed)
    dataset = [{"input_ids": torch.tensor(row), "labels": torch.tensor(row)} for row in rows]
    arguments = training_arguments(work, "lslm", sizes.steps, sizes.lr, sizes, seed)
    trainer = ConceptTrainer(
        model=model,
        args=arguments,
        train_dataset=dataset,
        data_collator=default_data_collator,
        callbacks=[InterleavedUpdates()],
    )
    output = trainer.train()
    figures = {"final_train_loss": float(output.training_loss), "parameters": parameters}
    return model, tokenizer, figures


def boundary_rates(model, tokenizer, sizes: LSLMDemoSizes, seed: int) -> dict[str, float]:
    """Training's rate (mean q on fresh train crops, what its Bernoulli draws average to) and inference's
    (thresholded, eval mode) on validation rows; bytes per segment at inference."""
    import torch

    rates: dict[str, float] = {}
    for split, key in (("train", "training"), ("validation", "inference")):
        rows = torch.tensor(byte_rows(tokenizer, split, sizes.seq_len, sizes.eval_rows, seed + 1))
        model.eval()
        with torch.inference_mode():
            output = model(input_ids=rows)
        field = output.expected_boundary_rate if key == "training" else output.boundary_rate
        rates[key] = float(field)
        if key == "inference":
            rates["bytes_per_segment"] = float(output.compression_ratio)
    return rates


def segmented(model, tokenizer, text: str) -> str:
    """`text` with '|' before every byte run that opens a segment (a segment may split a character)."""
    import torch

    input_ids = torch.tensor([tokenizer.encode_prompt(text)["input_ids"]])
    model.eval()
    with torch.inference_mode():
        opens = model(input_ids=input_ids).boundaries[0].tolist()
    pieces: list[bytes] = []
    for token_id, opened in zip(input_ids[0].tolist(), opens, strict=True):
        if token_id in tokenizer.all_special_ids:
            continue
        if opened or not pieces:
            pieces.append(b"")
        pieces[-1] += tokenizer.decode_bytes([token_id])
    return "|".join(piece.decode("utf-8", errors="replace") for piece in pieces)


def run_lslm_stage(sizes: LSLMDemoSizes, seed: int, work: Path, sentence: str) -> dict[str, float]:
    """Train, print the segmentation and both boundary rates; returns the figures."""
    model, tokenizer, figures = train_lslm(sizes, seed, work)
    rates = boundary_rates(model, tokenizer, sizes, seed)
    figures.update(rates)
    agree = abs(rates["inference"] - rates["training"]) <= AGREEMENT * rates["training"]
    figures["rates_agree"] = float(agree)
    print(f"  segmentation ('|' opens a segment): {segmented(model, tokenizer, sentence)}")
    verdict = "within" if agree else "NOT within"
    print(
        f"  boundary rate: training {rates['training']:.3f}, inference {rates['inference']:.3f} on "
        f"validation text ({verdict} ±{AGREEMENT:.0%}); {rates['bytes_per_segment']:.2f} bytes per "
        f"segment (inference rule {model.config.boundary_rule!r})"
    )
    sys.stdout.flush()
    return figures
