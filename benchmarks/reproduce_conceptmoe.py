"""ConceptMoE's ablations and CT conversion at toy scale (ConceptMoE §4.5.1–§4.5.4, §4.3): at R = 2 and
matched compute, is dynamic chunking better than no chunking and fixed chunking worse; what do the
cosine vs linear router, joint decoding and the aux weight λ change; is converting a pretrained MoE
during continued training lossless?

From scratch, each trained from the same seed on the very same batches (per seed):
- "no-chunk": the plain MoE decoder (`PlainDecoderForCausalLM`, the source architecture);
- "dynamic": ConceptMoE with `ConceptMoEConfig`'s defaults (cosine router, joint decoding on the last
  decoder layers, λ = `aux_loss_weight` = 0.03, Global scope), R = 2;
- "fixed": the same with fixed chunking (every R-th token opens a concept);
- "linear-router", "no-joint" (`joint_decoding_layers=0`), "lambda-0.01", "lambda-0.1": "dynamic" with
  one field changed.
Every ConceptMoE gives its saved compute back as the paper does (§3.5 Strategy 1): the concept layers'
top-k (`concept_num_experts_per_tok`) is the one whose matmul FLOPs per token come nearest the
source's, computed by `hf_concept.compute.conceptmoe_compute` (the table printed first) for "dynamic" and
"fixed"; the four ablations keep the dynamic model's top-k, so that each changes one field.

CT conversion (§4.3), per seed: a `transformers` `MixtralForCausalLM` of the same shape is pretrained for
`--pretrain-steps`, saved, converted with `convert_to_conceptmoe` (dynamic router, R = 1.5 and 2, top-k
matched as above), and each converted model and the source itself continue for `--continue-steps` on the
same new batches (peak lr `--continue-lr`). Held-out loss is read right after conversion and at the end.

Architecture (`--width`, `--layers` encoder/concept/decoder; heads of width 16 with half as many KV
heads; every layer a MoE of 8 experts of width `--width`, top-2, no load-balancing loss), the bundled
BPE tokenizer (`hf_concept.data.bpe`, 3072 ids). Optimiser: AdamW, 10% warm-up then cosine to 10%, clip
1.0; each step is `--batch-size` crops of `--context` tokens of one train document (drawn in proportion
to its length) in `--accumulation` micro-batches, normalised as `Trainer` does (`num_items_in_batch`).
Held-out: the corpus's `validation` split, never used for a choice, in non-overlapping windows of
`--context` tokens: LM loss (nats per token) and the inference ratio (tokens per concept, thresholded
router). No value was tuned: the paper's R and λ grid, the config defaults, the demo's lr and scale.
Jobs run in `--workers` processes of `--threads` torch threads each. Mean ± sample std over the seeds;
per-seed values and curves in `--json`; `--png` draws them (matplotlib, the `plots` extra). `--quick` is
a smoke run (tiny model, a few steps, one seed).

`--sweep-dir DIR` runs the same jobs as a resumable sweep (`hf_concept.training.sweep`): a manifest of
the runs (per seed: each from-scratch configuration; CT's pretraining, then each converted model and
the source continued, the pretrained source kept in `DIR/models`), a checkpoint of each run every
`--checkpoint-minutes`, one line per finished run in `DIR/results.jsonl`; started again after a kill,
it skips the finished runs and resumes the others to the results an uninterrupted sweep gives.
`--status` prints each run as done / running / left with time estimates, and trains nothing.

`--arms` runs some of the arms only (comma-separated): the from-scratch configurations named above and
`ct`, the whole CT group (pretraining, both conversions and the source continued); default all. A table
row, paired difference or direction that needs an arm not run says "not run"; a sweep records its runs,
so a sweep started with other arms is refused like one started with other settings.

Each run prints and records `gap` = held-out loss − training LM loss (mean over the last 5% of steps).
`--corpus DIR` trains and scores on a corpus saved by `hf-concept build-corpus` instead (`corpus_data`):
a BPE of the same kind trained on a sample of its train split, each training window read at most once
by a model (CT's continuation reads the windows after its pretraining's; too many steps are refused
with the figures), held-out figures on `--heldout-tokens` of its `held_out` split, in the training
mix of cells. The tables, directions and figure are `conceptmoe_report.py`'s.

    python benchmarks/reproduce_conceptmoe.py [--seeds 0,1,2] [--steps 300] [--pretrain-steps 400]
        [--continue-steps 200] [--width 64] [--layers 2,4,2] [--context 256] [--batch-size 16]
        [--accumulation 2] [--lr 3e-3] [--continue-lr 1e-3] [--workers 2] [--threads 1]
        [--json PATH] [--png PATH] [--quick] [--corpus DIR [--heldout-tokens N]]
        [--sweep-dir DIR [--checkpoint-minutes 5] [--status]] [--arms no-chunk,fixed,dynamic,ct]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corpus_data
import eval_bits_per_byte as runner
import reproduce_dlcm
from conceptmoe_report import (
    CT_RATIOS,
    PAPER,
    SCRATCH,
    TARGET_RATIO,
    draw,
    final,
    print_compute_table,
    print_report,
)

from hf_concept.compute import conceptmoe_compute
from hf_concept.modeling.configuration_conceptmoe import ConceptMoEConfig
from hf_concept.modeling.configuration_plain import PlainDecoderConfig
from hf_concept.modeling.modeling_conceptmoe import ConceptMoEForCausalLM
from hf_concept.modeling.modeling_plain import PlainDecoderForCausalLM
from hf_concept.modeling.routing import RatioAccumulator
from hf_concept.training import sweep
from hf_concept.utils import eval_mode

NUM_EXPERTS, TOP_K = 8, 2
HEAD_WIDTH = 16
# The CT group's arm for --arms.
CT = "ct"
ARMS = (*SCRATCH, CT)
QUICK = dict(
    seeds=(0,), steps=4, pretrain_steps=4, continue_steps=4, width=32, layers=(1, 1, 1), context=64,
    batch_size=4, accumulation=2,
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=runner.seed_list, default=(0, 1, 2), help="comma-separated seeds")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of each from-scratch run")
    parser.add_argument("--pretrain-steps", type=int, default=400, help="steps of the CT source")
    parser.add_argument("--continue-steps", type=int, default=200, help="continued-training steps in CT")
    parser.add_argument("--width", type=int, default=64, help="hidden and expert width")
    parser.add_argument(
        "--layers", type=runner._layer_split, default=(2, 4, 2), help="encoder,concept,decoder"
    )
    parser.add_argument("--context", type=int, default=256, help="tokens per crop and held-out window")
    parser.add_argument("--batch-size", type=int, default=16, help="crops per optimizer step")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak lr from scratch and in pretraining")
    parser.add_argument("--continue-lr", type=float, default=1e-3, help="peak lr of continued training")
    parser.add_argument(
        "--arms", default=None, help=f"comma-separated arms to run, of {', '.join(ARMS)} (ct: the whole CT "
        "group: pretraining, conversions, source continued); default all",
    )  # fmt: skip
    runner.add_run_flags(parser)
    sweep.add_sweep_flags(parser)
    corpus_data.add_corpus_flags(parser)
    counts = ("steps", "pretrain_steps", "continue_steps", "context", "batch_size", "accumulation", "width")
    counts += ("heldout_tokens",)
    args = runner.finish_run_flags(parser, parser.parse_args(argv), QUICK, counts, argv)
    sweep.check_sweep_flags(parser, args)
    if args.width % (2 * HEAD_WIDTH):
        parser.error(f"--width={args.width} must be a multiple of {2 * HEAD_WIDTH} (heads of 16, KV half)")
    args.arms = ARMS if args.arms is None else chosen_arms(parser, args.arms, {name: name for name in ARMS})
    return args


def chosen_arms(parser: argparse.ArgumentParser, text: str, spellings: dict[str, str]) -> tuple[str, ...]:
    """The arms `--arms` names (`spellings`: each accepted name -> its arm), in the order the arms first
    appear in `spellings`; an unknown name exits 2 naming it and the valid names."""
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in spellings]
    if unknown:
        parser.error(f"--arms={text!r}: unknown arm {unknown[0]!r}; valid: {', '.join(spellings)}")
    wanted = {spellings[name] for name in names}
    return tuple(arm for arm in dict.fromkeys(spellings.values()) if arm in wanted)


# ---------------------------------------------------------------------------------------------- models


def backbone(args: argparse.Namespace, vocab_size: int, pad_id: int) -> dict:
    """The plain MoE decoder's fields, shared by every model here."""
    heads = args.width // HEAD_WIDTH
    return dict(
        vocab_size=vocab_size, hidden_size=args.width, intermediate_size=3 * args.width,
        num_hidden_layers=sum(args.layers), num_attention_heads=heads, num_key_value_heads=heads // 2,
        num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=args.width,
        max_position_embeddings=max(args.context, 64), tie_word_embeddings=False, pad_token_id=pad_id,
    )  # fmt: skip


def matched_top_k(fields: dict, context: int) -> tuple[int, float]:
    """The concept layers' top-k whose matmul FLOPs per token come nearest the source's (§3.5 Strategy 1),
    and that FLOPs ratio. Attention maps are left out, as the paper matches "excluding attention"."""
    best = None
    for top_k in range(fields["num_experts_per_tok"], fields["num_experts"] + 1):
        report, source = conceptmoe_compute(
            ConceptMoEConfig(**fields, concept_num_experts_per_tok=top_k), context
        )
        ratio = report.matmul_flops / source.matmul_flops
        if best is None or abs(ratio - 1) < abs(best[1] - 1):
            best = (top_k, ratio)
    return best


def conceptmoe_config(
    args: argparse.Namespace, changes: dict, vocab_size: int, pad_id: int
) -> ConceptMoEConfig:
    fields = dict(
        backbone(args, vocab_size, pad_id),
        encoder_layers=args.layers[0],
        decoder_layers=args.layers[2],
        compression_ratio=TARGET_RATIO,
        **changes,
    )
    # The ablations keep the dynamic model's top-k, so that each changes one thing; fixed chunking (no
    # router to pay for) is matched on its own, as the paper matches each chunking strategy.
    matched = {key: value for key, value in fields.items() if key not in changes or key == "chunking"}
    top_k, _ = matched_top_k(matched, args.context)
    return ConceptMoEConfig(**fields, concept_num_experts_per_tok=top_k)


def build_scratch(args: argparse.Namespace, name: str, seed: int, vocab_size: int, pad_id: int):
    changes = SCRATCH[name]
    torch.manual_seed(seed)
    if changes is None:
        return PlainDecoderForCausalLM(PlainDecoderConfig(**backbone(args, vocab_size, pad_id)))
    return ConceptMoEForCausalLM(conceptmoe_config(args, changes, vocab_size, pad_id))


def compute_table(args: argparse.Namespace, vocab_size: int, pad_id: int) -> list[dict]:
    """Per ConceptMoE configuration run: concept top-k, parameters and FLOPs per token against the source."""
    rows = []
    for name in scratch_arms(args):
        changes = SCRATCH[name]
        if changes is None:
            continue
        config = conceptmoe_config(args, changes, vocab_size, pad_id)
        report, source = conceptmoe_compute(config, args.context)
        rows.append(
            dict(
                config=name,
                concept_top_k=config.concept_top_k,
                parameters=report.parameters / source.parameters,
                active_parameters=report.active_parameters / source.active_parameters,
                matmul_flops=report.matmul_flops / source.matmul_flops,
                flops=report.flops / source.flops,
            )
        )
    return rows


# ---------------------------------------------------------------------------------------------- training


def step_record(outputs: list, concept: bool) -> dict:
    """A step's record: the loss, and for a ConceptMoE the LM loss and both realised ratios of the step's
    tokens (sampled, and thresholded as inference)."""
    loss = sum(output.loss.item() for _, output in outputs)
    entry = dict(loss=loss, lm_loss=loss)
    if concept:
        # lm_loss is each micro-batch's share of the step's LM loss, like loss.
        tokens = sum(micro.numel() for micro, _ in outputs)
        entry["lm_loss"] = sum(output.lm_loss.item() for _, output in outputs)
        entry["sampled_ratio"] = tokens / sum(
            micro.numel() / output.compression_ratio.item() for micro, output in outputs
        )
        entry["inference_ratio"] = tokens / sum(
            micro.numel() / output.inference_compression_ratio.item() for micro, output in outputs
        )
    return entry


def trainer(
    model: torch.nn.Module,
    args: argparse.Namespace,
    seed: int,
    data: dict,
    steps: int,
    lr: float,
    after: tuple[int, int] | None = None,
) -> tuple[dict, Callable[[int], dict]]:
    """The state a run must keep across a kill (model, AdamW at peak `lr` with `learning_rate_factor`
    over `steps`, the seed's batch generator for bundled text) and the function that performs step i on
    it. Batches: `corpus_data.batch_source`; `after` = (seed, steps) of the pretraining a continued run
    follows, so that on a `--corpus` it reads the windows after those."""
    order_seed, skip_steps = after if after is not None else (None, 0)
    batches, draw = corpus_data.batch_source(data, args, seed, order_seed, skip_steps)
    torch.manual_seed(seed)
    accumulator = RatioAccumulator(args.accumulation)
    concept = isinstance(model, ConceptMoEForCausalLM)
    if concept:
        model.ratio_accumulator = accumulator if model.config.ratio_scope == "global" else None
    optimizer, schedule = runner.optimizer_and_schedule(model, lr, steps)
    model.train()

    def step(index: int) -> dict:
        batch = draw(index)  # (B, L)
        accumulator.reset(batch.numel())
        outputs = runner.optimizer_step(model, optimizer, schedule, batch, args.accumulation)
        return step_record(outputs, concept)

    return dict(model=model, optimizer=optimizer, schedule=schedule, **batches), step


def train(
    model: torch.nn.Module, args: argparse.Namespace, seed: int, data: dict, steps: int, lr: float
) -> list[dict]:
    """`steps` optimizer steps on the seed's batches; one record per step (`step_record`)."""
    _, step = trainer(model, args, seed, data, steps, lr)
    return [step(index) for index in range(steps)]


@torch.no_grad()
def evaluate(model: torch.nn.Module, documents: list, context: int) -> dict:
    """Held-out LM loss (nats per token), and for a ConceptMoE the inference and expected-sampled ratios."""
    nats = predicted = tokens = concepts = expected = 0.0
    with eval_mode(model):
        for _, window in reproduce_dlcm.heldout_windows(documents, context):
            if len(window) < 2:
                continue
            output = model(input_ids=window[None], labels=window[None], use_cache=False)
            lm_loss = getattr(output, "lm_loss", None)
            nats += (output.loss if lm_loss is None else lm_loss).item() * (len(window) - 1)
            predicted += len(window) - 1
            tokens += len(window)
            if isinstance(model, ConceptMoEForCausalLM):
                concepts += len(window) / output.compression_ratio.item()
                expected += len(window) / output.sampled_compression_ratio.item()
    figures = dict(loss=nats / predicted)
    if concepts:
        figures.update(inference_ratio=tokens / concepts, sampled_ratio=tokens / expected)
    return figures


def gap(heldout: dict, history: list[dict]) -> dict:
    """`train_loss`, the LM loss over the last 5% of the steps, and `gap` = held-out loss − it."""
    train_loss = final(history, "lm_loss")
    return dict(train_loss=train_loss, gap=heldout["loss"] - train_loss)


def gap_text(record: dict) -> str:
    return f"training loss {record['train_loss']:.4f} (last 5%), gap {record['gap']:+.4f}"


# ---------------------------------------------------------------------------------------------- jobs


def scratch_job(args: argparse.Namespace, name: str, seed: int) -> dict:
    """Train configuration `name` from `seed` and score it; under `--sweep-dir` as a resumable run."""
    torch.set_num_threads(args.threads)
    data = reproduce_dlcm.load_data_once(args)
    model = build_scratch(args, name, seed, data["vocab_size"], data["pad_id"])
    start = time.perf_counter()
    stateful, step = trainer(model, args, seed, data, args.steps, args.lr)

    def finish(history: list[dict]) -> dict:
        heldout = evaluate(model, data["heldout"], args.context)
        return dict(part="scratch", config=name, seed=seed, parameters=model.num_parameters(),
                    heldout=heldout, history=history, **gap(heldout, history))  # fmt: skip

    if args.sweep_dir:
        spec = scratch_spec(args, name, seed)
        record = sweep.run_resumable(
            spec, args.sweep_dir, stateful, step, args.steps, finish, args.checkpoint_minutes
        )
        record = dict(record, seconds=record["wall_seconds"])
    else:
        record = finish([step(index) for index in range(args.steps)])
        record["seconds"] = time.perf_counter() - start
    heldout = record["heldout"]
    ratio = f", inference ratio {heldout['inference_ratio']:.2f}" if "inference_ratio" in heldout else ""
    print(f"[seed {seed}] {name}: held-out loss {heldout['loss']:.4f}{ratio}, {gap_text(record)} "
          f"({record['seconds']:.0f} s)", flush=True)  # fmt: skip
    return record


def mixtral_source(args: argparse.Namespace, seed: int, vocab_size: int, pad_id: int):
    """A `transformers` Mixtral with the backbone's shape (the CT source)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    fields = backbone(args, vocab_size, pad_id)
    config = MixtralConfig(
        vocab_size=vocab_size, hidden_size=args.width, intermediate_size=fields["moe_intermediate_size"],
        num_hidden_layers=fields["num_hidden_layers"], num_attention_heads=fields["num_attention_heads"],
        num_key_value_heads=fields["num_key_value_heads"], num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K, max_position_embeddings=fields["max_position_embeddings"],
        tie_word_embeddings=False, pad_token_id=pad_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    return MixtralForCausalLM(config)


def ct_job(args: argparse.Namespace, seed: int) -> dict:
    """Pretrain the source, convert it at each CT ratio, continue every model on the same new batches.
    Under `--sweep-dir` each of these is a resumable run of the sweep, the pretrained source kept in
    `DIR/models` for the runs that continue it."""
    torch.set_num_threads(args.threads)
    data = reproduce_dlcm.load_data_once(args)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.sweep_dir) / "models" if args.sweep_dir else Path(scratch)
        source = folder / f"ct-source-seed{seed}"
        pretrain = ct_pretrain(args, seed, data, source)
        rows = [ct_continue(args, seed, data, source, ratio, Path(scratch)) for ratio in CT_RATIOS]
        continued = ct_continue(args, seed, data, source, None, Path(scratch))
    rows.insert(0, dict(continued, converted=pretrain["pretrained"]))
    seconds = time.perf_counter() - start
    return dict(part="ct", seed=seed, pretrained=pretrain["pretrained"], pretrain=pretrain["pretrain"],
                pretrain_gap=pretrain["pretrain_gap"], models=rows, seconds=seconds)  # fmt: skip


def sweep_folder(args: argparse.Namespace) -> Path | None:
    return Path(args.sweep_dir) if args.sweep_dir else None


def ct_pretrain(args: argparse.Namespace, seed: int, data: dict, path: Path) -> dict:
    """The CT source pretrained for `--pretrain-steps` and saved at `path`; its held-out figures."""

    def build():
        source = mixtral_source(args, seed, data["vocab_size"], data["pad_id"])
        stateful, step = trainer(source, args, seed, data, args.pretrain_steps, args.lr)

        def finish(history: list[dict]) -> dict:
            pretrained = evaluate(source, data["heldout"], args.context)
            figures = gap(pretrained, history)
            print(f"[seed {seed}] CT source pretrained: held-out loss {pretrained['loss']:.4f}, "
                  f"{gap_text(figures)}", flush=True)  # fmt: skip
            runner.save_whole(source, path)
            return dict(pretrained=pretrained, pretrain=history, pretrain_gap=figures["gap"])

        return stateful, step, finish

    spec = ct_spec(args, seed, "ct-pretrain")
    return sweep.run_or_resume(sweep_folder(args), spec, build, args.pretrain_steps, args.checkpoint_minutes)


def ct_continue(
    args: argparse.Namespace, seed: int, data: dict, source: Path, ratio: float | None, scratch: Path
) -> dict:
    """The pretrained `source` (ratio None) or its conversion at `ratio` (matched top-k), continued for
    `--continue-steps` on batches the pretraining did not draw (the same for every model)."""
    from transformers import MixtralForCausalLM

    from hf_concept.conversion.conceptmoe import convert_to_conceptmoe

    def build():
        if ratio is None:
            model, figures = MixtralForCausalLM.from_pretrained(source, dtype=torch.float32), {}
        else:
            fields = dict(backbone(args, data["vocab_size"], data["pad_id"]), compression_ratio=ratio,
                          encoder_layers=args.layers[0], decoder_layers=args.layers[2])  # fmt: skip
            top_k, flops = matched_top_k(fields, args.context)
            path = convert_to_conceptmoe(
                source, scratch / f"R{ratio:g}", encoder_layers=args.layers[0],
                decoder_layers=args.layers[2], compression_ratio=ratio, experts_per_token=top_k, seed=seed,
            )  # fmt: skip
            model = ConceptMoEForCausalLM.from_pretrained(path, dtype=torch.float32)
            converted = evaluate(model, data["heldout"], args.context)
            figures = dict(ratio=ratio, concept_top_k=top_k, matmul_flops=flops, converted=converted)
        stateful, step = trainer(
            model, args, seed + 1000, data, args.continue_steps, args.continue_lr, (seed, args.pretrain_steps)
        )

        def finish(history: list[dict]) -> dict:
            heldout = evaluate(model, data["heldout"], args.context)
            gaps = gap(heldout, history)
            if ratio is None:
                print(f"[seed {seed}] CT source continued: held-out loss {heldout['loss']:.4f}, "
                      f"{gap_text(gaps)}", flush=True)  # fmt: skip
                return dict(name="source continued", heldout=heldout, history=history, **gaps)
            print(f"[seed {seed}] CT R={ratio:g} (top-{figures['concept_top_k']}): converted "
                  f"{figures['converted']['loss']:.4f}, continued {heldout['loss']:.4f}, inference ratio "
                  f"{heldout['inference_ratio']:.2f}, {gap_text(gaps)}", flush=True)  # fmt: skip
            return dict(figures, name=f"converted R={ratio:g}", heldout=heldout, history=history, **gaps)

        return stateful, step, finish

    spec = ct_spec(args, seed, "ct-source" if ratio is None else f"ct-R{ratio:g}")
    record = sweep.run_or_resume(
        sweep_folder(args), spec, build, args.continue_steps, args.checkpoint_minutes
    )
    # The model's figures only: a sweep's bookkeeping (run, arm, times) stays in its results file.
    kept = (
        "name",
        "ratio",
        "concept_top_k",
        "matmul_flops",
        "converted",
        "heldout",
        "history",
        "train_loss",
        "gap",
    )
    return {key: record[key] for key in kept if key in record}


def run_jobs(args: argparse.Namespace) -> list[dict]:
    """Every job, the longest (CT) first, in `args.workers` processes (in this one for a single worker).
    Under `--sweep-dir`, a run already in the sweep's results is taken from there, not run again."""
    # A CT job looks up its own runs (pretraining, then each continued model).
    jobs = [(None, ct_job, (args, seed)) for seed in args.seeds if CT in args.arms]
    jobs += [
        (scratch_spec(args, name, seed), scratch_job, (args, name, seed))
        for seed in args.seeds
        for name in scratch_arms(args)
    ]
    done = sweep.read_results(args.sweep_dir) if args.sweep_dir else {}
    if args.workers == 1:
        return [(spec and done.get(spec.key)) or function(*job_args) for spec, function, job_args in jobs]
    # spawn: a forked child would inherit the parent's torch thread pools.
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=context) as pool:
        futures = [
            (spec and done.get(spec.key)) or pool.submit(function, *job_args)
            for spec, function, job_args in jobs
        ]
        return [entry if isinstance(entry, dict) else entry.result() for entry in futures]


def scratch_arms(args: argparse.Namespace) -> list[str]:
    """The from-scratch configurations `--arms` asks for, in `SCRATCH`'s order."""
    return [name for name in SCRATCH if name in args.arms]


def run_settings(args: argparse.Namespace, *names: str) -> dict:
    """The flags that change a run's result (torch threads too: they can move the last bits)."""
    shared = ("width", "layers", "context", "batch_size", "accumulation", "threads")
    return dict(
        {name: getattr(args, name) for name in (*shared, *names)}, **corpus_data.corpus_settings(args)
    )


def scratch_spec(args: argparse.Namespace, name: str, seed: int) -> sweep.RunSpec:
    settings = dict(run_settings(args, "steps", "lr"), changes=SCRATCH[name])
    return sweep.RunSpec("conceptmoe", name, seed, settings)


CT_ARMS = ("ct-pretrain", *(f"ct-R{ratio:g}" for ratio in CT_RATIOS), "ct-source")


def ct_spec(args: argparse.Namespace, seed: int, arm: str) -> sweep.RunSpec:
    """A CT run: "ct-pretrain", "ct-R<ratio>" (converted, continued) or "ct-source" (continued)."""
    pretraining = run_settings(args, "pretrain_steps", "lr")
    if arm == "ct-pretrain":
        return sweep.RunSpec("conceptmoe", arm, seed, pretraining)
    settings = dict(pretraining, continue_steps=args.continue_steps, continue_lr=args.continue_lr)
    return sweep.RunSpec("conceptmoe", arm, seed, settings)


def sweep_specs(args: argparse.Namespace) -> list[sweep.RunSpec]:
    """The sweep's manifest runs, in `run_jobs`' order (the arms run and their settings)."""
    runs = [ct_spec(args, seed, arm) for seed in args.seeds for arm in CT_ARMS if CT in args.arms]
    return runs + [scratch_spec(args, name, seed) for seed in args.seeds for name in scratch_arms(args)]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.sweep_dir and sweep.open_sweep_or_exit(args, lambda: sweep_specs(args)):
        return {}
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    data = reproduce_dlcm.load_data_once(args)
    # A CT model reads its pretraining's windows, then the continuation's: all from one seed's order.
    lineage = max(
        args.steps if scratch_arms(args) else 0,
        args.pretrain_steps + args.continue_steps if CT in args.arms else 0,
    )
    corpus_data.require_windows(
        data, args, lineage, "the longest run (from scratch, or CT's pretraining + continuing)"
    )
    compute = compute_table(args, data["vocab_size"], data["pad_id"])
    print_compute_table(compute)
    runs = run_jobs(args)
    wall = time.perf_counter() - start
    verdict = print_report(args, compute, runs, wall)
    drawn = draw(runs, args.png) if args.png else False
    return runner.write_result(
        args, seeds=list(args.seeds), wall_seconds=wall, compute=compute, runs=runs, arms=list(args.arms),
        directions={key: value for key, value in verdict.items() if value is not None},
        heldout_tokens=data["heldout_tokens"], png=args.png if drawn else None, paper=PAPER,
    )  # fmt: skip


if __name__ == "__main__":
    main()
