"""Continued training of a converted ConceptMoE on CPU: does it recover its source?

The source (a Llama-family safetensors folder, e.g. SmolLM2-135M-Instruct) is converted in this run with
`convert_to_conceptmoe` (dynamic chunking at `--ratio`, decisions on local ranks unless `--rank-window 0`,
random router, zero joint decoding; `--fixed-bonus B` holds the router near fixed chunks,
`ConceptMoEConfig.boundary_fixed_bonus`), then trained for `--minutes` of training wall time (evaluation
excluded; both clocks are reported) or `--max-steps`.

Objectives: the LM loss (and the ratio loss at `--aux-loss-weight`); `--distill` adds T² · KL(source ‖
converted) at every label position, `--align-hidden W` also W · (1 − cosine) of the token states the
conversion's layer map pairs (`hf_concept.training.distillation`, the functions `DistillationTrainer`
uses). The source is the teacher, kept in memory from its own evaluation. Only the conversion's first
`--encoder-layers` layers are shared with the source unchanged (under `--train new`), 2 of SmolLM2's 30:
the teacher runs whole rather than from the student's encoder output, a second code path for about 7% of
its forward.

`--checkpoint DIR` keeps the trainable weights, optimizer, schedule, threshold, data position and record
every `--checkpoint-every-minutes` of training; the same command started again goes on from there (the
budget, outputs and threads may change; any other argument is refused), so a long arm survives a killed
session. Every evaluation logs the machine's load average, for arms run side by side.

What trains (`--train`):
- `all`: every weight;
- `new`: only what conversion added: the router (`chunker`), joint decoding's `concept_{q,k,v}_proj` and
  `concept_norm` (and `concept_in_proj`/`concept_out_proj` where the concept stack is wider);
- `lora`: LoRA (peft) on the attention and MLP projections, plus the new modules above in full.

Data (`--corpus`, a `hf-concept build-corpus` DatasetDict): the train split under the source's tokenizer,
each (language, kind) cell a stream of its documents in the order of the SHA-256 of their `document` id,
joined by the eos token and cut into consecutive non-overlapping windows of `--context` tokens; batch row
i takes the next window of cell i mod (cells left), so the mixture is balanced across cells, like the
evaluation texts, and no token is read twice. Evaluation texts per cell: the first `--eval-bytes` bytes
of the cell's documents in split order. `--eval-splits validation` is for choices (learning rate, what
trains); `held_out` is for the report only.

Figures, at step 0 and every `--eval-every-minutes` of training, on the same texts and windows:
bits per byte = total nats / UTF-8 bytes of the scored texts / ln 2 (`hf_concept.evaluation.bits_per_byte`,
lm-eval convention: disjoint blocks of `--context` predictions, every token of the text scored), pooled
over the cells and per cell, of the converted model and of the source (measured once, in this run); the
realised tokens per concept (thresholded boundaries in eval mode) on the same texts; greedy answers to
five fixed prompts (through the tokenizer's chat template when it has one) of the source, the converted
model before training and after. Everything goes to `--json` (rewritten atomically at each evaluation)
and, with `--save DIR`, the trained model (LoRA merged) to DIR, written to a staging folder and renamed.

`--quick`: a tiny random Llama with the bundled BPE tokenizer and a three-split corpus cut from the
bundled text, a few steps: a smoke test of the script (seconds).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hf_concept.conversion.conceptmoe import convert_to_conceptmoe
from hf_concept.evaluation import bits_per_byte
from hf_concept.modeling.configuration_conceptmoe import DECHUNK_EMAS
from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM, ConceptMoEModel
from hf_concept.training.data import load_saved_dataset
from hf_concept.training.distillation import (
    distillation_kl,
    label_positions,
    mapped_alignment,
)
from hf_concept.training.ratio_hold import RatioHold, calibrate_threshold
from hf_concept.training.sweep import atomic_write_json
from hf_concept.utils import eval_mode

sys.path.insert(0, str(Path(__file__).resolve().parent))

import eval_bits_per_byte as runner
from corpus_data import heldout_texts

PROMPTS = (
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "What is 12 plus 7?",
    "Name three colours.",
    "Translate 'good morning' into French.",
)
TRAIN_MODES = ("all", "new", "lora")
# Peak learning rates per mode, used when --lr is not given (common fine-tuning values, not tuned here).
DEFAULT_LR = {"all": 1e-4, "new": 1e-3, "lora": 5e-4}
# Modules conversion adds (matched against module names); the rest came from the source.
NEW_MODULES = (
    "chunker",
    "concept_q_proj",
    "concept_k_proj",
    "concept_v_proj",
    "concept_norm",
    "concept_in_proj",
    "concept_out_proj",
)
LORA_TARGETS = r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def add_recovery_arguments(parser: argparse.ArgumentParser) -> None:
    """The conversion's decision rule and dechunk EMA, what stays frozen, the distillation terms and the
    checkpoint."""
    parser.add_argument(
        "--chunking",
        choices=("dynamic", "fixed"),
        default="dynamic",
        help="fixed: a concept every --ratio tokens (an integer), the control a learned router must beat; "
        "R = 1 converts with fixed chunks whatever this says",
    )
    parser.add_argument(
        "--rank-window",
        type=int,
        default=None,
        help="boundary_rank_window of the conversion (default: the converter's; 0: one threshold on the "
        "router's probabilities for every text, the recipe before local ranks)",
    )
    parser.add_argument(
        "--dechunk-ema",
        choices=DECHUNK_EMAS,
        default=None,
        help="the dechunk EMA's weight of each concept (ConceptMoEConfig.dechunk_ema; default: the "
        "conversion's)",
    )
    parser.add_argument(
        "--fixed-bonus",
        type=float,
        default=None,
        help="boundary_fixed_bonus: added to the router's probability where fixed chunks open before the "
        "ranks (default: the conversion's, 0): a learned router held near fixed chunks",
    )
    parser.add_argument(
        "--freeze-router",
        action="store_true",
        help="train everything else but keep the router's weights as converted (--hold-ratio still moves "
        "its threshold): do the router's moving decisions cost the concept layers?",
    )
    parser.add_argument(
        "--distill",
        action="store_true",
        help="add T² · KL(source ‖ converted) at every label position (training.distillation) to the loss",
    )
    parser.add_argument("--distill-temperature", type=float, default=1.0, help="T of --distill")
    parser.add_argument(
        "--align-hidden",
        type=float,
        default=0.0,
        help="with --distill: weight of the hidden-state alignment over the conversion's layer map",
    )
    parser.add_argument(
        "--checkpoint",
        default=None,
        help="keep a resumable checkpoint here (every --checkpoint-every-minutes of training); a run started "
        "again with the same arguments goes on from it",
    )
    parser.add_argument("--checkpoint-every-minutes", type=float, default=5.0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", help="the source checkpoint folder (safetensors)")
    parser.add_argument("--corpus", help="a build-corpus DatasetDict folder")
    parser.add_argument("--ratio", type=float, default=2.0, help="target tokens per concept")
    parser.add_argument(
        "--aux-loss-weight",
        type=float,
        default=None,
        help="λ of the ratio loss during recovery (default: the conversion's, 0.03); at 0.03 the router gave "
        "up compression within a few steps on SmolLM2 (1.0-1.1 tokens per concept at R = 2)",
    )
    parser.add_argument(
        "--hold-ratio",
        action="store_true",
        help="hold the realised tokens per concept at --ratio by recalibrating the router's threshold after "
        "every step (hf_concept.training.ratio_hold) instead of leaving it to the ratio loss",
    )
    parser.add_argument(
        "--calibration-batches",
        type=int,
        default=16,
        help="with --hold-ratio: after training, set the threshold from this many unseen training batches "
        "at once (ratio_hold.calibrate_threshold) before the last evaluation and the save; 0: keep the last "
        "step's",
    )
    add_recovery_arguments(parser)
    parser.add_argument("--train", choices=TRAIN_MODES, default="all")
    parser.add_argument("--minutes", type=float, default=60.0, help="training wall time, eval excluded")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps too")
    parser.add_argument("--eval-every-minutes", type=float, default=10.0)
    parser.add_argument(
        "--eval-every-steps",
        type=int,
        default=None,
        help="evaluate every this many steps instead (arms compared by tokens, whatever else runs)",
    )
    parser.add_argument("--eval-splits", default="held_out", help="comma-separated: validation, held_out")
    parser.add_argument("--eval-bytes", type=int, default=4096, help="evaluation bytes per cell")
    parser.add_argument("--lr", type=float, default=None, help="peak LR (default per --train mode)")
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--encoder-layers", type=int, default=2)
    parser.add_argument("--decoder-layers", type=int, default=2)
    parser.add_argument("--router-init", choices=("random", "identity"), default="random")
    parser.add_argument("--answer-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the figures here (atomically)")
    parser.add_argument("--save", default=None, help="save the trained model here at the end")
    parser.add_argument("--quick", action="store_true", help="smoke run on a tiny model (seconds)")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit through `parser.error` on a missing source or corpus and on values out of range."""
    if not args.quick and not (args.source and args.corpus):
        parser.error("--source and --corpus are required (or --quick)")
    for name in ("batch_size", "context", "threads", "eval_bytes", "answer_tokens", "lora_rank"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if not args.ratio >= 1 or args.minutes <= 0 or args.eval_every_minutes <= 0:
        parser.error("--ratio must be >= 1, --minutes and --eval-every-minutes > 0")
    if args.chunking == "fixed" and (args.hold_ratio or not float(args.ratio).is_integer()):
        parser.error("--chunking fixed takes an integer --ratio and holds it without --hold-ratio")
    if args.fixed_bonus is not None and (args.fixed_bonus < 0 or args.chunking == "fixed"):
        parser.error("--fixed-bonus must be >= 0 and goes with dynamic chunking")
    if args.align_hidden and not args.distill:
        parser.error("--align-hidden goes with --distill")
    if not args.distill_temperature > 0 or not args.align_hidden >= 0:
        parser.error("--distill-temperature must be > 0 and --align-hidden >= 0")
    splits = args.eval_splits.split(",")
    if not splits or any(split not in ("validation", "held_out") for split in splits):
        parser.error(f"--eval-splits={args.eval_splits!r}: a list of validation, held_out")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        # The smoke settings, except where the command line sets a value of its own.
        for name, value in QUICK.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    check_args(parser, args)
    args.eval_splits = args.eval_splits.split(",")
    args.lr = DEFAULT_LR[args.train] if args.lr is None else args.lr
    return args


# ------------------------------------------------------------------------------------------------ data


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def cell_documents(split) -> dict[str, list[int]]:
    """ "language/kind" -> the row indices of its documents, in the order of SHA-256(document id)."""
    cells: dict[str, list[tuple[str, int]]] = {}
    columns = zip(split["language"], split["kind"], split["document"], strict=True)
    for index, (language, kind, document) in enumerate(columns):
        cells.setdefault(f"{language}/{kind}", []).append((_sha256(str(document)), index))
    return {cell: [index for _, index in sorted(rows)] for cell, rows in sorted(cells.items())}


def cell_windows(split, rows: list[int], tokenizer, context: int) -> Iterator[list[int]]:
    """Consecutive `context`-token windows of the documents `rows`, joined by eos, tokenised lazily."""
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pending: list[int] = []
    for index in rows:
        pending.extend(tokenizer(split[index]["text"], add_special_tokens=False)["input_ids"] + separator)
        while len(pending) >= context:
            yield pending[:context]
            pending = pending[context:]


class TrainBatches:
    """(B, context) training batches, row i from the next window of cell i mod (cells left); each
    window once. `tokens` counts what was handed out."""

    def __init__(self, split, tokenizer, context: int, batch_size: int) -> None:
        cells = cell_documents(split)
        self.streams = {cell: cell_windows(split, rows, tokenizer, context) for cell, rows in cells.items()}
        self.batch_size, self.tokens, self.turn = batch_size, 0, 0
        self.taken = dict.fromkeys(self.streams, 0)

    def position(self) -> dict[str, Any]:
        """Where the batches stand, for a checkpoint (`skip_to` goes back there)."""
        return {"tokens": self.tokens, "turn": self.turn, "taken": dict(self.taken)}

    def skip_to(self, position: dict[str, Any]) -> None:
        """Drop the windows a checkpointed run already read (tokenised again, never trained on twice)."""
        for cell, count in position["taken"].items():
            for _ in range(count):
                if next(self.streams[cell], None) is None:
                    del self.streams[cell]
                    break
            self.taken[cell] = count
        self.tokens, self.turn = position["tokens"], position["turn"]

    def next_batch(self) -> torch.Tensor | None:
        """The next batch, or None once the split cannot fill one."""
        rows = []
        while len(rows) < self.batch_size and self.streams:
            cell = list(self.streams)[self.turn % len(self.streams)]
            window = next(self.streams[cell], None)
            if window is None:
                del self.streams[cell]
                continue
            self.turn += 1
            self.taken[cell] += 1
            rows.append(window)
        if len(rows) < self.batch_size:
            return None
        batch = torch.tensor(rows, dtype=torch.long)
        self.tokens += batch.numel()
        return batch


# ------------------------------------------------------------------------------------------ evaluation


def concept_model(model: nn.Module) -> ConceptMoEModel | None:
    return next((module for module in model.modules() if isinstance(module, ConceptMoEModel)), None)


def evaluate(model: nn.Module, tokenizer, texts: dict[str, str], args: argparse.Namespace) -> dict:
    """Pooled and per-cell bits per byte of `texts`, and (ConceptMoE) realised tokens per concept, pooled
    and per cell."""
    counts: dict[str, list[int]] = {cell: [0, 0] for cell in texts}
    current = {"cell": None}

    def count(module, inputs, output) -> None:
        # Inference boundaries (eval mode: thresholded) over the real tokens of each window.
        counts[current["cell"]][0] += int(output.token_mask.sum())
        counts[current["cell"]][1] += int((output.boundaries & output.token_mask).sum())

    inner = concept_model(model)
    hook = None if inner is None else inner.register_forward_hook(count)
    cells = {}
    try:
        for cell, text in texts.items():
            current["cell"] = cell
            cells[cell] = bits_per_byte(
                model, tokenizer, text, context=args.context, batch_size=args.batch_size, convention="lm-eval"
            )
    finally:
        if hook is not None:
            hook.remove()
    nats, num_bytes = sum(value.nats for value in cells.values()), sum(v.num_bytes for v in cells.values())
    result = {
        "bits_per_byte": nats / num_bytes / math.log(2),
        "cells": {cell: value.bits_per_byte for cell, value in cells.items()},
        "bytes": num_bytes,
    }
    if inner is not None:
        tokens, concepts = (sum(column) for column in zip(*counts.values(), strict=True))
        result["tokens_per_concept"] = tokens / max(concepts, 1)
        result["cell_tokens_per_concept"] = {cell: t / max(c, 1) for cell, (t, c) in counts.items()}
    return result


def prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    """(1, T) ids of `prompt`, through the chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


@torch.no_grad()
def answers(model: nn.Module, tokenizer, max_new_tokens: int) -> list[str]:
    """Greedy answers (with the model's cache) to the five `PROMPTS`."""
    replies = []
    with eval_mode(model):
        for prompt in PROMPTS:
            ids = prompt_ids(tokenizer, prompt)
            output = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
            )
            replies.append(tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True).strip())
    return replies


# ------------------------------------------------------------------------------------------- training


def is_new(name: str) -> bool:
    return any(f".{part}." in f".{name}." for part in NEW_MODULES)


def prepare_training(
    model: ConceptMoEForCausalLM, mode: str, rank: int, freeze_router: bool = False
) -> nn.Module:
    """The model to train under `mode` (peft-wrapped for "lora"), with requires_grad set; the router
    (`chunker`) frozen with `freeze_router`."""
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS, lora_dropout=0.0)
        model = get_peft_model(model, config)
    for name, parameter in model.named_parameters():
        if mode == "all" or is_new(name):
            parameter.requires_grad_(True)
        elif mode == "new":
            parameter.requires_grad_(False)
        if freeze_router and ".chunker." in f".{name}.":
            parameter.requires_grad_(False)
    return model


def teacher_terms(
    model: nn.Module, output: Any, teacher: nn.Module, batch: torch.Tensor, args: argparse.Namespace
) -> tuple[torch.Tensor, dict[str, float]]:
    """--distill: the KL term (and with --align-hidden the alignment over the conversion's layer map) to
    add to the loss, and their values; the same functions `DistillationTrainer` uses."""
    aligning = args.align_hidden > 0
    with torch.no_grad():
        taught = teacher(input_ids=batch, output_hidden_states=aligning, use_cache=False)
    positions = label_positions(batch)
    kl = distillation_kl(output.logits, taught.logits, positions, args.distill_temperature)
    figures, extra = {"distill_loss": kl.item()}, kl
    if aligning:
        config = concept_model(model).config
        aligned = mapped_alignment(config, output.hidden_states, taught.hidden_states, positions)
        figures["align_loss"] = aligned.item()
        extra = extra + args.align_hidden * aligned
    return extra, figures


def training_step(
    model: nn.Module, optimizer, batch: torch.Tensor, teacher: nn.Module | None, args: argparse.Namespace
) -> dict[str, float]:
    """One AdamW step on a (B, L) batch (with `teacher`, the --distill terms added); gradients clipped at
    1.0 (the norm before clipping reported)."""
    optimizer.zero_grad(set_to_none=True)
    aligning = teacher is not None and args.align_hidden > 0
    output = model(input_ids=batch, labels=batch, output_hidden_states=aligning)
    loss, figures = output.loss, {}
    if teacher is not None:
        extra, figures = teacher_terms(model, output, teacher, batch, args)
        loss = loss + extra
    loss.backward()
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    optimizer.step()
    figures.update(loss=loss.item(), grad_norm=float(norm))
    for key in ("lm_loss", "aux_loss", "compression_ratio"):
        value = getattr(output, key, None)
        if value is not None:
            figures[key] = float(value)
    return figures


def converted_model(source: Path, folder: Path, args: argparse.Namespace) -> ConceptMoEForCausalLM:
    """The source converted (dynamic chunking at `args.ratio`; fixed chunking at R = 1) and loaded."""
    convert_to_conceptmoe(
        source,
        folder,
        encoder_layers=args.encoder_layers,
        decoder_layers=args.decoder_layers,
        compression_ratio=args.ratio,
        chunking="fixed" if args.ratio == 1 else args.chunking,
        router_init=args.router_init,
        seed=args.seed,
        dtype="float32",
        **({} if args.rank_window is None else {"rank_window": args.rank_window}),
        **({} if args.fixed_bonus is None else {"fixed_bonus": args.fixed_bonus}),
    )
    model = ConceptMoEForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if args.aux_loss_weight is not None:
        model.config.aux_loss_weight = args.aux_loss_weight
    if args.dechunk_ema is not None:
        model.config.dechunk_ema = args.dechunk_ema
    return model


def save_model(model: nn.Module, tokenizer, path: Path) -> None:
    """Model (LoRA merged first) and tokenizer saved into a staging folder renamed into place."""
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    runner.save_whole(model, path, tokenizer)


# ----------------------------------------------------------------------------------------------- runs


class Run:
    """The run's record (written to --json after every evaluation) and its clocks."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.started, self.train_seconds = args, time.perf_counter(), 0.0
        command = " ".join([Path(sys.executable).name, *sys.argv])
        self.record: dict[str, Any] = {"command": command, "args": vars(args), "torch": torch.__version__}
        self.record.update(source={}, curve=[], steps=[], answers={})

    def write(self) -> None:
        if self.args.json:
            atomic_write_json(Path(self.args.json), self.record)

    def log_step(self, step: int, seconds: float, figures: dict[str, float]) -> None:
        self.train_seconds += seconds
        self.record["steps"].append({"step": step, "seconds": round(seconds, 2), **figures})
        print(
            f"[train] step {step} loss {figures['loss']:.4f} lm {figures.get('lm_loss', math.nan):.4f} "
            f"kl {figures.get('distill_loss', math.nan):.4f} "
            f"ratio {figures.get('compression_ratio', math.nan):.2f} "
            f"grad {figures['grad_norm']:.2f} {seconds:.1f} s",
            flush=True,
        )

    def evaluate(self, model: nn.Module, tokenizer, texts: dict[str, dict[str, str]], step: int, tokens: int):
        point = {"step": step, "train_tokens": tokens, "train_seconds": round(self.train_seconds, 1)}
        for split, cells in texts.items():
            point[split] = evaluate(model, tokenizer, cells, self.args)
            source = self.record["source"][split]["bits_per_byte"]
            point[split]["vs_source"] = point[split]["bits_per_byte"] / source - 1
            print(
                f"[eval] step {step} tokens {tokens} train {self.train_seconds / 60:.1f} min {split}: "
                f"{point[split]['bits_per_byte']:.4f} bits/byte (source {source:.4f}, "
                f"{100 * point[split]['vs_source']:+.2f}%), "
                f"{point[split]['tokens_per_concept']:.2f} tokens/concept",
                flush=True,
            )
        point["wall_seconds"] = round(time.perf_counter() - self.started, 1)
        # The machine's load: arms that ran side by side are compared knowing what else ran.
        point["load_average"] = list(os.getloadavg())
        self.record["curve"].append(point)
        self.write()


# Arguments a resumed run may change: its budget, where it writes and what it evaluates when, none of which
# the trained weights depend on.
RESUMABLE_CHANGES = (
    "minutes",
    "max_steps",
    "json",
    "save",
    "checkpoint_every_minutes",
    "threads",
    "eval_every_steps",
    "eval_every_minutes",
    "eval_splits",
)


class Checkpoint:
    """--checkpoint: the trainable weights, optimizer, schedule, data position, threshold and record of a
    run, written to a staging file renamed into place, so that a killed run loses at most one interval."""

    def __init__(self, folder: str | None) -> None:
        self.path = None if folder is None else Path(folder) / "state.pt"

    def load(self, args: argparse.Namespace) -> dict | None:
        if self.path is None or not self.path.exists():
            return None
        state = torch.load(self.path, weights_only=False)
        before, now = state["record"]["args"], vars(args)
        # An argument the checkpoint predates is taken at its value now.
        changed = [
            name
            for name in now
            if name in before and name not in RESUMABLE_CHANGES and before[name] != now[name]
        ]
        if changed:
            raise SystemExit(f"--checkpoint {self.path.parent}: saved with other arguments ({changed})")
        print(
            f"[resume] step {state['step']}, {state['train_seconds'] / 60:.1f} training minutes", flush=True
        )
        return state

    def save(self, model: nn.Module, state: dict) -> None:
        if self.path is None:
            return
        trainable = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staging = self.path.with_suffix(".staging")
        torch.save({**state, "weights": trainable}, staging)
        staging.replace(self.path)


def restore(model: nn.Module, state: dict, optimizer, schedule) -> None:
    """A checkpoint's weights, optimizer, schedule and threshold back into this run."""
    weights = state["weights"]
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name in weights:
                parameter.copy_(weights[name])
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    inner = concept_model(model)
    if inner is not None:
        inner.config.boundary_threshold = state["threshold"]


def due(args: argparse.Namespace, step: int, train_seconds: float, next_eval: float) -> bool:
    """Whether an evaluation is due after `step`: every --eval-every-steps steps when given, else every
    --eval-every-minutes of training."""
    if args.eval_every_steps:
        return step % args.eval_every_steps == 0
    return train_seconds >= next_eval


def train(model: nn.Module, tokenizer, data: TrainBatches, texts: dict, run: Run, setup: dict) -> int:
    """Train until the time budget, --max-steps or the data run out, evaluating and checkpointing on
    schedule; `setup`: the RatioHold (or None), the teacher (or None), the resumed state (or None).
    Returns the number of steps."""
    args, hold, teacher, state = run.args, setup["hold"], setup["teacher"], setup["state"]
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / args.warmup_steps)
    )
    step, next_eval, next_save = 0, 60 * args.eval_every_minutes, 60 * args.checkpoint_every_minutes
    if state is not None:
        restore(model, state, optimizer, schedule)
        step, next_eval, next_save = state["step"], state["next_eval"], state["next_save"]
    checkpoint = Checkpoint(args.checkpoint)
    model.train()
    while run.train_seconds < 60 * args.minutes and (args.max_steps is None or step < args.max_steps):
        batch = data.next_batch()
        if batch is None:
            print("[train] the train split is used up", flush=True)
            break
        began = time.perf_counter()
        figures = training_step(model, optimizer, batch, teacher, args)
        if hold is not None:
            figures["threshold"] = hold.update()
        schedule.step()
        step += 1
        run.log_step(step, time.perf_counter() - began, figures)
        if due(args, step, run.train_seconds, next_eval):
            run.evaluate(model, tokenizer, texts, step, data.tokens)
            next_eval += 60 * args.eval_every_minutes
            model.train()
        if run.train_seconds >= next_save:
            next_save += 60 * args.checkpoint_every_minutes
            threshold = concept_model(model).config.boundary_threshold
            saved = dict(step=step, next_eval=next_eval, next_save=next_save, train_seconds=run.train_seconds)
            saved.update(
                optimizer=optimizer.state_dict(), schedule=schedule.state_dict(), threshold=threshold
            )
            checkpoint.save(model, {**saved, "data": data.position(), "record": run.record})
    return step


def calibrate(model: nn.Module, tokenizer, data: TrainBatches, texts: dict, run: Run, steps: int) -> None:
    """--calibration-batches: the threshold from many unseen batches at once, then one more evaluation."""
    batches = [
        batch
        for batch in (data.next_batch() for _ in range(run.args.calibration_batches))
        if batch is not None
    ]
    if not batches:
        return
    with eval_mode(model):
        threshold = calibrate_threshold(model, batches, run.args.ratio)
    run.record["calibrated_threshold"] = threshold
    print(f"[calibrate] threshold {threshold:.4f} from {len(batches)} batches", flush=True)
    run.evaluate(model, tokenizer, texts, steps, data.tokens)
    run.record["curve"][-1]["calibrated"] = True


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    run = Run(args)
    with tempfile.TemporaryDirectory(prefix="recover-conceptmoe-") as scratch:
        scratch = Path(scratch)
        source, corpus = quick_fixture(scratch) if args.quick else (Path(args.source), Path(args.corpus))
        return recover(source, corpus, scratch, run)


def begin(original: nn.Module, tokenizer, texts: dict, run: Run) -> None:
    """A new run's source figures and answers."""
    for split, cells in texts.items():
        run.record["source"][split] = evaluate(original, tokenizer, cells, run.args)
        print(f"[source] {split}: {run.record['source'][split]['bits_per_byte']:.4f} bits/byte", flush=True)
    run.record["answers"]["source"] = answers(original, tokenizer, run.args.answer_tokens)


def finish(model: nn.Module, tokenizer, run: Run, hold: RatioHold | None, data: TrainBatches, texts, steps):
    """The last evaluation, the threshold calibration (--hold-ratio), the answers and the save."""
    args = run.args
    if not run.record["curve"] or run.record["curve"][-1]["step"] != steps:
        run.evaluate(model, tokenizer, texts, steps, data.tokens)
    if hold is not None:
        hold.remove()
        run.record["threshold"] = concept_model(model).config.boundary_threshold
        calibrate(model, tokenizer, data, texts, run, steps)
    run.record["answers"]["after"] = answers(model, tokenizer, args.answer_tokens)
    seconds = [entry["seconds"] for entry in run.record["steps"]]
    run.record["seconds_per_step"] = sum(seconds) / len(seconds) if seconds else None
    run.write()
    replies = run.record["answers"]
    for index, prompt in enumerate(PROMPTS):
        print(f"[answers] {prompt!r}", flush=True)
        for key in ("source", "before", "after"):
            print(f"  {key + ':':<8}{replies[key][index]!r}", flush=True)
    if args.save:
        save_model(model, tokenizer, Path(args.save))


def recover(source: Path, corpus: Path, scratch: Path, run: Run) -> dict:
    """Evaluate the source, convert, train (resuming from --checkpoint), evaluate; `run.record` filled
    and returned."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = run.args
    tokenizer = AutoTokenizer.from_pretrained(source)
    splits = load_saved_dataset(corpus)
    texts = {split: heldout_texts(splits[split], args.eval_bytes) for split in args.eval_splits}
    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    state = Checkpoint(args.checkpoint).load(args)
    if state is None:
        begin(original, tokenizer, texts, run)
    else:
        run.record, run.train_seconds = state["record"], state["train_seconds"]
    model = converted_model(source, scratch / "converted", args)
    if state is None:
        run.record["answers"]["before"] = answers(model, tokenizer, args.answer_tokens)
    model = prepare_training(model, args.train, args.lora_rank, args.freeze_router)
    counts = [(p.numel(), p.requires_grad) for p in model.parameters()]
    run.record["trainable_parameters"] = sum(count for count, trains in counts if trains)
    run.record["parameters"] = sum(count for count, _ in counts)
    print(
        f"[setup] --train {args.train}: {run.record['trainable_parameters']:,} of "
        f"{run.record['parameters']:,} parameters train, lr {args.lr}",
        flush=True,
    )
    if state is None:
        run.evaluate(model, tokenizer, texts, 0, 0)
    data = TrainBatches(splits["train"], tokenizer, args.context, args.batch_size)
    if state is not None:
        data.skip_to(state["data"])
    hold = RatioHold(model, args.ratio) if args.hold_ratio else None
    teacher = original.requires_grad_(False) if args.distill else None
    steps = train(model, tokenizer, data, texts, run, {"hold": hold, "teacher": teacher, "state": state})
    finish(model, tokenizer, run, hold, data, texts, steps)
    return run.record


# ----------------------------------------------------------------------------------------------- quick


def tiny_source(folder: Path) -> Path:
    """A tiny random Llama with the bundled BPE tokenizer, saved to folder/source."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_concept.data.bpe import bundled_tokenizer

    tokenizer = bundled_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder / "source")
    tokenizer.save_pretrained(folder / "source")
    return folder / "source"


def quick_fixture(folder: Path) -> tuple[Path, Path]:
    """The --quick stand-ins: `tiny_source` and `bundled_corpus`."""
    return tiny_source(folder), bundled_corpus(folder)


def bundled_corpus(folder: Path) -> Path:
    """A train / validation / held_out DatasetDict cut from the bundled corpus (paragraphs; validation and
    held_out alternate), saved to folder/corpus: a corpus in the built corpus's layout, in seconds."""
    from datasets import Dataset, DatasetDict

    from hf_concept.data.corpus import corpus_documents

    rows: dict[str, list[dict]] = {"train": [], "validation": [], "held_out": []}
    for split in ("train", "validation"):
        for name, text in corpus_documents(split):
            language = Path(name).stem
            paragraphs = [piece for piece in text.split("\n\n") if piece.strip()]
            for index, paragraph in enumerate(paragraphs):
                target = split if split == "train" else ("validation", "held_out")[index % 2]
                rows[target].append(
                    dict(
                        text=paragraph,
                        language=language,
                        kind="prose",
                        source=name,
                        document=f"{name}#{index}",
                    )
                )
    DatasetDict({split: Dataset.from_list(items) for split, items in rows.items()}).save_to_disk(
        folder / "corpus"
    )
    return folder / "corpus"


QUICK = dict(
    minutes=1.0,
    max_steps=3,
    eval_every_minutes=1.0,
    eval_bytes=300,
    batch_size=2,
    context=32,
    answer_tokens=4,
    threads=1,
    encoder_layers=1,
    decoder_layers=1,
    lora_rank=4,
    eval_splits="validation,held_out",
)


if __name__ == "__main__":
    main()
