"""The largest arm of each family on one lent GPU, on the built corpus, in one call.

The corpus (`hf-concept build-corpus`) is far larger than what a device call may carry (64 MiB), so the
run has two steps:

1. `pack`, here: the first `--tokens` training tokens of seed 0's window order (the corpus BPE of the
   reproductions, `corpus_data.load_corpus`), the first `--bytes` bytes of its byte windows (the LSLM's),
   the held-out documents and texts the reproductions score, and the sizes, into one folder of .npy and
   .json files (`--out`, written through a staging folder).
2. `run`, on the device: each family's largest arm at `--width` and `--layers` is trained on the packed
   windows for its share of `--budget-s` (bf16 autocast, AdamW, 20 warm-up steps then a cosine to 10%
   over the steps its first ten say fit), never reading a window twice, then scored on the held-out
   split: nats per token per "language/kind" cell (token families), bits per byte renormalised over the
   256 byte ids (LSLM). The families, in order: `plain` (the project's plain decoder: the reference),
   `dlcm` (learned router, Global Parser), `conceptmoe` (dynamic chunking at R = 2, matched top-k),
   `hidden_decoding` (the plain row's trained model converted to n = 4 streams, the paper's form, and
   trained on for its share) and `lslm` (the paper's defaults). Results are rewritten after every family
   (`gpu_corpus.json`, `gpu_corpus.md` under `--out`), with the device's name.

    python benchmarks/gpu_corpus.py pack --corpus /work/cache/corpus --out gpu_pack
    python benchmarks/gpu_corpus.py run --pack gpu_pack --out $OUT [--budget-s 420]

`run --cpu-smoke` trains minuscule models on the CPU for a few steps (tested in the default suite).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import corpus_data
import eval_bits_per_byte as runner
import numpy
import reproduce_conceptmoe
import reproduce_dlcm
import reproduce_hidden_decoding
import reproduce_lslm
import torch
import torch.nn.functional as F

from hf_concept.evaluation import bits_per_byte
from hf_concept.modeling.tokenization_lslm import BYTE_OFFSET, ByteTokenizer
from hf_concept.tables import format_table

FAMILIES = ("plain", "dlcm", "conceptmoe", "hidden_decoding", "lslm")
WARMUP_STEPS = 20
SMOKE = dict(width=32, layers="1,1,1", context=32, batch_size=4, budget_s=10.0, dtype="fp32", device="cpu")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    pack = commands.add_parser("pack", help="pack the corpus's first windows for a device call")
    pack.add_argument("--corpus", required=True, help="a corpus saved by hf-concept build-corpus")
    pack.add_argument("--out", required=True, help="the pack folder (replaced when complete)")
    pack.add_argument("--context", type=int, default=512, help="tokens (bytes) per training window")
    pack.add_argument("--tokens", type=int, default=16_000_000, help="training tokens packed (int16)")
    pack.add_argument("--bytes", type=int, default=8_000_000, help="training bytes packed for the LSLM")
    pack.add_argument("--heldout-tokens", type=int, default=32_768)
    pack.add_argument("--heldout-bytes", type=int, default=8192, help="held-out bytes per cell (LSLM)")
    corpus_data.add_heldout_sample_flag(pack)
    run = commands.add_parser("run", help="train and score each family's arm (on the device)")
    run.add_argument("--pack", required=True)
    run.add_argument("--out", required=True)
    run.add_argument("--families", default=",".join(FAMILIES))
    run.add_argument("--budget-s", type=float, default=420.0, help="training seconds, shared by the families")
    run.add_argument("--width", type=int, default=512)
    run.add_argument("--layers", default="2,8,2", help="encoder,concept,decoder layers (plain: their sum)")
    run.add_argument("--batch-size", type=int, default=32)
    run.add_argument("--lr", type=float, default=1e-3)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    run.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    run.add_argument("--cpu-smoke", action="store_true", help="minuscule models on the CPU, seconds")
    args = parser.parse_args(argv)
    if args.command == "run":
        if args.cpu_smoke:
            for name, value in SMOKE.items():
                setattr(args, name, value)
        args.layers = tuple(int(part) for part in str(args.layers).split(","))
        unknown = sorted(set(args.families.split(",")) - set(FAMILIES))
        if unknown:
            parser.error(f"--families: unknown {', '.join(unknown)} (known: {', '.join(FAMILIES)})")
        if "hidden_decoding" in args.families.split(",") and "plain" not in args.families.split(","):
            parser.error("--families: hidden_decoding converts the plain row's model; name plain too")
    return args


# -------------------------------------------------------------------------------------------------- pack


def pack(args: argparse.Namespace) -> Path:
    """Write the pack (see the module docstring) and return its folder."""
    shared = argparse.Namespace(
        corpus=args.corpus, context=args.context, heldout_tokens=args.heldout_tokens,
        heldout_bytes=args.heldout_bytes, heldout_sample=args.heldout_sample,
    )  # fmt: skip
    out = Path(args.out)
    staging = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    tokens = corpus_data.load_corpus(shared)
    numpy.save(
        staging / "train_tokens.npy", first_windows(tokens["windows"], args.tokens).astype(numpy.int16)
    )
    numpy.savez(
        staging / "heldout_tokens.npz",
        **{f"{i}": ids.numpy() for i, (_, ids) in enumerate(tokens["heldout"])},
    )
    data = corpus_data.load_byte_corpus(shared)
    byte_windows = first_windows(data["windows"], args.bytes) - BYTE_OFFSET
    if byte_windows.min() < 0 or byte_windows.max() > 255:
        raise SystemExit(f"--corpus {args.corpus}: byte windows hold ids other than bytes")
    # One byte per id (the ids are byte + BYTE_OFFSET): a quarter of int16's room in the carried pack.
    numpy.save(staging / "train_bytes.npy", byte_windows.astype(numpy.uint8))
    meta = dict(
        corpus=str(Path(args.corpus).resolve()), context=args.context, vocab_size=tokens["vocab_size"],
        pad_id=tokens["pad_id"], heldout_cells=[cell for cell, _ in tokens["heldout"]],
        train_tokens=tokens["train_tokens"], train_bytes=data["train_bytes"], heldout_texts=data["heldout"],
    )  # fmt: skip
    (staging / "meta.json").write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(staging, out)
    size = sum(path.stat().st_size for path in out.iterdir()) / 2**20
    print(f"packed {out}: {size:.1f} MiB", flush=True)
    return out


def first_windows(windows: corpus_data.WindowOrder, count: int) -> numpy.ndarray:
    """(N, L) the first windows of seed 0's order holding at most `count` ids (at least one window)."""
    number = max(1, min(len(windows), count // windows.context))
    return windows.batch(0, 0, number).numpy()


def load_pack(folder: str) -> dict:
    """The pack written by `pack`: its meta, (N, L) token and byte windows, and held-out documents."""
    path = Path(folder)
    if not (path / "meta.json").is_file():
        raise SystemExit(f"--pack {folder}: no meta.json (make it with: gpu_corpus.py pack --out {folder})")
    meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    held = numpy.load(path / "heldout_tokens.npz")
    heldout = [
        (cell, torch.from_numpy(held[str(index)].astype(numpy.int64)))
        for index, cell in enumerate(meta["heldout_cells"])
    ]
    tokens = numpy.load(path / "train_tokens.npy")
    data = numpy.load(path / "train_bytes.npy").astype(numpy.int16) + BYTE_OFFSET
    return dict(meta=meta, tokens=tokens, bytes=data, heldout=heldout)


# ----------------------------------------------------------------------------------------------- models


def shape(args: argparse.Namespace, context: int, layers) -> argparse.Namespace:
    """The namespace the reproductions' builders read (their own widths, heads and layer split)."""
    return argparse.Namespace(width=args.width, layers=layers, context=context, conversion_form="paper")


def build(family: str, args: argparse.Namespace, pack: dict, out: Path) -> tuple[torch.nn.Module, str]:
    """(model, arm name) of `family`, initialised from `args.seed` (hidden_decoding: converted from the
    plain row's saved model)."""
    meta, seed = pack["meta"], args.seed
    vocab, pad, context = meta["vocab_size"], meta["pad_id"], meta["context"]
    if family == "plain":
        flat = shape(args, context, sum(args.layers))
        return reproduce_hidden_decoding.llama_source(flat, seed, vocab, pad), "Llama source"
    if family == "dlcm":
        model = reproduce_dlcm.build_model(
            shape(args, context, args.layers), "learned-global", seed, vocab, pad
        )
        return model, "learned-global"
    if family == "conceptmoe":
        model = reproduce_conceptmoe.build_scratch(
            shape(args, context, args.layers), "dynamic", seed, vocab, pad
        )
        return model, "dynamic"
    if family == "hidden_decoding":
        flat = shape(args, context, sum(args.layers))
        model = reproduce_hidden_decoding.convert_variant(
            flat, "HD (n=4)", out / "plain-model", out / "hd-n4"
        )
        return model, "HD (n=4), from the plain row's model"
    layers = ",".join(map(str, args.layers))
    argv = ["--width", str(args.width), "--layers", layers, "--context", str(context), "--steps", "1"]
    lslm_args = reproduce_lslm.parse_args([*argv, "--batch-size", str(args.batch_size)])
    return reproduce_lslm.build_model(lslm_args, "lslm", seed), "lslm (paper defaults)"


# --------------------------------------------------------------------------------------------- training


def autocast(args: argparse.Namespace):
    device_type = torch.device(args.device).type
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")


def synchronize(args: argparse.Namespace) -> None:
    if torch.device(args.device).type == "cuda":
        torch.cuda.synchronize()


def cosine_after_warmup(plan: dict):
    """The LR factor: `WARMUP_STEPS` linear, then the peak until `plan["total"]` is known, then a cosine
    from the peak to 10% at step `plan["total"]`."""

    def factor(step: int) -> float:
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        total = plan.get("total")
        if total is None:
            return 1.0
        progress = min(1.0, (step - WARMUP_STEPS) / max(1, total - WARMUP_STEPS))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def train_for(
    model: torch.nn.Module, windows: numpy.ndarray, budget_s: float, args: argparse.Namespace,
    generator_steps: int | None = None,
) -> dict:  # fmt: skip
    """Train on consecutive batches of `windows` (each window once) for about `budget_s` seconds: the
    steps measured between steps 5 and 15 set how many fit, and the cosine ends there."""
    model.to(args.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    plan: dict = {}
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_after_warmup(plan))
    available = len(windows) // args.batch_size
    if available == 0:
        raise ValueError(
            f"{len(windows)} training windows left, fewer than one batch of {args.batch_size}: "
            "pack more (gpu_corpus.py pack --tokens/--bytes)"
        )
    losses, step, marks = [], 0, {}
    start = time.perf_counter()
    while step < min(available, plan.get("total", available)):
        rows = windows[step * args.batch_size : (step + 1) * args.batch_size]
        batch = torch.from_numpy(rows.astype(numpy.int64)).to(args.device)  # (B, L)
        with autocast(args):
            output = model(input_ids=batch, labels=batch)
        runner.update(model, optimizer, schedule, output.loss, step, generator_steps)
        losses.append(output.loss.detach())
        step += 1
        if step in (5, 15):
            synchronize(args)
            marks[step] = time.perf_counter()
        if step == 15:
            per_step = (marks[15] - marks[5]) / 10
            plan["total"] = min(available, 15 + int((budget_s - (marks[15] - start)) / per_step))
        if time.perf_counter() - start > 1.2 * budget_s:
            break  # a slower stretch than the first steps said: stop rather than overrun the call
    synchronize(args)
    seconds = time.perf_counter() - start
    tail = torch.stack(losses[-max(1, len(losses) // 20) :]).float().mean().item()
    tokens = step * args.batch_size * windows.shape[1]
    return dict(steps=step, windows_available=available, tokens=tokens, train_seconds=seconds,
                tokens_per_second=tokens / seconds, training_objective=tail)  # fmt: skip


# -------------------------------------------------------------------------------------------- scoring


@torch.no_grad()
def heldout_nats(model: torch.nn.Module, documents: list, context: int, args: argparse.Namespace) -> dict:
    """Held-out nats per token of the logits, per "language/kind" cell and over all (`"all"`)."""
    model.eval()
    nats: dict[str, float] = {}
    counts: dict[str, int] = {}
    for cell, window in reproduce_dlcm.heldout_windows(documents, context):
        if len(window) < 2:
            continue
        ids = window[None].to(args.device)  # (1, L)
        with autocast(args):
            logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum").item()
        nats[cell] = nats.get(cell, 0.0) + loss
        counts[cell] = counts.get(cell, 0) + len(window) - 1
    figures = {cell: nats[cell] / counts[cell] for cell in sorted(nats)}
    figures["all"] = sum(nats.values()) / sum(counts.values())
    return figures


@torch.no_grad()
def heldout_bits(
    model: torch.nn.Module, texts: dict[str, str], context: int, args: argparse.Namespace
) -> dict:
    """Held-out bits per byte over the 256 byte ids per cell, and over all bytes (`"all"`)."""
    model.eval()
    tokenizer, figures, total_bits, total_bytes = ByteTokenizer(), {}, 0.0, 0
    for cell, text in texts.items():
        with autocast(args):
            result = bits_per_byte(
                model, tokenizer, text, context=context, batch_size=16, normalization="bytes"
            )
        figures[cell] = result.bits_per_byte
        total_bits += result.bits_per_byte * result.num_bytes
        total_bytes += result.num_bytes
    figures["all"] = total_bits / total_bytes
    return figures


# -------------------------------------------------------------------------------------------------- run


def run_family(family: str, args: argparse.Namespace, pack: dict, work: Path, budget_s: float, state: dict):
    """Build, train and score one family's arm; returns its record."""
    meta = pack["meta"]
    model, arm = build(family, args, pack, work)
    if torch.device(args.device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    print(f"[{family}] {arm}: {model.num_parameters()} parameters, {budget_s:.0f} s", flush=True)
    first = 0
    if family == "lslm":
        figures = train_for(model, pack["bytes"], budget_s, args, model.config.update_schedule)
        heldout, unit = heldout_bits(model, meta["heldout_texts"], meta["context"], args), "bits per byte"
    else:
        windows = pack["tokens"]
        if family == "plain" and "hidden_decoding" in args.families.split(","):
            windows = windows[: len(windows) // 2]  # the other half is the converted model's
        # The converted model reads on from where its source stopped: no window twice in its lineage.
        first = state.get("plain_windows", 0) if family == "hidden_decoding" else 0
        figures = train_for(model, windows[first:], budget_s, args)
        heldout, unit = heldout_nats(model, pack["heldout"], meta["context"], args), "nats per token"
    if family == "plain":
        state["plain_windows"] = figures["steps"] * args.batch_size
        model.save_pretrained(work / "plain-model")
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.device(args.device).type == "cuda" else None
    record = dict(family=family, arm=arm, parameters=model.num_parameters(), unit=unit, heldout=heldout,
                  peak_memory_gib=peak, first_window=first, **figures)  # fmt: skip
    print(f"[{family}] held-out {heldout['all']:.4f} {unit} after {figures['steps']} steps", flush=True)
    return record


def device_name(args: argparse.Namespace) -> str:
    if torch.device(args.device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(args.device))
    return f"CPU ({torch.get_num_threads()} threads)"


def run(args: argparse.Namespace) -> dict:
    """Every family of `--families` in turn; results rewritten under `--out` after each."""
    pack_data = load_pack(args.pack)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    families = args.families.split(",")
    meta = pack_data["meta"]
    result = dict(device=device_name(args), torch=torch.__version__, dtype=args.dtype, width=args.width,
                  layers=list(args.layers), batch_size=args.batch_size, context=meta["context"], lr=args.lr,
                  seed=args.seed, budget_s=args.budget_s, corpus=meta["corpus"], families=[])  # fmt: skip
    state: dict = {}
    work = out.with_name(f".{out.name}.work-{os.getpid()}")  # beside --out, not in it: not sent back
    try:
        for family in families:
            torch.manual_seed(args.seed)
            try:
                record = run_family(family, args, pack_data, work, args.budget_s / len(families), state)
            except Exception as error:  # one family's failure must not lose the others' figures
                print(f"[{family}] failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
                record = dict(family=family, error=f"{type(error).__name__}: {error}")
            result["families"].append(record)
            write_results(result, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result


def write_results(result: dict, out: Path) -> None:
    """`gpu_corpus.json` and a Markdown table `gpu_corpus.md` under `out`."""
    (out / "gpu_corpus.json").write_text(json.dumps(result, indent=1, ensure_ascii=False), encoding="utf-8")
    lines = [
        f"device: {result['device']}; torch {result['torch']}; {result['dtype']}; width {result['width']}, "
        f"layers {result['layers']}, batch {result['batch_size']} x {result['context']}, "
        f"peak lr {result['lr']}, seed {result['seed']}; corpus {result['corpus']}",
        "",
    ]
    headers = ("family", "arm", "parameters", "steps", "tokens", "train s", "tokens/s", "peak GiB",
               "training objective", "held-out (all)", "unit")  # fmt: skip
    rows = []
    for record in result["families"]:
        if "error" in record:
            rows.append((record["family"], f"failed: {record['error']}"))
            continue
        peak = "" if record["peak_memory_gib"] is None else f"{record['peak_memory_gib']:.1f}"
        rows.append(
            (record["family"], record["arm"], f"{record['parameters']:,}", record["steps"],
             f"{record['tokens']:,}", f"{record['train_seconds']:.0f}", f"{record['tokens_per_second']:,.0f}",
             peak, f"{record['training_objective']:.4f}", f"{record['heldout']['all']:.4f}", record["unit"])
        )  # fmt: skip
    lines.append(format_table(headers, rows, align="<<>>>>>>>><", markdown=True))
    (out / "gpu_corpus.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None):
    args = parse_args(argv)
    if args.command == "pack":
        return pack(args)
    return run(args)  # each family seeds itself from --seed


if __name__ == "__main__":
    main()
