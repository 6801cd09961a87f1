"""Hidden Decoding's learning results at toy scale, all by continued training of one pretrained source:
which supervision (HD §5.1, Table 5: final stream vs every stream vs the streams' sum), how many streams
(§4.3 and §2.3: loss against n, progressive 1 → 2 → 4 against direct), how many full cross-stream layers
(§4.4, Table 4: 1, some, all), and the RoPE choice in intra layers (token vs expanded positions; not in
the paper).

Per seed, a `transformers` `LlamaForCausalLM` (`--width`, `--layers`, heads of width 16 with half as many
KV heads, MLPs 3× wide, untied head) is pretrained for `--pretrain-steps` on the bundled corpus's train
split and saved. Then every arm continues from it for `--continue-steps` on the very same new batches
(a continuation seed, seed + 1000, that the pretraining did not draw), peak lr `--continue-lr`:
- "source continued": the Llama itself, not converted (n = 1: a converted n = 1 model computes the
  source's logits exactly, so it is also §4.3's n = 1 row);
- "HD (n=2)", "HD (n=3)", "HD (n=4)": `convert_to_hidden_decoding` with its defaults (one full
  cross-stream layer in four, the rest intra; token RoPE positions in intra layers), final-stream loss;
- "all-token loss (n=2)", "sum (n=2)": HD (n=2) with `stream_supervision` "all_streams" (every stream
  predicts the next token; loss = mean over streams) and "sum" (norm(sum of the streams) is predicted);
- "progressive 1→2→4": HD (n=2) for the first half of the steps, grown to n = 4 by cyclic replication
  (`expand_hidden_decoding`, eq. 5) and continued for the second half on the remaining batches; each
  phase has its own warm-up and cosine schedule (each factor converges before the next, Appendix G);
- "HD (n=4), 1 full layer", "HD (n=4), all full": HD (n=4) with only the default layout's first full
  layer kept (the others intra), and with every layer full; HD (n=4) itself is the "some" row;
- "HD (n=4), expanded positions": HD (n=4) with `intra_stream_positions="expanded"` (p·n + k, the
  paper's);
- "all-token loss (n=4)", "sum (n=4)": Table 5's supervisions at n = 4 (not in the paper), run only when
  `--arms` names them (the default set is the ten above, so that a default run and sweep stay as they
  were).
Every arm converts with the converter's lossless default (token-block cross-stream layers, token
positions), under which a "sum" or "all_streams" loss gives every stream the same gradient: those arms
stay their source (the model warns; REPRODUCTION.md, the re-run with the lossless conversion).
`--conversion-form paper` converts every arm in the paper's form instead (causal cross-stream mask,
expanded positions: step 0 is no longer the source, and the streams can differ under any loss).
Held-out LM loss (nats per token, from the logits, i.e. the final stream's prediction, or the sum's) on
the corpus's `validation` split in non-overlapping windows of `--context` tokens, right after conversion
(the source's own loss for the source) and after continuing; the progressive arm also just before and
after its expansion.

Matched: initial backbone weights, batches and their order, tokens seen, optimizer (AdamW, weight decay
0.01, clip 1.0), schedule (10% warm-up, cosine to 10%), steps and lr. Not matched, as in the paper: the
compute per token (about n× the source's) and the embedding parameters (n tables); the progressive arm
spends half its steps at n = 2, so less compute than direct n = 4. Optimiser state starts fresh at
conversion and at expansion. No value was tuned, and nothing was chosen on held-out figures: the lrs are
reproduce_conceptmoe's (the demo's scale), the layouts the converter's default and the paper's
extremes. Mean ± sample std over the seeds, Δ = per-seed (paired) difference against the source
continued. Jobs (a pretraining per seed, then one per arm and seed) run in `--workers` processes of
`--threads` torch threads. Per-seed values and training curves in `--json`; `--png` draws the curves
(matplotlib, the `plots` extra). `--quick` is a smoke run (tiny model, a few steps, one seed). The
defaults take about 35 minutes with 2 workers of 1 thread on 2 cores (from per-step times measured at
the default sizes: 0.20 s per source step, 5.05 s per step of all ten arms together).

`--sweep-dir DIR` runs the same jobs as a resumable sweep (`hf_concept.training.sweep`): a manifest of
the runs (per seed: the pretraining, then every arm), the pretrained sources kept in `DIR/models`, a
checkpoint of each run every `--checkpoint-minutes` (the progressive arm's phase and expansion figures
included), one line per finished run in `DIR/results.jsonl`; started again after a kill, it skips the
finished runs and resumes the others to the figures an uninterrupted sweep gives. `--status` prints each
run as done / running / left with time estimates, and trains nothing.

`--arms` runs some of the arms only (comma-separated names or their short aliases: baseline, hd-n2,
hd-n3, hd-n4, sum-n2, sum-n4, all-token-n2, all-token-n4, progressive, hd-n4-one-full, hd-n4-all-full,
hd-n4-expanded); the source continued is always run, every arm being compared with it. A table row or
direction that needs an arm not run says "not run"; a sweep records its runs, so a sweep started with
other arms is refused like one started with other settings.

Each run prints and records `gap` = held-out loss − training LM loss (mean over the last 5% of steps).
`--corpus DIR` trains and scores on a corpus saved by `hf-concept build-corpus` instead (`corpus_data`):
a BPE of the same kind trained on a sample of its train split, each training window read at most once
by a model (the arms continue on the windows after their source's pretraining; too many steps are
refused with the figures), held-out figures on `--heldout-tokens` of its `held_out` split, in
the training mix of language/kind cells, pooled here. The tables, directions and figure are
`hidden_decoding_report.py`'s.

    python benchmarks/reproduce_hidden_decoding.py [--seeds 0,1,2] [--pretrain-steps 400]
        [--continue-steps 250] [--width 64] [--layers 8] [--context 128] [--batch-size 16]
        [--accumulation 1] [--lr 3e-3] [--continue-lr 1e-3] [--workers 2] [--threads 1]
        [--json PATH] [--png PATH] [--quick] [--corpus DIR [--heldout-tokens N]]
        [--sweep-dir DIR [--checkpoint-minutes 5] [--status]] [--arms hd-n2,sum-n2,all-token-n2,...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corpus_data
import eval_bits_per_byte as runner
import reproduce_dlcm
from hidden_decoding_report import BASELINE, PAPER, draw, print_report
from reproduce_conceptmoe import chosen_arms

from hf_concept.conversion.hidden_decoding import compact_layout
from hf_concept.modeling.configuration_hidden_decoding import default_stream_layout
from hf_concept.training import sweep
from hf_concept.utils import eval_mode

HEAD_WIDTH = 16
# `--conversion-form` -> the converter's cross-stream options.
CONVERSION_FORMS = {
    "lossless": dict(cross_stream_mask="token_block", cross_stream_positions="token"),
    "paper": dict(cross_stream_mask="causal", cross_stream_positions="expanded"),
}
CONTINUATION_SEED = 1000


class Variant(NamedTuple):
    """One continued-training arm: `num_streams` (1: the source itself, not converted), `layout` (a
    `stream_layout` name), `supervision` (`stream_supervision`), `positions` (`intra_stream_positions`)
    and `expand_to` (progressive expansion to that many streams halfway)."""

    num_streams: int = 1
    layout: str = "some"
    supervision: str = "final"
    positions: str = "token"
    expand_to: int | None = None

    @property
    def cost(self) -> float:
        """Rough steps' cost in source steps (the longest arms are queued first)."""
        streams = (self.num_streams + self.expand_to) / 2 if self.expand_to else self.num_streams
        return streams + (1 if self.layout == "all-full" else 0)


VARIANTS = {
    BASELINE: Variant(),
    "all-token loss (n=2)": Variant(2, supervision="all_streams"),
    "sum (n=2)": Variant(2, supervision="sum"),
    "HD (n=2)": Variant(2),
    "HD (n=3)": Variant(3),
    "HD (n=4)": Variant(4),
    "progressive 1→2→4": Variant(2, expand_to=4),
    "HD (n=4), 1 full layer": Variant(4, layout="one-full"),
    "HD (n=4), all full": Variant(4, layout="all-full"),
    "HD (n=4), expanded positions": Variant(4, positions="expanded"),
    "all-token loss (n=4)": Variant(4, supervision="all_streams"),
    "sum (n=4)": Variant(4, supervision="sum"),
}
# Run only when --arms names them: the default run and its sweep manifest stay those of the first ten.
OPT_IN = ("all-token loss (n=4)", "sum (n=4)")
DEFAULT_ARMS = tuple(name for name in VARIANTS if name not in OPT_IN)
# --arms' short names (the arms' own names are accepted too).
ALIASES = {
    "baseline": BASELINE,
    "all-token-n2": "all-token loss (n=2)",
    "sum-n2": "sum (n=2)",
    "hd-n2": "HD (n=2)",
    "hd-n3": "HD (n=3)",
    "hd-n4": "HD (n=4)",
    "progressive": "progressive 1→2→4",
    "hd-n4-one-full": "HD (n=4), 1 full layer",
    "hd-n4-all-full": "HD (n=4), all full",
    "hd-n4-expanded": "HD (n=4), expanded positions",
    "all-token-n4": "all-token loss (n=4)",
    "sum-n4": "sum (n=4)",
}
QUICK = dict(
    seeds=(0,), pretrain_steps=4, continue_steps=4, width=32, layers=8, context=32, batch_size=4,
    accumulation=2,
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=runner.seed_list, default=(0, 1, 2), help="comma-separated seeds")
    parser.add_argument("--pretrain-steps", type=int, default=400, help="steps of the Llama source")
    parser.add_argument("--continue-steps", type=int, default=250, help="continued-training steps per arm")
    parser.add_argument("--width", type=int, default=64, help="hidden width")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (at least 8: see §4.4)")
    parser.add_argument("--context", type=int, default=128, help="tokens per crop and held-out window")
    parser.add_argument("--batch-size", type=int, default=16, help="crops per optimizer step")
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak lr of the pretraining")
    parser.add_argument("--continue-lr", type=float, default=1e-3, help="peak lr of continued training")
    aliases = "; ".join(f"{alias} = {name}" for alias, name in ALIASES.items())
    parser.add_argument(
        "--arms", default=None, help="comma-separated arms to run besides the source continued (always "
        f"run), by name or alias ({aliases}); default all but {' and '.join(OPT_IN)}",
    )  # fmt: skip
    parser.add_argument(
        "--conversion-form", choices=tuple(CONVERSION_FORMS), default="lossless",
        help="how every arm is converted: 'lossless' (the converter's default: cross-stream attention by "
        "token block, token positions; step 0 is the source, and sum / all-token losses leave the streams "
        "copies) or 'paper' (causal cross-stream mask, expanded positions, as the paper builds it)",
    )  # fmt: skip
    runner.add_run_flags(parser)
    sweep.add_sweep_flags(parser)
    corpus_data.add_corpus_flags(parser)
    counts = ("pretrain_steps", "continue_steps", "context", "batch_size", "accumulation", "width")
    counts += ("heldout_tokens",)
    args = runner.finish_run_flags(parser, parser.parse_args(argv), QUICK, counts, argv)
    sweep.check_sweep_flags(parser, args)
    if args.continue_steps < 2:
        parser.error(f"--continue-steps={args.continue_steps} must be >= 2 (progressive: two halves)")
    if args.width % (2 * HEAD_WIDTH):
        parser.error(f"--width={args.width} must be a multiple of {2 * HEAD_WIDTH} (heads of 16, KV half)")
    # With fewer layers the default layout has a single full layer: "1 full" and "some" would coincide.
    if args.layers < 8:
        parser.error(f"--layers={args.layers} must be >= 8 for three distinct §4.4 layouts")
    if args.arms is None:
        args.arms = DEFAULT_ARMS
    else:
        chosen = chosen_arms(parser, args.arms, {**{name: name for name in VARIANTS}, **ALIASES})
        args.arms = tuple(name for name in VARIANTS if name in {BASELINE, *chosen})
    return args


# ---------------------------------------------------------------------------------------------- models


def stream_layout(name: str, layers: int) -> list[str]:
    """The §4.4 layouts: "some" is the converter's default (a full layer every 4th, the rest intra),
    "one-full" keeps only its first full layer (so 1 ⊂ some ⊂ all), "all-full" makes every layer full."""
    default = default_stream_layout(layers)
    if name == "some":
        return default
    if name == "one-full":
        first = default.index("full")
        return ["full" if index == first else "intra" for index in range(layers)]
    if name == "all-full":
        return ["full"] * layers
    raise ValueError(f"layout={name!r} must be one of 'some', 'one-full', 'all-full'")


def llama_source(args: argparse.Namespace, seed: int, vocab_size: int, pad_id: int):
    """A `transformers` Llama of the run's shape, initialised from `seed`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = args.width // HEAD_WIDTH
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.width, intermediate_size=3 * args.width,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
        max_position_embeddings=args.context, tie_word_embeddings=False, pad_token_id=pad_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def convert_variant(args: argparse.Namespace, name: str, source: Path, folder: Path) -> torch.nn.Module:
    """Arm `name` built from the saved source: the source itself for n = 1, else converted into `folder`
    with the arm's layout and positions, and loaded with its supervision."""
    from transformers import LlamaForCausalLM

    from hf_concept.conversion import convert_to_hidden_decoding
    from hf_concept.modeling.modeling_hidden_decoding import HiddenDecodingForCausalLM

    variant = VARIANTS[name]
    if variant.num_streams == 1:
        return LlamaForCausalLM.from_pretrained(source, dtype=torch.float32)
    path = convert_to_hidden_decoding(
        source, folder, num_streams=variant.num_streams,
        stream_attention_layout=stream_layout(variant.layout, args.layers),
        intra_stream_positions=variant.positions, **CONVERSION_FORMS[args.conversion_form],
    )  # fmt: skip
    return HiddenDecodingForCausalLM.from_pretrained(
        path, dtype=torch.float32, stream_supervision=variant.supervision
    )


def expanded(model: torch.nn.Module, num_streams: int, folder: Path) -> torch.nn.Module:
    """`model` grown to `num_streams` streams by cyclic replication (eq. 5), through a saved checkpoint."""
    from hf_concept.conversion import expand_hidden_decoding
    from hf_concept.modeling.modeling_hidden_decoding import HiddenDecodingForCausalLM

    model.save_pretrained(folder / "before")
    path = expand_hidden_decoding(folder / "before", folder / "after", num_streams=num_streams)
    return HiddenDecodingForCausalLM.from_pretrained(path, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- training


def batches(
    args: argparse.Namespace, data: dict, seed: int, steps: int, after: tuple[int, int] | None = None
) -> Sequence[torch.Tensor]:
    """The `steps` batches (B, L) drawn from `seed`: every arm of a seed trains on the same ones. Bundled
    text: random crops. `--corpus`: windows read once, in the order of `after`'s seed after its steps
    (the pretraining the arms continue), else of `seed` (`corpus_data`)."""
    windows = data.get("windows")
    if windows is None:
        rng = random.Random(seed)
        return [runner.sample_batch(data["rows"], args.batch_size, args.context, rng) for _ in range(steps)]
    order_seed, skip_steps = after if after is not None else (seed, 0)
    return corpus_data.WindowBatches(
        windows, order_seed, skip_steps * args.batch_size, steps, args.batch_size
    )


def prediction_loss(logits: torch.Tensor, input_ids: torch.Tensor, items: torch.Tensor) -> float:
    """The logits' shifted next-token cross-entropy summed and divided by `items` (a detached figure)."""
    total = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float().detach(), input_ids[:, 1:].flatten(), reduction="sum"
    )
    return (total / items).item()


def trainer(
    model: torch.nn.Module, steps: list[torch.Tensor], accumulation: int, lr: float
) -> tuple[dict, Callable[[int], dict]]:
    """The state a run keeps across a kill (model, AdamW and schedule over `len(steps)`) and its step i:
    one AdamW step on batch i of `steps` (`eval_bits_per_byte.optimizer_step`). Its record: the loss
    optimised and `lm_loss`, the prediction's own cross-entropy (they differ only under all-stream
    supervision), and the step's seconds."""
    all_streams = getattr(model.config, "stream_supervision", "final") == "all_streams"
    optimizer, schedule = runner.optimizer_and_schedule(model, lr, len(steps))
    model.train()
    clock = [time.perf_counter()]

    def step(index: int) -> dict:
        outputs = runner.optimizer_step(model, optimizer, schedule, steps[index], accumulation)
        loss = sum(output.loss.item() for _, output in outputs)
        lm_loss = loss
        if all_streams:
            items = torch.tensor(sum(micro.shape[0] * (micro.shape[1] - 1) for micro, _ in outputs))
            lm_loss = sum(prediction_loss(output.logits, micro, items) for micro, output in outputs)
        now = time.perf_counter()
        record = dict(loss=loss, lm_loss=lm_loss, seconds=now - clock[0])
        clock[0] = now
        return record

    return dict(model=model, optimizer=optimizer, schedule=schedule), step


def train(model: torch.nn.Module, steps: list[torch.Tensor], accumulation: int, lr: float) -> list[dict]:
    """One AdamW step per batch of `steps`; one record per step (`trainer`)."""
    _, step = trainer(model, steps, accumulation, lr)
    return [step(index) for index in range(len(steps))]


class ArmTraining:
    """An arm's continued training as a sweep checkpoints it: the model, its AdamW and schedule, and for
    the progressive arm the phase (0: n = 2 on the first half of the batches, 1: grown to n = 4 on the
    rest, with a fresh optimizer and schedule) and the held-out losses read at its expansion.

    Growing is part of step `half`, so a run resumed at any step takes the steps an uninterrupted run
    takes; a checkpoint of phase 1 grows the freshly converted model first, then loads its state."""

    def __init__(self, args: argparse.Namespace, variant: Variant, model, steps: list, data: dict, scratch):
        self.args, self.variant, self.data, self.scratch = args, variant, data, Path(scratch)
        self.steps = steps
        self.half = len(steps) // 2 if variant.expand_to else len(steps)
        self.phase, self.figures = 0, {}
        self._start(model, steps[: self.half])

    def _start(self, model: torch.nn.Module, steps: list) -> None:
        self.model = model
        self.stateful, self._step = trainer(model, steps, self.args.accumulation, self.args.continue_lr)

    def _grow(self) -> None:
        self.phase = 1
        grown = expanded(self.model, self.variant.expand_to, self.scratch)
        self._start(grown, self.steps[self.half :])

    def step(self, index: int) -> dict:
        if index == self.half and self.phase == 0:
            heldout, context = self.data["heldout"], self.args.context
            self.figures["before_expansion"] = evaluate(self.model, heldout, context)
            self._grow()
            self.figures["after_expansion"] = evaluate(self.model, heldout, context)
        return self._step(index - self.half if self.phase else index)

    def state_dict(self) -> dict:
        objects = {name: value.state_dict() for name, value in self.stateful.items()}
        return dict(phase=self.phase, figures=dict(self.figures), objects=objects)

    def load_state_dict(self, state: dict) -> None:
        if state["phase"] == 1 and self.phase == 0:
            self._grow()
        self.figures = dict(state["figures"])
        for name, value in self.stateful.items():
            value.load_state_dict(state["objects"][name])


@torch.no_grad()
def evaluate(model: torch.nn.Module, documents: list, context: int) -> float:
    """Held-out LM loss, nats per token, of the logits (whatever the training loss was)."""
    nats = predicted = 0.0
    with eval_mode(model):
        for _, window in reproduce_dlcm.heldout_windows(documents, context):
            if len(window) < 2:
                continue
            logits = model(input_ids=window[None], use_cache=False).logits  # (1, L, V)
            nats += torch.nn.functional.cross_entropy(logits[0, :-1].float(), window[1:], reduction="sum")
            predicted += len(window) - 1
    return float(nats) / predicted


# ---------------------------------------------------------------------------------------------- jobs


def source_path(folder: str, seed: int) -> Path:
    return Path(folder) / f"seed{seed}" / "source"


def pretrain_job(args: argparse.Namespace, seed: int, folder: str) -> dict:
    """Pretrain the seed's Llama source and save it under `folder` for the arms (under `--sweep-dir` as a
    resumable run, the source kept in `DIR/models`)."""
    torch.set_num_threads(args.threads)
    data = reproduce_dlcm.load_data_once(args)

    def build():
        start = time.perf_counter()
        source = llama_source(args, seed, data["vocab_size"], data["pad_id"])
        steps = batches(args, data, seed, args.pretrain_steps)
        stateful, step = trainer(source, steps, args.accumulation, args.lr)

        def finish(history: list[dict]) -> dict:
            loss = evaluate(source, data["heldout"], args.context)
            runner.save_whole(source, source_path(folder, seed))
            return dict(part="pretrain", seed=seed, pretrained=loss, history=history, **gap(loss, history),
                        seconds=time.perf_counter() - start, parameters=source.num_parameters())  # fmt: skip

        return stateful, step, finish

    record = sweep.run_or_resume(
        sweep_folder(args), run_spec(args, "pretrain", seed), build, args.pretrain_steps,
        args.checkpoint_minutes,
    )  # fmt: skip
    seconds = record.get("wall_seconds", record["seconds"])
    print(f"[seed {seed}] source pretrained: held-out loss {record['pretrained']:.4f}, training loss "
          f"{record['train_loss']:.4f} (last 5%), gap {record['gap']:+.4f} ({seconds:.0f} s)",
          flush=True)  # fmt: skip
    return dict(record, seconds=seconds)


def variant_job(args: argparse.Namespace, name: str, seed: int, folder: str) -> dict:
    """Convert the seed's source into arm `name`, evaluate, continue on the continuation batches, evaluate
    (under `--sweep-dir` as a resumable run)."""
    torch.set_num_threads(args.threads)
    data = reproduce_dlcm.load_data_once(args)
    variant = VARIANTS[name]
    start = time.perf_counter()
    # The converted copy goes to the system's temp folder: a kill leaves no stray folder in the sweep's.
    with tempfile.TemporaryDirectory() as scratch:

        def build():
            after = (seed, args.pretrain_steps)
            steps = batches(args, data, seed + CONTINUATION_SEED, args.continue_steps, after)
            torch.manual_seed(seed + CONTINUATION_SEED)
            model = convert_variant(args, name, source_path(folder, seed), Path(scratch) / "converted")
            result = dict(part="variant", name=name, seed=seed, converted=evaluate(model, data["heldout"],
                          args.context), parameters=model.num_parameters())  # fmt: skip
            arm = ArmTraining(args, variant, model, steps, data, scratch)

            def finish(history: list[dict]) -> dict:
                heldout = evaluate(arm.model, data["heldout"], args.context)
                layout = arm.model.config.stream_attention_layout if variant.num_streams > 1 else None
                return dict(result, **arm.figures, heldout=heldout, history=history, **gap(heldout, history),
                            layout=compact_layout(layout) if layout else "-")  # fmt: skip

            return dict(arm=arm), arm.step, finish

        record = sweep.run_or_resume(
            sweep_folder(args), run_spec(args, name, seed), build, args.continue_steps,
            args.checkpoint_minutes,
        )  # fmt: skip
    record = dict(record, seconds=record.get("wall_seconds", time.perf_counter() - start))
    print(f"[seed {seed}] {name} [{record.pop('layout')}]: converted {record['converted']:.4f}, continued "
          f"{record['heldout']:.4f}, training loss {record['train_loss']:.4f} (last 5%), gap "
          f"{record['gap']:+.4f} ({record['seconds']:.0f} s)", flush=True)  # fmt: skip
    return record


def gap(heldout: float, history: list[dict]) -> dict:
    """`train_loss`, the prediction's LM loss over the last 5% of the steps, and `gap` = held-out − it."""
    train_loss = reproduce_dlcm.at_fraction(history, "lm_loss", 1.0)
    return dict(train_loss=train_loss, gap=heldout - train_loss)


def sweep_folder(args: argparse.Namespace) -> Path | None:
    return Path(args.sweep_dir) if args.sweep_dir else None


def run_spec(args: argparse.Namespace, arm: str, seed: int) -> sweep.RunSpec:
    """The sweep's run of `arm` ("pretrain" or an arm of `VARIANTS`) and `seed`, with the flags that
    change its result (torch threads too: they can move the last bits)."""
    shared = ("width", "layers", "context", "batch_size", "accumulation", "threads", "pretrain_steps", "lr")
    settings = dict({field: getattr(args, field) for field in shared}, **corpus_data.corpus_settings(args))
    if arm != "pretrain":
        variant = VARIANTS[arm]._asdict()
        settings.update(continue_steps=args.continue_steps, continue_lr=args.continue_lr, variant=variant)
        if args.conversion_form != "lossless":  # recorded only when set, so earlier sweeps still resume
            settings["conversion_form"] = args.conversion_form
    return sweep.RunSpec("hidden-decoding", arm, seed, settings)


def sweep_specs(args: argparse.Namespace) -> list[sweep.RunSpec]:
    """The sweep's manifest runs: per seed, the pretraining, then every arm run."""
    return [run_spec(args, arm, seed) for seed in args.seeds for arm in ("pretrain", *args.arms)]


Job = tuple[Callable[..., dict], tuple]


def run_dependent_jobs(jobs: list[Job], follow_ups: Callable[[dict], list[Job]], workers: int) -> list[dict]:
    """Results of `jobs` and of the jobs `follow_ups(result)` names as each result arrives (queued behind
    what is already queued), in `workers` spawned processes, or in this one for a single worker.

    reproduce_conceptmoe's `run_jobs` runs a fixed list; here a seed's arms wait for its source."""
    if workers == 1:
        queue, results = list(jobs), []
        while queue:
            function, arguments = queue.pop(0)
            results.append(function(*arguments))
            queue += follow_ups(results[-1])
        return results
    # spawn: a forked child would inherit the parent's torch thread pools.
    context = multiprocessing.get_context("spawn")
    results = []
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        pending = {pool.submit(function, *arguments) for function, arguments in jobs}
        while pending:
            done, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                results.append(future.result())
                pending |= {
                    pool.submit(function, *arguments) for function, arguments in follow_ups(results[-1])
                }
    return results


def run_jobs(args: argparse.Namespace, folder: str) -> list[dict]:
    """Every seed's pretraining, then its arms (`--arms`), the costliest first."""
    order = sorted(args.arms, key=lambda name: -VARIANTS[name].cost)

    def arms(result: dict) -> list[Job]:
        if result["part"] != "pretrain":
            return []
        return [(variant_job, (args, name, result["seed"], folder)) for name in order]

    return run_dependent_jobs(
        [(pretrain_job, (args, seed, folder)) for seed in args.seeds], arms, args.workers
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.sweep_dir and sweep.open_sweep_or_exit(args, lambda: sweep_specs(args)):
        return {}
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    data = reproduce_dlcm.load_data_once(args)
    steps = args.pretrain_steps + args.continue_steps
    corpus_data.require_windows(data, args, steps, "a source's pretraining + an arm's continuation")
    with tempfile.TemporaryDirectory() as scratch:
        # A sweep keeps each seed's pretrained source for arms that a later start runs.
        folder = Path(args.sweep_dir) / "models" if args.sweep_dir else Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        runs = run_jobs(args, str(folder))
    wall = time.perf_counter() - start
    runs.sort(
        key=lambda run: (
            run["part"] != "pretrain",
            run["seed"],
            list(VARIANTS).index(run.get("name", BASELINE)),
        )
    )
    verdict = print_report(args, runs, wall)
    drawn = draw(runs, args.png) if args.png else False
    layouts = {
        name: compact_layout(stream_layout(variant.layout, args.layers)) if variant.num_streams > 1 else "-"
        for name, variant in VARIANTS.items()
        if name in args.arms
    }
    return runner.write_result(
        args, seeds=list(args.seeds), wall_seconds=wall, runs=runs, arms=list(args.arms), layouts=layouts,
        directions={key: value for key, value in verdict.items() if value is not None},
        heldout_tokens=data["heldout_tokens"], png=args.png if drawn else None, paper=PAPER,
    )  # fmt: skip


if __name__ == "__main__":
    main()
