"""`hf-concept demo`: the main job, end to end on this machine.

Until the ConceptMoE and Hidden Decoding families land, the demo shows the foundation they stand on:
it builds a tiny random Llama with transformers, saves it as a sharded checkpoint, loads that checkpoint
into hf_concept's own decoder stack (the layers every family is built from), checks that both give the
same logits, saves the stack as a remote-code checkpoint and reloads it with `trust_remote_code=True`.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="Run the end-to-end demo (the README's main job).")
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="Where to write the checkpoints (default: a temporary folder, removed afterwards).",
    )
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    if args.output_dir is None:
        with tempfile.TemporaryDirectory(prefix="hf-concept-demo-") as tmp:
            return _run_in(Path(tmp), args.seed, keep=False)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    return _run_in(args.output_dir, args.seed, keep=True)


def _run_in(output_dir: Path, seed: int, keep: bool) -> int:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from hf_concept.conversion.sources import load_source_into_plain

    steps = tqdm(total=4, desc="demo", unit="step")
    torch.manual_seed(seed)
    source_config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    source = LlamaForCausalLM(source_config).eval()
    source_dir = output_dir / "tiny-llama"
    source.save_pretrained(source_dir, max_shard_size="100KB")
    steps.update()

    ours = load_source_into_plain(source_dir).eval()
    steps.update()

    text = "Concepts compress what tokens repeat."
    input_ids = torch.tensor([list(text.encode("utf-8"))])
    with torch.no_grad():
        expected = source(input_ids).logits
        actual = ours(input_ids).logits
    steps.update()

    ours_dir = output_dir / "tiny-llama-hf-concept"
    ours.save_pretrained(ours_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(ours_dir, trust_remote_code=True).eval()
    with torch.no_grad():
        reloaded_logits = reloaded(input_ids).logits
    steps.update()
    steps.close()

    source_diff = (expected - actual).abs().max().item()
    reload_diff = (actual - reloaded_logits).abs().max().item()
    where = "" if keep else " (temporary: pass --output-dir to keep it)"
    rows = [
        ("source checkpoint", f"{source_dir}{where}"),
        ("hf_concept checkpoint", f"{ours_dir}{where}"),
        ("tokens in forward pass", str(input_ids.shape[1])),
        ("max |logit diff| vs transformers Llama", f"{source_diff:.2e}"),
        ("max |logit diff| after remote-code reload", f"{reload_diff:.2e}"),
    ]
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    ok = source_diff < 1e-4 and reload_diff == 0.0
    print("\nresult:", "OK" if ok else "MISMATCH")
    return 0 if ok else 1
