"""Train a ConceptMoE dynamic router to R = 2 on the bundled corpus, for `bench_conceptmoe.py --trained`.

Writes OUT/source and OUT/conceptmoe (each a `save_pretrained` folder with the bundled tokenizer) and
OUT/training.json (the arguments, the loss and ratio curves, the held-out figures, the wall time):

1. source: a `LlamaForCausalLM` of the benchmark's shape (12 layers, width 256, 4 heads, 2 KV heads, MLP
   1024, untied head) on the bundled BPE vocabulary (`hf_concept.data.bpe.bundled_tokenizer`, 3072 ids),
   pretrained from a seeded init for `--pretrain-steps` AdamW steps on the corpus's train split
   (`hf_concept.data.corpus`), each step `--batch-size` random crops of `--context` tokens of one train
   document (`eval_bits_per_byte.sample_batch`), lr warm-up over 10% of the steps then cosine to 10%
   (`eval_bits_per_byte.learning_rate_factor`), clip 1.0. It is short: enough for greedy decoding to
   produce text-like tokens (a sample is printed), far from a converged model.
2. conversion: `convert_to_conceptmoe` with the dynamic cosine router, R = `--ratio`, the default
   2 encoder / 2 decoder layers (the benchmark's split), router initialised from `--seed`.
3. continued training: every parameter, `--router-steps` steps on other crops of the same split, same
   schedule shape at `--router-lr`, loss = LM loss + `--aux-loss-weight` · ratio loss with
   `ratio_scope="batch"` (F and G over the step's one batch: no accumulator needed). λ defaults to 0.3,
   not the paper's 0.03: the demo measured that a brief fine-tune needs the firmer pull
   (`hf_concept.commands.demo.DemoSizes.aux_loss_weight`); the value is saved in the config.

At the end it prints, on the corpus's validation split (non-overlapping `--context`-token windows of each
document, every window starting a concept), the held-out LM loss of source and converted model and the
converted model's realised inference ratio (thresholded boundaries: real tokens per concept). Nothing is
chosen by looking at it. OUT is written atomically (built in a hidden sibling folder, renamed when
complete); an existing non-empty OUT is refused unless `--overwrite`. The defaults take about 9 minutes
on 2 idle cores (a 3-step smoke run of the default shape measured 1.1 s per source step and 0.9 s per
ConceptMoE step, plus ~30 s of evaluation and saving); `--quick` is a smoke run (a 6-layer width-64
model, a few steps). The source sees positions below `--context` only: the benchmark's longer prompts
are beyond its training length, and the ratio it realises there is measured, not assumed.

    python benchmarks/train_conceptmoe_router.py OUT [--pretrain-steps 300] [--router-steps 150]
        [--batch-size 8] [--context 256] [--lr 2e-3] [--router-lr 1e-3] [--aux-loss-weight 0.3]
        [--ratio 2] [--threads N] [--seed 0] [--overwrite] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))

import eval_bits_per_byte as runner
from reproduce_dlcm import heldout_windows, tokenized_documents

from hf_concept.conversion.conceptmoe import convert_to_conceptmoe
from hf_concept.conversion.writer import atomic_folder
from hf_concept.data.bpe import bundled_tokenizer
from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM

QUICK = dict(
    pretrain_steps=3, router_steps=3, batch_size=2, context=64, layers=6, hidden=64, intermediate=128
)
SAMPLE_PROMPT_TOKENS = 16
SAMPLE_NEW_TOKENS = 24


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write (source/, conceptmoe/, training.json)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing non-empty OUT")
    parser.add_argument("--pretrain-steps", type=int, default=300, help="source (Llama) optimizer steps")
    parser.add_argument("--router-steps", type=int, default=150, help="ConceptMoE optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="crops per optimizer step")
    parser.add_argument("--context", type=int, default=256, help="tokens per crop and held-out window")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of the pretraining")
    parser.add_argument("--router-lr", type=float, default=1e-3, help="peak learning rate after conversion")
    parser.add_argument("--aux-loss-weight", type=float, default=0.3, help="λ of the ratio loss")
    parser.add_argument("--ratio", type=float, default=2.0, help="target tokens per concept R")
    parser.add_argument("--layers", type=int, default=12, help="source layers (E + C + D)")
    parser.add_argument("--hidden", type=int, default=256, help="width D")
    parser.add_argument("--intermediate", type=int, default=1024, help="MLP width")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    parser.add_argument("--encoder-layers", type=int, default=2)
    parser.add_argument("--decoder-layers", type=int, default=2)
    # Room for the benchmark's longest prompt (8192) plus its decoded tokens.
    parser.add_argument("--max-positions", type=int, default=16384, help="max_position_embeddings")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, a few steps")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    for name in ("pretrain_steps", "router_steps", "batch_size", "context", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.hidden % args.heads:
        parser.error(f"--hidden={args.hidden} must be divisible by --heads={args.heads}")
    if args.out.exists() and not (args.out.is_dir() and not any(args.out.iterdir())) and not args.overwrite:
        parser.error(f"{args.out} exists and is not an empty folder; pass --overwrite to replace it")
    return args


def load_data(args: argparse.Namespace):
    """(tokenizer, train rows longer than a crop, held-out windows of at least two tokens)."""
    tokenizer = bundled_tokenizer()
    # Whole documents are tokenized at once and cropped here: no length warning for them.
    tokenizer.model_max_length = 1 << 30
    rows = [ids for _, ids in tokenized_documents(tokenizer, "train") if len(ids) > args.context]
    windows = [
        window
        for _, window in heldout_windows(tokenized_documents(tokenizer, "validation"), args.context)
        if len(window) > 1
    ]
    print(
        f"train: {sum(len(row) for row in rows)} tokens in {len(rows)} documents; held-out: "
        f"{sum(len(window) for window in windows)} tokens in {len(windows)} windows of <= {args.context}",
        flush=True,
    )
    return tokenizer, rows, windows


def build_source(args: argparse.Namespace, tokenizer) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config).to(torch.float32)


def train(
    model, rows: list[torch.Tensor], args: argparse.Namespace, steps: int, lr: float, seed: int
) -> list[dict]:
    """`steps` AdamW steps on random crops; one record per step (loss, and the ratios of a ConceptMoE)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: runner.learning_rate_factor(step, steps)
    )
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model.train()
    history, start = [], time.perf_counter()
    for step in range(steps):
        batch = runner.sample_batch(rows, args.batch_size, args.context, rng)  # (B, L)
        output = model(input_ids=batch, labels=batch)
        optimizer.zero_grad(set_to_none=True)
        output.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        record = dict(loss=output.loss.item())
        # A ConceptMoE also reports its LM loss alone and the ratios: sampled (what the step used) and
        # inference (thresholded, what generation will realise) on the step's batch.
        if getattr(output, "inference_compression_ratio", None) is not None:
            record.update(
                lm_loss=output.lm_loss.item(),
                sampled_ratio=output.compression_ratio.item(),
                inference_ratio=output.inference_compression_ratio.item(),
            )
        history.append(record)
        if (step + 1) % max(1, steps // 10) == 0 or step + 1 == steps:
            seconds = (time.perf_counter() - start) / (step + 1)
            figures = "  ".join(f"{key} {value:.3f}" for key, value in record.items())
            print(f"  step {step + 1}/{steps}  {figures}  ({seconds:.2f} s/step)", flush=True)
    model.eval()
    return history


@torch.no_grad()
def heldout(model, windows: list[torch.Tensor]) -> dict[str, float]:
    """LM loss (nats per token) over the windows and, for a ConceptMoE, its inference ratio on them."""
    nats = predicted = tokens = concepts = 0.0
    for window in windows:
        input_ids = window[None]  # (1, L)
        output = model(input_ids=input_ids, labels=input_ids, use_cache=False)
        lm_loss = getattr(output, "lm_loss", None)
        nats += (output.loss if lm_loss is None else lm_loss).item() * (len(window) - 1)
        predicted += len(window) - 1
        ratio = getattr(output, "compression_ratio", None)
        if ratio is not None:
            # Eval mode: the boundaries used are the thresholded ones, so this is the inference ratio.
            tokens += len(window)
            concepts += len(window) / ratio.item()
    figures = dict(loss=nats / predicted)
    if concepts:
        figures["inference_ratio"] = tokens / concepts
    return figures


@torch.no_grad()
def greedy_sample(model, tokenizer, prompt_ids: torch.Tensor) -> str:
    """The prompt and `SAMPLE_NEW_TOKENS` greedy tokens after it, decoded (a look at what it learned)."""
    output = model.generate(
        prompt_ids[None],
        max_new_tokens=SAMPLE_NEW_TOKENS,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    prompt = tokenizer.decode(prompt_ids)
    continuation = tokenizer.decode(output[0, len(prompt_ids) :])
    return f"{prompt!r} -> {continuation!r}"


def pretrain_source(args, tokenizer, rows, windows, folder: Path) -> dict:
    """Stage 1: pretrain the Llama and save it (with the tokenizer) to `folder`."""
    source = build_source(args, tokenizer)
    print(
        f"[1/3] source: LlamaForCausalLM {source.num_parameters() / 1e6:.2f} M parameters; "
        f"{args.pretrain_steps} steps of {args.batch_size} x {args.context} tokens, lr {args.lr}",
        flush=True,
    )
    history = train(source, rows, args, args.pretrain_steps, args.lr, args.seed)
    figures = heldout(source, windows)
    print(f"  held-out loss {figures['loss']:.3f} nats/token", flush=True)
    print(f"  greedy: {greedy_sample(source, tokenizer, windows[0][:SAMPLE_PROMPT_TOKENS])}", flush=True)
    source.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return dict(history=history, heldout=figures)


def convert_and_train(args, tokenizer, rows, windows, source_folder: Path, folder: Path) -> dict:
    """Stages 2 and 3: convert the saved source, continue training every parameter, save to `folder`."""
    with tempfile.TemporaryDirectory() as scratch:
        converted = Path(scratch) / "conceptmoe"
        convert_to_conceptmoe(
            source_folder,
            converted,
            encoder_layers=args.encoder_layers,
            decoder_layers=args.decoder_layers,
            compression_ratio=args.ratio,
            chunking="dynamic",
            seed=args.seed,
            base_model=str(args.out / "source"),
        )
        model = ConceptMoEForCausalLM.from_pretrained(converted, dtype=torch.float32)
    # One batch per optimizer step: the batch scope gives the step's F and G without an accumulator.
    model.config.ratio_scope = "batch"
    model.config.aux_loss_weight = args.aux_loss_weight
    as_converted = heldout(model.eval(), windows)
    config = model.config
    print(
        f"[2/3] converted: E={config.encoder_layers} C={config.num_concept_layers} "
        f"D={config.decoder_layers}, dynamic cosine router, R={args.ratio:g}; untrained router: held-out "
        f"loss {as_converted['loss']:.3f}, inference ratio {as_converted['inference_ratio']:.2f}",
        flush=True,
    )
    print(
        f"[3/3] continued training: {args.router_steps} steps of {args.batch_size} x {args.context} tokens, "
        f"lr {args.router_lr}, aux_loss_weight {args.aux_loss_weight}, ratio_scope batch",
        flush=True,
    )
    history = train(model, rows, args, args.router_steps, args.router_lr, args.seed + 1)
    figures = heldout(model, windows)
    print(f"  greedy: {greedy_sample(model, tokenizer, windows[0][:SAMPLE_PROMPT_TOKENS])}", flush=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return dict(history=history, heldout_as_converted=as_converted, heldout=figures)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    tokenizer, rows, windows = load_data(args)
    with atomic_folder(args.out, overwrite=args.overwrite) as folder:
        source = pretrain_source(args, tokenizer, rows, windows, folder / "source")
        conceptmoe = convert_and_train(
            args, tokenizer, rows, windows, folder / "source", folder / "conceptmoe"
        )
        wall = time.perf_counter() - start
        result = dict(
            args={key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
            source=source,
            conceptmoe=conceptmoe,
            wall_seconds=wall,
            threads=torch.get_num_threads(),
            torch=torch.__version__,
        )
        (folder / "training.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    print(
        f"\nheld-out (corpus validation split, {args.context}-token windows): source loss "
        f"{source['heldout']['loss']:.3f}, ConceptMoE loss {conceptmoe['heldout']['loss']:.3f}, realised "
        f"inference ratio {conceptmoe['heldout']['inference_ratio']:.3f} tokens per concept "
        f"(target {args.ratio:g}); wrote {args.out}; wall time {wall:.0f} s ({wall / 60:.1f} min), "
        f"{torch.get_num_threads()} threads",
        flush=True,
    )
    return result


if __name__ == "__main__":
    main()
