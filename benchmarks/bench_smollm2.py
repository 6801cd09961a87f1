"""A real checkpoint against its conversions: prefill, decode and KV-cache bytes.

Models, all fp32, sdpa, eval, in one process: the source (`--source`, a Llama-family safetensors folder,
e.g. SmolLM2-135M-Instruct), the ConceptMoE checkpoint `--conceptmoe DIR` when given (e.g. the one
`recover_conceptmoe.py --save` wrote, with its trained router), and Hidden Decoding conversions of the
source at n = `--streams` (default 2 and 4), converted here with `convert_to_hidden_decoding` and its
lossless default layout.

Prompts are real text, not random ids: the bundled corpus's validation text then its train text, under
the source's tokenizer, cut at each `--lengths` L. For each L, under `torch.inference_mode`, with one
warm-up and then `--repeats` rounds that time every model in turn (machine noise hits all alike; medians
reported):
- prefill: one cached forward over the L tokens (logits of the last token only, as `generate`);
  tokens/s = L / seconds;
- decode: `--decode-tokens` greedy cached steps after that prefill (the prefill untimed, its cache copied
  per round); tokens/s = steps / seconds;
- KV bytes: the cache after prefill (`num_bytes()` of our caches, which count their per-row state, else
  the key/value tensors' bytes);
each with its ratio against the source in the same run (> 1: faster or, for KV, larger). The ConceptMoE
row also gives the realised tokens per concept of the prompt (thresholded router).

    python benchmarks/bench_smollm2.py --source DIR [--conceptmoe DIR] [--streams 2,4]
        [--lengths 512,2048] [--decode-tokens 128] [--repeats 3] [--threads 2] [--json OUT]

`--quick`: a tiny random Llama with the bundled tokenizer, its R = 2 ConceptMoE conversion as
`--conceptmoe`, short lengths: a smoke test of the script (seconds).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_hidden_decoding import greedy_decode, interleaved_medians, prefill
from recover_conceptmoe import tiny_source

from hf_concept.conversion.conceptmoe import convert_to_conceptmoe
from hf_concept.conversion.hidden_decoding import convert_to_hidden_decoding
from hf_concept.data.corpus import corpus_text
from hf_concept.modeling.forward_only_cache import cache_num_bytes
from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM
from hf_concept.modeling.modeling_hidden_decoding import HiddenDecodingForCausalLM
from hf_concept.modeling.transformers_compat import output_cache
from hf_concept.tables import format_table
from hf_concept.training.sweep import atomic_write_json


def _int_list(text: str) -> list[int]:
    return [int(value) for value in text.split(",") if value]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", help="the source checkpoint folder (safetensors)")
    parser.add_argument("--conceptmoe", default=None, help="a converted ConceptMoE checkpoint (optional)")
    parser.add_argument("--streams", type=_int_list, default=[2, 4], help="Hidden Decoding n, e.g. 2,4")
    parser.add_argument("--lengths", type=_int_list, default=[512, 2048], help="prompt tokens, e.g. 512,2048")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the rows here (atomically)")
    parser.add_argument("--quick", action="store_true", help="smoke run on a tiny model (seconds)")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.decode_tokens, args.repeats, args.threads = [16, 24], 3, 1, 1
    elif not args.source:
        parser.error("--source is required (or --quick)")
    numbers = [*args.lengths, *args.streams, args.decode_tokens, args.repeats, args.threads]
    if not args.lengths or min(numbers) < 1:
        parser.error("--lengths, --streams, --decode-tokens, --repeats and --threads must be >= 1")
    return args


def prompt_ids(tokenizer, length: int) -> torch.Tensor:
    """(1, length) ids of real text: the bundled validation text, then the train text where needed."""
    # Eight characters per token are plenty for any tokenizer: the rest is not tokenised.
    text = (corpus_text("validation") + "\n\n" + corpus_text("train"))[: 8 * length]
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, :length]
    if ids.shape[1] < length:
        raise ValueError(f"--lengths {length}: the bundled text gives only {ids.shape[1]} tokens")
    return ids


def load_models(args: argparse.Namespace, source: Path, conceptmoe: Path | None, scratch: Path) -> dict:
    """Name -> model (eval, fp32): the source, the ConceptMoE checkpoint if any, HD at each n."""
    from transformers import AutoModelForCausalLM

    models = {"source": AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)}
    if conceptmoe is not None:
        models["conceptmoe"] = ConceptMoEForCausalLM.from_pretrained(conceptmoe, dtype=torch.float32)
    for streams in args.streams:
        folder = convert_to_hidden_decoding(source, scratch / f"hd{streams}", num_streams=streams)
        models[f"hd n={streams}"] = HiddenDecodingForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for model in models.values():
        model.eval()
    return models


def timed_prefill(model: nn.Module, input_ids: torch.Tensor):
    """A call that runs one cached prefill over `input_ids` and returns its seconds."""

    def run() -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            prefill(model, input_ids)
            return time.perf_counter() - start

    return run


@torch.inference_mode()
def prefill_figures(model: nn.Module, input_ids: torch.Tensor) -> dict:
    """KV bytes after prefill and, for a ConceptMoE model, the prompt's realised tokens per concept."""
    output = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
    figures = {"kv_bytes": cache_num_bytes(output_cache(output))}
    # Eval mode: the thresholded boundaries, what generation realises.
    ratio = getattr(output, "inference_compression_ratio", None)
    if ratio is not None:
        figures["tokens_per_concept"] = float(ratio)
    return figures


def measure(models: dict, tokenizer, args: argparse.Namespace) -> list[dict]:
    """One row per (model, length): prefill and decode tokens/s, KV bytes, each against the source."""
    rows = []
    for length in args.lengths:
        input_ids = prompt_ids(tokenizer, length)
        prefill_calls = {name: timed_prefill(model, input_ids) for name, model in models.items()}
        prefill_seconds = interleaved_medians(prefill_calls, args.repeats, f"prefill L={length}")
        decode_calls = {
            name: greedy_decode(model, input_ids, args.decode_tokens) for name, model in models.items()
        }
        decode_seconds = interleaved_medians(decode_calls, args.repeats, f"decode L={length}")
        for name, model in models.items():
            row = {"model": name, "length": length, **prefill_figures(model, input_ids)}
            row["prefill_tokens_per_s"] = length / prefill_seconds[name]
            row["decode_tokens_per_s"] = args.decode_tokens / decode_seconds[name]
            rows.append(row)
        source = next(row for row in rows if row["model"] == "source" and row["length"] == length)
        for row in rows[-len(models) :]:
            for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "kv_bytes"):
                row[f"{key}_vs_source"] = row[key] / source[key]
    return rows


def print_rows(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\nprefill / decode ({args.decode_tokens} greedy tokens) / KV after prefill; medians of "
        f"{args.repeats}; x = ratio to the source in this run"
    )
    cells = []
    for row in rows:
        concepts = row.get("tokens_per_concept")
        prefill = [f"{row['prefill_tokens_per_s']:.1f}", f"{row['prefill_tokens_per_s_vs_source']:.2f}"]
        decode = [f"{row['decode_tokens_per_s']:.2f}", f"{row['decode_tokens_per_s_vs_source']:.2f}"]
        kv = [f"{row['kv_bytes'] / 2**20:.2f}", f"{row['kv_bytes_vs_source']:.2f}"]
        tokens_per_concept = "" if concepts is None else f"{concepts:.2f}"
        cells.append([row["model"], row["length"], *prefill, *decode, *kv, tokens_per_concept])
    headers = ("model", "L", "prefill tok/s", "x", "decode tok/s", "x", "KV MiB", "x", "tok/concept")
    print(format_table(headers, cells, align="<>", widths=(12, 6, 14, 6, 13, 6, 8, 6, 11), sep=" "))


def quick_models(folder: Path) -> tuple[Path, Path]:
    """A tiny random Llama with the bundled tokenizer and its R = 2 ConceptMoE conversion."""
    source = tiny_source(folder)
    convert_to_conceptmoe(source, folder / "conceptmoe", encoder_layers=1, decoder_layers=1)
    return source, folder / "conceptmoe"


def main(argv: list[str] | None = None) -> list[dict]:
    from transformers import AutoTokenizer

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-smollm2-") as scratch:
        scratch = Path(scratch)
        if args.quick:
            source, conceptmoe = quick_models(scratch)
        else:
            source, conceptmoe = Path(args.source), args.conceptmoe and Path(args.conceptmoe)
        tokenizer = AutoTokenizer.from_pretrained(source)
        models = load_models(args, source, conceptmoe, scratch)
        rows = measure(models, tokenizer, args)
    print_rows(rows, args)
    if args.json:
        atomic_write_json(Path(args.json), {"args": vars(args), "torch": torch.__version__, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
