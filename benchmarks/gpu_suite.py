"""Every family on one GPU in one call: exactness of the varlen path, attention kernels, training steps,
prefill and decode against a matched baseline, DLCM's cross-attention forms.

Legend: B batch, L context (tokens), R tokens per concept, n streams, D width.

Built from configs with random weights (speed and memory do not depend on them): the plain decoder is the
baseline ("source"); ConceptMoE (2 encoder + 2 decoder layers, fixed chunking at R, the rest concept
layers) and Hidden Decoding (n streams, one full layer in four, the others intra-stream) have exactly the
shapes a conversion of that source gives; DLCM has the source's token width and layer count (1 encoder,
2 decoder layers, the rest concept layers at the same width) with fixed chunking at R. bf16, timings
synchronised (CUDA events), medians of `--repeats` runs after a warm-up. Sections, in order of value
per second so that a run cut short keeps the most useful ones:

1. exactness: per family, logits at the real tokens of a padded batch and of a packed row against eager
   fp32, as max |Δ|: sdpa fp32, the varlen path in fp32 (its bookkeeping with `varlen_reference` as the
   kernel: the kernel runs in half precision only), sdpa bf16, varlen bf16 (the kernel). Acceptance:
   fp32 <= 1e-4; varlen bf16 within the spread of sdpa bf16. Plus the attention function alone on
   packed documents with a window and GQA.
2. kernel: one attention layer's worth (packed documents of random lengths, H = 16, G = 4, K = 64) at
   each context: varlen against sdpa with the block-diagonal mask, forward and forward + backward.
3. dlcm-forms: DLCM's cross-attention alone, replicated on the varlen kernel, replicated on masked sdpa
   and counted, with and without backward, at each context and R in 2, 4, 8: the rows of
   `dlcm_replication.CUDA_MEASURED_FORMS` ("auto" on CUDA) come from this table.
4. training: one step (forward + backward of the LM loss) of a packed row of L tokens (documents of
   random lengths) per family, under sdpa (masks) and hf_concept_varlen; time and peak memory.
5. inference: per family and its baseline, prefill (`logits_to_keep=1`) and `--decode-steps` cached
   greedy steps after it, at each context and batch (cells over `--max-batch-tokens` skipped as too
   large); time, tokens/s and peak memory.

The script keeps to `--budget-s` (default 450 s, for an 8-minute device call): before each measurement it
checks the time left against what the measurement is expected to take, and on running out it writes what
it has, says in `status` where it stopped, and exits 0. Results go to `--out DIR` as `gpu_suite.json` and
`gpu_suite.md`, rewritten after every measurement (so a killed run keeps them too).

`--cpu-smoke` (alias `--dry-run`) runs every section on minuscule sizes on CPU, the varlen path on
`varlen_reference` instead of the CUDA kernel, in seconds (tested in the default suite).

    python benchmarks/gpu_suite.py --out runs/gpu [--budget-s 450] [--contexts 2048,8192,32768]
        [--batches 1,16] [--families plain,conceptmoe,dlcm,hidden_decoding]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_concept.modeling import dlcm_replication
from hf_concept.modeling.configuration_conceptmoe import ConceptMoEConfig
from hf_concept.modeling.configuration_dlcm import DLCMConfig
from hf_concept.modeling.configuration_hidden_decoding import HiddenDecodingConfig
from hf_concept.modeling.configuration_plain import PlainDecoderConfig
from hf_concept.modeling.layers import eager_attention_forward
from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM
from hf_concept.modeling.modeling_dlcm import DLCMForCausalLM
from hf_concept.modeling.modeling_hidden_decoding import HiddenDecodingForCausalLM
from hf_concept.modeling.modeling_plain import PlainDecoderForCausalLM
from hf_concept.modeling.transformers_compat import cache_kwarg, output_cache
from hf_concept.modeling.varlen import (
    VARLEN_ATTENTION,
    kernel_for,
    layout_from_position_ids,
    layout_mask,
    use_varlen_kernel,
    varlen_attention_forward,
    varlen_reference,
)
from hf_concept.tables import format_table

FAMILIES = ("plain", "conceptmoe", "dlcm", "hidden_decoding")
SMOKE = dict(
    contexts="32,64",
    batches="1,2",
    hidden=32,
    layers=5,
    heads=4,
    kv_heads=2,
    vocab=97,
    decode_steps=2,
    repeats=1,
    max_batch_tokens=128,
    exact_length=24,
    forms_ratios="2,4",
)


class OutOfBudgetError(Exception):
    """Raised before a measurement that would not finish within the budget."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=450.0)
    parser.add_argument("--cpu-smoke", "--dry-run", dest="cpu_smoke", action="store_true")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--sections", default="exactness,kernel,dlcm-forms,training,inference")
    parser.add_argument("--contexts", default="2048,8192,32768")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--max-batch-tokens", type=int, default=131072)
    parser.add_argument("--training-contexts", default="2048,8192")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--inference-attn", default=f"sdpa,{VARLEN_ATTENTION}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--ratio", type=int, default=4, help="tokens per concept (fixed chunking)")
    parser.add_argument("--streams", type=int, default=2, help="Hidden Decoding's n")
    parser.add_argument("--exact-length", type=int, default=512)
    parser.add_argument("--forms-ratios", default="2,4,8")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
        args.training_contexts = args.contexts
    for key in ("contexts", "batches", "training_contexts", "forms_ratios"):
        setattr(args, key, [int(item) for item in getattr(args, key).split(",")])
    args.inference_attn = args.inference_attn.split(",")
    args.families = args.families.split(",")
    args.sections = args.sections.split(",")
    unknown = set(args.families) - set(FAMILIES)
    if unknown:
        parser.error(f"--families: unknown {sorted(unknown)}; choose from {FAMILIES}")
    return args


class Clock:
    """Synchronised timing: CUDA events on a GPU, perf_counter elsewhere; and the run's budget."""

    def __init__(self, device: torch.device, budget_s: float) -> None:
        self.device, self.budget_s, self.started = device, budget_s, time.perf_counter()

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def require(self, estimate_s: float) -> None:
        if estimate_s > self.left():
            raise OutOfBudgetError(f"needs ~{estimate_s:.0f} s, {self.left():.0f} s left")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, run: Callable[[], Any], repeats: int) -> float:
        """Median seconds of `repeats` runs after one warm-up run."""
        run()
        self.sync()
        times = []
        for _ in range(repeats):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                torch.cuda.synchronize(self.device)
                times.append(start.elapsed_time(end) / 1000)
            else:
                begin = time.perf_counter()
                run()
                times.append(time.perf_counter() - begin)
        return statistics.median(times)

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float | None:
        if self.device.type != "cuda":
            return None
        return torch.cuda.max_memory_allocated(self.device) / 2**30


class Results:
    """The run's sections, written as JSON and Markdown after every row."""

    def __init__(self, out: Path, meta: dict[str, Any]) -> None:
        self.out, self.meta, self.sections = out, meta, {}
        out.mkdir(parents=True, exist_ok=True)

    def add(self, section: str, row: dict[str, Any]) -> None:
        self.sections.setdefault(section, []).append(row)
        self.write()

    def write(self) -> None:
        payload = {"meta": self.meta, "sections": self.sections}
        for name, text in (
            ("gpu_suite.json", json.dumps(payload, indent=1)),
            ("gpu_suite.md", self.markdown()),
        ):
            partial = self.out / f".{name}.partial"
            partial.write_text(text)
            os.replace(partial, self.out / name)

    def markdown(self) -> str:
        lines = [f"# GPU suite: {self.meta['device']}", ""]
        lines += [f"- {key}: {value}" for key, value in self.meta.items() if key != "device"]
        for section, rows in self.sections.items():
            keys = list(dict.fromkeys(key for row in rows for key in row))
            lines += ["", f"## {section}", ""]
            lines.append(
                format_table(keys, [[_cell(row.get(key)) for key in keys] for row in rows], markdown=True)
            )
        return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "" if value is None else str(value)


def backbone(args: argparse.Namespace, max_length: int) -> dict[str, Any]:
    return dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=max_length,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def family_config(family: str, args: argparse.Namespace, max_length: int):
    """The family's config at the run's sizes (see the module docstring for the shapes)."""
    common = backbone(args, max_length)
    layers = args.layers
    if family == "plain":
        return PlainDecoderConfig(**common, num_hidden_layers=layers)
    if family == "conceptmoe":
        return ConceptMoEConfig(
            **common,
            num_hidden_layers=layers,
            encoder_layers=2,
            decoder_layers=2,
            chunking="fixed",
            compression_ratio=float(args.ratio),
        )
    if family == "dlcm":
        return DLCMConfig(
            **common,
            encoder_layers=1,
            concept_layers=layers - 3,
            decoder_layers=2,
            chunking="fixed",
            compression_ratio=float(args.ratio),
        )
    layout = ["full" if (index + 1) % 4 == 0 else "intra" for index in range(layers)]
    common["max_position_embeddings"] = max_length * args.streams
    return HiddenDecodingConfig(
        **common, num_hidden_layers=layers, num_streams=args.streams, stream_attention_layout=layout
    )


MODEL_CLASSES = {
    "plain": PlainDecoderForCausalLM,
    "conceptmoe": ConceptMoEForCausalLM,
    "dlcm": DLCMForCausalLM,
    "hidden_decoding": HiddenDecodingForCausalLM,
}


def build(family: str, args: argparse.Namespace, max_length: int, device, dtype, implementation: str):
    torch.manual_seed(args.seed)
    config = family_config(family, args, max_length)
    # Initialised on the device itself: random init of ~100M parameters on the host takes seconds.
    with torch.device(device):
        model = MODEL_CLASSES[family]._from_config(config, attn_implementation=implementation, dtype=dtype)
    return model.eval()


def packed_position_ids(length: int, generator: torch.Generator, min_document: int = 16) -> torch.Tensor:
    """(1, L) position ids of documents of random lengths packed in one row (at least `min_document`)."""
    positions, left = [], length
    while left > 0:
        size = min(
            left,
            int(torch.randint(min_document, max(min_document + 1, length // 2), (1,), generator=generator)),
        )
        positions.append(torch.arange(size))
        left -= size
    return torch.cat(positions)[None]


def real_logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(**batch).logits.float()
    real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
    return logits[real]


def exactness_batches(args: argparse.Namespace, device) -> list[tuple[str, dict[str, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(args.seed)
    length = args.exact_length
    input_ids = torch.randint(3, args.vocab, (2, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, : length // 3] = 0
    position_ids = packed_position_ids(length, generator, min_document=4)
    padded = dict(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device))
    packed = dict(input_ids=input_ids[:1].to(device), position_ids=position_ids.to(device))
    return [("padded", padded), ("packed", packed)]


def section_exactness(args, clock: Clock, results: Results, device) -> None:
    for family in args.families:
        for name, batch in exactness_batches(args, device):
            clock.require(10)
            model = build(family, args, args.exact_length, device, torch.float32, "eager")
            if family == "dlcm":
                # The replicated form is what the varlen kernel runs.
                model.config.cross_attention_form = "replicated"
            reference = real_logits(model, batch)
            row = {"family": family, "batch": name}
            row["sdpa fp32"] = _delta(model, "sdpa", batch, reference)
            with use_varlen_kernel(varlen_reference):
                row["varlen fp32 (reference kernel)"] = _delta(model, VARLEN_ATTENTION, batch, reference)
            model.to(torch.bfloat16)
            row["sdpa bf16"] = _delta(model, "sdpa", batch, reference)
            row["varlen bf16"] = _delta(model, VARLEN_ATTENTION, batch, reference)
            row["fp32 ok (1e-4)"] = row["varlen fp32 (reference kernel)"] <= 1e-4
            row["bf16 within sdpa spread"] = row["varlen bf16"] <= max(2 * row["sdpa bf16"], 1e-2)
            results.add("exactness", row)
    section_kernel_exactness(args, clock, results, device)


def _delta(model, implementation: str, batch, reference: torch.Tensor) -> float:
    model.set_attn_implementation(implementation)
    return float((real_logits(model, batch) - reference).abs().max())


class Head(torch.nn.Module):
    """What attention functions read from their module."""

    def __init__(self, num_heads: int, kv_heads: int) -> None:
        super().__init__()
        self.is_causal, self.training = True, False
        self.num_key_value_groups = num_heads // kv_heads


def kernel_case(length: int, device, dtype, generator, window: int | None = None):
    """Packed documents in one row: q, k, v (1, H, L, K), the block-diagonal (windowed) mask, the module."""
    position_ids = packed_position_ids(length, generator)
    layout = layout_from_position_ids(position_ids, sliding_window=window)
    mask = layout_mask(layout, 1, length, length).to(device)
    shapes = [(1, 16, length, 64), (1, 4, length, 64), (1, 4, length, 64)]
    tensors = [torch.randn(shape, generator=generator).to(device, dtype) for shape in shapes]
    return tensors, mask, Head(16, 4)


def section_kernel_exactness(args, clock: Clock, results: Results, device) -> None:
    generator = torch.Generator().manual_seed(args.seed)
    for window in (None, 64):
        clock.require(5)
        (query, key, value), mask, module = kernel_case(
            args.exact_length, device, torch.float32, generator, window
        )
        reference, _ = eager_attention_forward(module, query, key, value, mask, scaling=0.125)
        real = mask[:, 0].any(-1)
        row = {"family": "attention alone", "batch": f"packed, window {window}"}
        names = {"fp32": "varlen fp32 (reference kernel)", "bf16": "varlen bf16"}
        for dtype in (torch.float32, torch.bfloat16):
            tensors = [t.to(dtype) for t in (query, key, value)]
            label = "fp32" if dtype == torch.float32 else "bf16"
            sdpa, _ = sdpa_attention_forward(module, *tensors, mask, scaling=0.125)
            context = (
                use_varlen_kernel(varlen_reference) if dtype == torch.float32 else contextlib.nullcontext()
            )
            with context:
                output, _ = varlen_attention_forward(module, *tensors, mask, scaling=0.125)
            row[f"sdpa {label}"] = float((sdpa.float() - reference)[real].abs().max())
            row[names[label]] = float((output.float() - reference)[real].abs().max())
        results.add("exactness", row)


def section_kernel(args, clock: Clock, results: Results, device, dtype) -> None:
    generator = torch.Generator().manual_seed(args.seed)
    for length in args.contexts:
        for backward in (False, True):
            clock.require(8 * (length / 8192) ** 2 + 3)
            tensors, mask, module = kernel_case(length, device, dtype, generator)
            row = {"L": length, "pass": "fwd+bwd" if backward else "fwd"}
            for name, function, given_mask in (
                ("varlen", varlen_attention_forward, mask),
                ("sdpa masked", sdpa_attention_forward, mask),
                ("sdpa causal (no packing, lower bound)", sdpa_attention_forward, None),
            ):
                run = _attention_run(module, function, tensors, given_mask, backward)
                row.update(timed(f"{name} ms", clock, run, args.repeats))
            if "varlen ms" in row and "sdpa masked ms" in row:
                row["varlen / sdpa masked"] = row["varlen ms"] / row["sdpa masked ms"]
            results.add("kernel", row)
            del tensors, mask


def _attention_run(module, function, tensors, mask, backward: bool) -> Callable[[], None]:
    leaves = [t.detach().requires_grad_(backward) for t in tensors]

    def run() -> None:
        with torch.set_grad_enabled(backward):
            output, _ = function(module, *leaves, mask, scaling=0.125)
            if backward:
                output.float().square().mean().backward()

    return run


def training_batch(length: int, args, device, generator) -> dict[str, torch.Tensor]:
    input_ids = torch.randint(3, args.vocab, (1, length), generator=generator).to(device)
    position_ids = packed_position_ids(length, generator).to(device)
    return dict(input_ids=input_ids, position_ids=position_ids, labels=input_ids)


def section_training(args, clock: Clock, results: Results, device, dtype) -> None:
    generator = torch.Generator().manual_seed(args.seed)
    for length in args.training_contexts:
        batch = training_batch(length, args, device, generator)
        for family in args.families:
            clock.require(6 * length / 8192 + 4)
            model = build(family, args, length, device, dtype, "sdpa").train()
            row = {"family": family, "L (packed row)": length}
            for implementation in ("sdpa", VARLEN_ATTENTION):
                model.set_attn_implementation(implementation)

                clock.reset_peak()
                step = _training_step(model, batch)
                row.update(timed(f"{implementation} step ms", clock, step, args.repeats))
                row[f"{implementation} peak GiB"] = clock.peak_gib()
            if f"{VARLEN_ATTENTION} step ms" in row and "sdpa step ms" in row:
                row["varlen / sdpa"] = row[f"{VARLEN_ATTENTION} step ms"] / row["sdpa step ms"]
            results.add("training", row)
            del model


def _training_step(model, batch: dict[str, torch.Tensor]) -> Callable[[], None]:
    def step() -> None:
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def section_inference(args, clock: Clock, results: Results, device, dtype) -> None:
    """Each family built once (the plain baseline first), every cell under each attention implementation;
    ratios against the plain baseline's row of the same cell and implementation."""
    generator = torch.Generator().manual_seed(args.seed)
    longest = max(args.contexts) + args.decode_steps + 1
    cells = [(length, batch) for length in args.contexts for batch in args.batches]
    prompts = {
        cell: torch.randint(3, args.vocab, cell[::-1], generator=generator)
        for cell in cells
        if cell[0] * cell[1] <= args.max_batch_tokens
    }
    for length, batch in cells:
        if (length, batch) not in prompts:
            results.add("inference", {"L": length, "B": batch, "note": "skipped: over --max-batch-tokens"})
    baselines: dict[tuple, dict] = {}
    for family in ["plain", *(family for family in args.families if family != "plain")]:
        clock.require(10)
        model = build(family, args, longest, device, dtype, "sdpa")
        for (length, batch), input_ids in prompts.items():
            for implementation in args.inference_attn:
                clock.require(4 * batch * length / 65536 + 3)
                model.set_attn_implementation(implementation)
                row = {"family": family, "attn": implementation, "L": length, "B": batch}
                row.update(
                    attempt(functools.partial(_prefill_decode, model, input_ids.to(device), args, clock))
                )
                base = baselines.setdefault((implementation, length, batch), row)
                if base is not row and "prefill ms" in row and "prefill ms" in base:
                    row["prefill / plain"] = row["prefill ms"] / base["prefill ms"]
                    row["decode tok/s / plain"] = row["decode tok/s"] / base["decode tok/s"]
                results.add("inference", row)
        del model


def timed(key: str, clock: Clock, run: Callable[[], None], repeats: int) -> dict[str, Any]:
    """{key: median milliseconds} of `run`, or {key + " error": what went wrong}."""
    figures = attempt(lambda: {key: 1000 * clock.time(run, repeats)})
    return {f"{key} error" if name == "error" else name: value for name, value in figures.items()}


def attempt(measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The measurement's figures, or its error (out of memory, say) so that the run goes on."""
    try:
        return measure()
    except OutOfBudgetError:
        raise
    except Exception as error:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"error": f"{type(error).__name__}: {str(error)[:160]}"}


def _prefill_decode(model, input_ids: torch.Tensor, args, clock: Clock) -> dict[str, Any]:
    def prefill():
        with torch.no_grad():
            return model(input_ids=input_ids, use_cache=True, logits_to_keep=1)

    clock.reset_peak()
    prefill_s = clock.time(prefill, args.repeats)
    prefill_peak = clock.peak_gib()

    def decode() -> None:
        with torch.no_grad():
            output = prefill()
            cache = output_cache(output)
            token = output.logits[:, -1:].argmax(-1)
            clock.sync()
            decode.start = time.perf_counter()
            for _ in range(args.decode_steps):
                output = model(input_ids=token, **cache_kwarg(cache), use_cache=True, logits_to_keep=1)
                cache, token = output_cache(output), output.logits[:, -1:].argmax(-1)
            clock.sync()
            decode.seconds = time.perf_counter() - decode.start

    seconds = []
    for _ in range(max(1, args.repeats)):
        decode()
        seconds.append(decode.seconds)
    steps = statistics.median(seconds)
    return {
        "prefill ms": 1000 * prefill_s,
        "prefill peak GiB": prefill_peak,
        "decode tok/s": input_ids.shape[0] * args.decode_steps / steps,
        "decode peak GiB": clock.peak_gib(),
    }


def section_dlcm_forms(args, clock: Clock, results: Results, device, dtype) -> None:
    generator = torch.Generator().manual_seed(args.seed)
    for length in args.contexts:
        for ratio in args.forms_ratios:
            for training in (True, False):
                clock.require(6 * length / 8192 + 3)
                row = {"L": length, "R": ratio, "training": training}
                for form, run in _form_runs(length, ratio, training, device, dtype, generator).items():
                    row.update(timed(f"{form} ms", clock, run, args.repeats))
                forms = {key.removesuffix(" ms"): value for key, value in row.items() if key.endswith(" ms")}
                row["fastest"] = min(forms, key=forms.get) if forms else None
                results.add("dlcm-forms", row)


def _form_runs(
    length: int, ratio: int, training: bool, device, dtype, generator
) -> dict[str, Callable[[], None]]:
    """One cross-attention (8 heads, 4 KV heads, K = 64) over fixed chunks of R tokens, in each form."""
    num_slots = length // ratio + 1
    query = torch.randn(1, 8, length, 64, generator=generator).to(device, dtype)
    concept_k, concept_v = (
        torch.randn(1, 4, num_slots, 64, generator=generator).to(device, dtype) for _ in range(2)
    )
    index = (torch.arange(length, device=device) // ratio)[None]  # slot 0: the null concept
    mask = torch.ones(1, length, dtype=torch.bool, device=device)
    starts = torch.zeros_like(mask)
    starts[:, 0] = True
    counts = dlcm_replication.concept_counts(index, mask, starts, num_slots)
    kernel = kernel_for(query)

    def wrap(function: Callable[..., torch.Tensor]) -> Callable[[], None]:
        leaves = [t.detach().requires_grad_(training) for t in (query, concept_k, concept_v)]

        def run() -> None:
            with torch.set_grad_enabled(training):
                output = function(*leaves)
                if training:
                    output.float().square().mean().backward()

        return run

    return {
        "replicated varlen": wrap(
            lambda q, k, v: dlcm_replication.replicated_concept_attention_varlen(
                q, k, v, index, mask, starts, varlen_kernel=kernel
            )
        ),
        "replicated sdpa": wrap(
            lambda q, k, v: dlcm_replication.replicated_concept_attention(
                q, k, v, index, mask, starts, plain_causal=True
            )
        ),
        "counted": wrap(lambda q, k, v: dlcm_replication.concept_attention_counted(q, k, v, counts)),
    }


SECTIONS = {
    "exactness": lambda args, clock, results, device, dtype: section_exactness(args, clock, results, device),
    "kernel": section_kernel,
    "training": section_training,
    "inference": section_inference,
    "dlcm-forms": section_dlcm_forms,
}


def meta_of(args, device) -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({platform.processor() or 'cpu'}), smoke"
    )
    return {
        "device": name,
        "commit": commit or "unknown",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "dtype": "bfloat16",
        "sizes": f"D={args.hidden}, layers={args.layers}, H={args.heads}, G={args.kv_heads}, V={args.vocab}, "
        f"R={args.ratio}, n={args.streams}",
        "budget_s": args.budget_s,
    }


@contextlib.contextmanager
def kernel_for_run(args) -> Iterator[None]:
    """On CPU (the smoke run) the varlen path runs on the per-segment reference instead of the kernel."""
    if args.cpu_smoke:
        with use_varlen_kernel(varlen_reference):
            yield
    else:
        yield


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("gpu_suite.py needs CUDA; use --cpu-smoke to run its code paths on CPU")
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    clock = Clock(device, args.budget_s)
    results = Results(args.out, meta_of(args, device))
    status = "complete"
    with kernel_for_run(args):
        for section in args.sections:
            try:
                SECTIONS[section](args, clock, results, device, torch.bfloat16)
            except OutOfBudgetError as stop:
                status = f"stopped in {section}: {stop}"
                break
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    results.meta["status"] = status
    results.meta["elapsed_s"] = round(args.budget_s - clock.left(), 1)
    results.write()
    print((args.out / "gpu_suite.md").read_text())
    return {"meta": results.meta, "sections": results.sections}


if __name__ == "__main__":
    main()
