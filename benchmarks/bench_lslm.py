"""LSLM against a byte baseline (fair decoder or matched GPT-2) on CPU: decode latency, training throughput.

Models (random initialisation, one seed, fp32, sdpa): `LSLMForCausalLM` with `--layers` token, segment
and decoder layers (default 2,4,2) at widths `--width` (segment encoder) and `--token-width` /
`--decoder-width`, heads of width 32, MLPs 4x wide, built twice with the same weights, pooling `mean` and
`hops:3` (pooling has no parameters); and one baseline, `--baseline`, at depth `--baseline-layers`
(default the LSLM's total layer count: the paper's GPT-2, Appendix B, has as many layers as its LSLM):
- "byte" (default; the fair baseline): `hf_concept.evaluation.byte_decoder_baseline`, the
  project's own decoder (SwiGLU, RMSNorm, RoPE) at the segment encoder's width `--width`, heads of width
  32; matched by shape, not by parameter count.
- "gpt2": `hf_concept.evaluation.byte_gpt2_baseline` matched to the LSLM's parameter count
  (`match_gpt2_to`, within 3%) at that depth.
The outputs name the baseline used: column titles, `baseline_*` JSON keys and a `baseline` field.

Segment lengths. An untrained router's q_t sits near 1/2, so thresholding at 0.5 closes almost every
byte or almost none, and training samples a boundary at nearly every other byte. The benchmark sets the
router as a trained one would be, confident and at the prior's rate `--rate` (default 0.2, the config's
default prior mean: one boundary per 5 bytes; the paper's fastest model has p = 0.4): on the text the
decode part writes (`<BoS>`, prompt and continuation of the held-out `--language` text, below) it
rescales the router's output so that p̂ has a standard deviation of 8 there and shifts it so that a
`--rate` share of those bytes has q_t >= 0.5 (the default `boundary_threshold`, unchanged). Inference
then closes that share of segments in the timed decode, and training, which samples a boundary with
probability q_t (LSLM eq. 2), about as many. A random router's decisions depend on the text, so the
rate on other text (16 rows of the train split) is printed beside it, and the realised rates of each
decode and of training are printed too.

1. decode: `model.generate` with the cache, greedy, batch 1, `--new-bytes` new bytes after a
   `--prompt-bytes`-byte prompt (`<BoS>` + held-out `--language` text), timed whole (prefill included),
   one warm-up call per model, then `--repeats` rounds that run every model in turn; medians. "text": a
   logits processor forces each new byte to be the held-out text's next byte (argmax over a one-hot row),
   so both models write the same natural bytes and the router sees the kind of text it was set on.
   "free": plain greedy with the five special ids suppressed in both models (the untrained decoder's
   own bytes; its realised boundary rate is printed beside it). Ratio = LSLM per-byte time / the
   baseline's; the target is <= 1.0x (the paper, Table 6: 165-212 ms against GPT-2's 212 ms on a V100).
2. train: forward + backward of the ELBO (LSLM, training mode: sampled boundaries) and of the LM loss
   (baseline) on the same `--train-batch` x `--train-context` crops of the `--language` train text; bytes
   per second, ratio LSLM / baseline (above 1: the LSLM trains faster).
3. profile (`--parts profile`): a manual cached decode loop over the forced text, the LSLM's step split
   by timing wrappers around its parts (token encoder step, router, open-segment push, segment close,
   decoder step, LM head) and the aten ops per step counted with torch.profiler, against the baseline's
   step.

Absolute milliseconds are printed for information only: the figures are the ratios, measured in the
same run. `--quick` runs tiny models once (a smoke run).

    python benchmarks/bench_lslm.py [--layers 2,4,2] [--width 256] [--token-width 128] [--decoder-width 128]
        [--baseline byte|gpt2] [--baseline-layers N] [--rate 0.2] [--prompt-bytes 64] [--new-bytes 256]
        [--repeats 5] [--train-batch 8] [--train-context 256] [--language en] [--parts decode,train,profile]
        [--threads N] [--json PATH] [--seed 0] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from hf_concept.data import LANGUAGES, load_text
from hf_concept.evaluation import (
    byte_decoder_baseline,
    byte_gpt2_baseline,
    lslm_boundary_probabilities,
    lslm_config_for,
)
from hf_concept.modeling.configuration_lslm import LSLMConfig
from hf_concept.modeling.lslm_segment_cache import SegmentCache
from hf_concept.modeling.modeling_lslm import LSLMForCausalLM
from hf_concept.modeling.tokenization_lslm import BYTE_OFFSET, PAD_ID, SEQUENCE_START_ID
from hf_concept.modeling.transformers_compat import cache_kwarg, output_cache
from hf_concept.tables import format_table

POOLINGS = ("mean", "hops:3")
PARTS = ("decode", "train", "profile")
BASELINES = ("byte", "gpt2")
# The key of the baseline in the models and profile dicts; `--baseline` says which model it is.
BASELINE = "baseline"
TARGET_RATIO = 1.0
# Standard deviation of the set router's logits on the calibration text: most q_t end up near 0 or 1.
ROUTER_SPREAD = 8.0
OTHER_TEXT_ROWS = 16
HEAD_WIDTH = 32
SPECIAL_IDS = list(range(BYTE_OFFSET))
QUICK = dict(
    layers=(1, 1, 1), width=32, token_width=16, decoder_width=16, prompt_bytes=8, new_bytes=12, repeats=1,
    train_batch=2, train_context=32,
)  # fmt: skip


def _layer_split(text: str) -> tuple[int, int, int]:
    parts = text.split(",")
    if len(parts) != 3 or not all(part.strip().isdigit() and int(part) >= 1 for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r} must be three positive ints: token,segment,decoder")
    return tuple(int(part) for part in parts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=_layer_split, default=(2, 4, 2), help="token,segment,decoder")
    parser.add_argument("--width", type=int, default=256, help="segment-encoder width")
    parser.add_argument("--token-width", type=int, default=128)
    parser.add_argument("--decoder-width", type=int, default=128)
    parser.add_argument("--baseline", default="byte", choices=BASELINES, help="byte: the fair byte decoder")
    parser.add_argument(
        "--baseline-layers", "--gpt2-layers", type=int, default=None, help="default: the LSLM's total layers"
    )
    parser.add_argument("--rate", type=float, default=0.2, help="boundaries per byte the router is set to")
    parser.add_argument("--prompt-bytes", type=int, default=64)
    parser.add_argument("--new-bytes", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--train-batch", type=int, default=8)
    parser.add_argument("--train-context", type=int, default=256)
    parser.add_argument("--language", default="en", choices=LANGUAGES, help="held-out text for decoding")
    parser.add_argument("--parts", default="decode,train", help=f"comma-separated subset of {PARTS}")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny models, one round (smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    args.parts = args.parts.split(",")
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts has {unknown}; choose from {PARTS}")
    if not 0 < args.rate < 1:
        parser.error(f"--rate={args.rate} must be in (0, 1)")
    for name in ("prompt_bytes", "new_bytes", "repeats", "train_batch", "train_context", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    return args


# ---------------------------------------------------------------------------------------------- models


def lslm_config(args: argparse.Namespace, pooling: str) -> LSLMConfig:
    return lslm_config_for(
        tuple(args.layers),
        (args.token_width, args.width, args.decoder_width),
        HEAD_WIDTH,
        max_position_embeddings=max(args.train_context, args.prompt_bytes + args.new_bytes + 1),
        pooling=pooling,
        prior_mean=args.rate,
        # `calibrate_router` makes the random router confident at a rate of q >= ½: a threshold's setting.
        boundary_rule="threshold",
    )


def baseline_model(args: argparse.Namespace, lslm: LSLMForCausalLM) -> torch.nn.Module:
    """The `--baseline` byte model at depth `--baseline-layers` (default the LSLM's total), sdpa."""
    torch.manual_seed(args.seed)
    positions = lslm.config.max_position_embeddings
    depth = args.baseline_layers or sum(args.layers)
    if args.baseline == "byte":
        model = byte_decoder_baseline(depth, args.width, head_dim=HEAD_WIDTH, n_positions=positions)
    else:
        model = byte_gpt2_baseline(lslm.num_parameters(), n_layer=depth, n_positions=positions)
    model.config._attn_implementation = "sdpa"
    return model


def build_models(args: argparse.Namespace) -> dict[str, torch.nn.Module]:
    """ "lslm-mean", "lslm-hops:3" (same weights) and `BASELINE` (the `--baseline` model), in eval mode."""
    models = {}
    for pooling in POOLINGS:
        torch.manual_seed(args.seed)
        models[f"lslm-{pooling}"] = LSLMForCausalLM(lslm_config(args, pooling)).eval()
    models[BASELINE] = baseline_model(args, models[f"lslm-{POOLINGS[0]}"]).eval()
    for model in models.values():
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = PAD_ID
    return models


def text_ids(text: str) -> torch.Tensor:
    return torch.tensor([BYTE_OFFSET + byte for byte in text.encode("utf-8")])


def decode_row(args: argparse.Namespace) -> torch.Tensor:
    """(1, 1 + prompt + new): `<BoS>`, the prompt and the forced continuation, the text the decode writes."""
    prompt, continuation = decode_inputs(args)
    return torch.cat([prompt, continuation[None]], dim=1)


def router_logits(model: LSLMForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """The router's p̂_t = logit(q_t) of every byte of plain rows, `<BoS>` excluded, flattened (float64)."""
    probs = lslm_boundary_probabilities(model, input_ids)[input_ids >= BYTE_OFFSET]
    return torch.logit(probs.double())


def untrained_routers(models: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each LSLM's router output weight and bias as built, so that every setting starts from them."""
    return {
        name: (
            model.model.router.fc_out.weight.detach().clone(),
            model.model.router.fc_out.bias.detach().clone(),
        )
        for name, model in models.items()
        if name != BASELINE
    }


def set_routers(
    models: dict, rows: torch.Tensor, args: argparse.Namespace, text: str, untrained: dict
) -> dict:
    """Set every LSLM's router (from its `untrained` state) to `--rate` on `rows` (`calibrate_router`);
    print and return the settings with the eval-mode boundary rate on other text."""
    settings = {}
    for name, model in models.items():
        if name == BASELINE:
            continue
        setting = calibrate_router(model, rows, args.rate, untrained[name])
        setting["other_text_rate"] = other_text_rate(model, args)
        settings[name] = setting
        print(
            f"router of {name} set to rate {args.rate} on {text}: p̂ x {setting['scale']:.1f}, shifted; "
            f"there q >= {setting['threshold']} at {setting['rate']:.3f} of bytes (mean q "
            f"{setting['mean_q']:.3f}); boundary rate on other text {setting['other_text_rate']:.3f}"
        )
    return settings


def calibrate_router(
    model: LSLMForCausalLM, rows: torch.Tensor, rate: float, untrained: tuple | None = None
) -> dict[str, float]:
    """Make the router confident at `rate`: p̂ becomes scale · (p̂ - c), with c the (1 - rate) quantile of
    p̂ on `rows` and the scale giving p̂ a standard deviation of `ROUTER_SPREAD` there. Starts from the
    `untrained` (weight, bias) of the router's output layer when given (a set router's q saturates)."""
    fc_out = model.model.router.fc_out
    if untrained is not None:
        with torch.no_grad():
            fc_out.weight.copy_(untrained[0])
            fc_out.bias.copy_(untrained[1])
    logits = router_logits(model, rows)
    scale = ROUTER_SPREAD / logits.std().item()
    cut = torch.quantile(logits, 1 - rate).item()
    with torch.no_grad():
        # p̂ is the sum of fc_out's outputs: scaling its weight and bias scales p̂, and subtracting
        # scale · c / width from each output's bias subtracts scale · c from p̂.
        fc_out.weight *= scale
        fc_out.bias *= scale
        fc_out.bias -= scale * cut / fc_out.bias.numel()
    probs = lslm_boundary_probabilities(model, rows)[rows >= BYTE_OFFSET].double()
    threshold = model.config.boundary_threshold
    return dict(
        scale=scale,
        threshold=threshold,
        mean_q=probs.mean().item(),
        rate=(probs >= threshold).double().mean().item(),
    )


# ------------------------------------------------------------------------------------------- measuring


class FollowText(LogitsProcessor):
    """Greedy decoding that writes a given continuation: every score row becomes one-hot at its next id."""

    def __init__(self, continuation: torch.Tensor, prompt_length: int) -> None:
        self.continuation = continuation
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        target = self.continuation[input_ids.shape[1] - self.prompt_length]
        forced = torch.full_like(scores, -math.inf)
        forced[:, target] = 0.0
        return forced


def generate_call(
    model: torch.nn.Module, prompt: torch.Tensor, new_bytes: int, continuation: torch.Tensor | None
) -> Callable[[], tuple[float, torch.Tensor]]:
    """A call that runs one cached greedy `generate` and returns (seconds, sequences)."""
    if continuation is None:
        extra = dict(suppress_tokens=SPECIAL_IDS)
    else:
        extra = dict(logits_processor=LogitsProcessorList([FollowText(continuation, prompt.shape[1])]))

    def run() -> tuple[float, torch.Tensor]:
        start = time.perf_counter()
        sequences = model.generate(
            prompt, max_new_tokens=new_bytes, min_new_tokens=new_bytes, do_sample=False, use_cache=True,
            **extra,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        if sequences.shape[1] != prompt.shape[1] + new_bytes:
            raise RuntimeError(
                f"generate wrote {sequences.shape[1] - prompt.shape[1]} bytes, not {new_bytes}"
            )
        return seconds, sequences

    return run


def interleaved_medians(calls: dict[str, Callable[[], float]], repeats: int, label: str) -> dict[str, float]:
    """One warm-up call each, then `repeats` rounds running every call in turn; median seconds."""
    for call in calls.values():
        call()
    seconds = defaultdict(list)
    for repeat in range(repeats):
        for key, call in calls.items():
            seconds[key].append(call())
        print(f"  {label}: round {repeat + 1}/{repeats} done", flush=True)
    return {key: statistics.median(values) for key, values in seconds.items()}


@torch.no_grad()
def realised_rate(model: LSLMForCausalLM, sequences: torch.Tensor, first: int) -> float:
    """Segments opened per byte among columns `first`.. of `sequences` (a full recomputation)."""
    boundaries = model(input_ids=sequences).boundaries[0, first:]
    return boundaries.float().mean().item()


@torch.no_grad()
def other_text_rate(model: LSLMForCausalLM, args: argparse.Namespace) -> float:
    """Eval-mode boundary rate (segments opened per byte) on other text of the same length: rows of the
    `--language` train split, each after a `<BoS>`."""
    width = args.prompt_bytes + args.new_bytes
    ids = text_ids(load_text(args.language))
    count = min(OTHER_TEXT_ROWS, len(ids) // width)
    rows = torch.cat([torch.full((count, 1), SEQUENCE_START_ID), ids[: count * width].view(count, width)], 1)
    return model(input_ids=rows).boundaries[:, 2:].float().mean().item()


# ------------------------------------------------------------------------------------------------ parts


def decode_inputs(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, 1 + prompt) prompt ids and (new,) forced continuation ids from the held-out text."""
    ids = text_ids(load_text(args.language, "heldout"))
    if len(ids) < args.prompt_bytes + args.new_bytes:
        raise ValueError(f"--prompt-bytes + --new-bytes exceed the {len(ids)} held-out {args.language} bytes")
    prompt = torch.cat([torch.tensor([SEQUENCE_START_ID]), ids[: args.prompt_bytes]])[None]
    return prompt, ids[args.prompt_bytes : args.prompt_bytes + args.new_bytes]


def bench_decode(models: dict, args: argparse.Namespace) -> list[dict]:
    prompt, continuation = decode_inputs(args)
    rows = []
    for mode, forced in (("text", continuation), ("free", None)):
        runs = {name: generate_call(model, prompt, args.new_bytes, forced) for name, model in models.items()}
        sequences = {name: run()[1] for name, run in runs.items()}
        calls = {name: (lambda run=run: run()[0]) for name, run in runs.items()}
        with torch.inference_mode():
            seconds = interleaved_medians(calls, args.repeats, f"decode ({mode})")
        for name in models:
            if name == BASELINE:
                continue
            rate = realised_rate(models[name], sequences[name], prompt.shape[1])
            rows.append(
                dict(
                    mode=mode,
                    model=name,
                    ms_per_byte=seconds[name] / args.new_bytes * 1e3,
                    baseline=args.baseline,
                    baseline_ms_per_byte=seconds[BASELINE] / args.new_bytes * 1e3,
                    ratio=seconds[name] / seconds[BASELINE],
                    boundary_rate=rate,
                )
            )
    return rows


def training_call(model: torch.nn.Module, batch: torch.Tensor, rates: list[float]) -> Callable[[], float]:
    """A call that runs forward + backward of the model's loss on `batch` and returns its seconds."""

    def step() -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        output = model(input_ids=batch, labels=batch)
        output.loss.backward()
        seconds = time.perf_counter() - start
        if getattr(output, "boundary_rate", None) is not None:
            rates.append(output.boundary_rate.item())
        return seconds

    return step


def training_batch(args: argparse.Namespace) -> torch.Tensor:
    """(`--train-batch`, `--train-context`) seeded random crops of `<BoS>` + the `--language` train text."""
    ids = torch.cat([torch.tensor([SEQUENCE_START_ID]), text_ids(load_text(args.language))])
    generator = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, len(ids) - args.train_context + 1, (args.train_batch,), generator=generator)
    return torch.stack([ids[start : start + args.train_context] for start in starts.tolist()])


def bench_train(models: dict, batch: torch.Tensor, args: argparse.Namespace) -> list[dict]:
    rates = {name: [] for name in models}
    calls = {name: training_call(model.train(), batch, rates[name]) for name, model in models.items()}
    torch.manual_seed(args.seed)
    seconds = interleaved_medians(
        calls, args.repeats, f"training B={args.train_batch} T={args.train_context}"
    )
    for model in models.values():
        model.eval()
    processed = batch.numel()
    return [
        dict(
            model=name,
            bytes_per_s=processed / seconds[name],
            baseline=args.baseline,
            baseline_bytes_per_s=processed / seconds[BASELINE],
            ratio=seconds[BASELINE] / seconds[name],
            boundary_rate=statistics.mean(rates[name]),
        )
        for name in models
        if name != BASELINE
    ]


class PartTimers:
    """Timing wrappers installed on attributes (instance methods, module forwards, class methods) and
    removed by `restore`; `seconds` and `calls` accumulate per label while `active`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.active = False
        self._installed: list[tuple[object, str, object, bool]] = []

    def wrap(self, owner: object, name: str, label: str) -> None:
        original = getattr(owner, name)
        own_attribute = name in vars(owner)

        def timed(*args, **kwargs):
            if not self.active:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1

        self._installed.append((owner, name, vars(owner).get(name), own_attribute))
        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, previous, own_attribute in reversed(self._installed):
            if own_attribute:
                setattr(owner, name, previous)
            else:
                delattr(owner, name)
        self._installed = []


def cached_loop(
    model: torch.nn.Module, prompt: torch.Tensor, continuation: torch.Tensor, timers: PartTimers | None = None
) -> float:
    """Prefill, then one cached forward per continuation byte; returns the seconds of the steps."""
    output = model(input_ids=prompt, use_cache=True)
    cache = output_cache(output)
    if timers is not None:
        timers.active = True
    start = time.perf_counter()
    for token in continuation:
        output = model(input_ids=token.view(1, 1), **cache_kwarg(cache), use_cache=True)
        output.logits.argmax(dim=-1)
    seconds = time.perf_counter() - start
    if timers is not None:
        timers.active = False
    return seconds


def lslm_timers(model: LSLMForCausalLM) -> PartTimers:
    timers = PartTimers()
    backbone = model.model
    timers.wrap(backbone, "step", "step (all)")
    timers.wrap(backbone, "token_step", "token encoder step")
    timers.wrap(backbone.router, "forward", "router")
    timers.wrap(SegmentCache, "push_open_states", "push open states")
    timers.wrap(backbone, "close_segments", "close segments")
    timers.wrap(backbone, "decoder_pass", "decoder step")
    timers.wrap(model.lm_head, "forward", "lm head")
    return timers


def aten_ops_per_step(model: torch.nn.Module, prompt: torch.Tensor, continuation: torch.Tensor) -> float:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        cached_loop(model, prompt, continuation)
    steps_and_prefill = len(continuation) + 1
    return sum(event.count for event in profile.key_averages() if event.key.startswith("aten::")) / (
        steps_and_prefill
    )


STEP_PARTS = ("token encoder step", "router", "push open states", "close segments", "decoder step")


def lslm_step_profile(model: LSLMForCausalLM, prompt: torch.Tensor, continuation: torch.Tensor) -> dict:
    """Milliseconds per decode step of each timed part, what the step spends elsewhere ("rest of step":
    masks, cache bookkeeping), the LM head and the forward outside the step; segment closes per step."""
    steps = len(continuation)
    cached_loop(model, prompt, continuation)
    timers = lslm_timers(model)
    try:
        total = cached_loop(model, prompt, continuation, timers)
    finally:
        timers.restore()
    per_step = {label: seconds / steps * 1e3 for label, seconds in timers.seconds.items()}
    parts = {label: per_step.get(label, 0.0) for label in STEP_PARTS}
    parts["rest of step"] = per_step["step (all)"] - sum(parts.values())
    parts["lm head"] = per_step["lm head"]
    parts["forward outside the step"] = total / steps * 1e3 - per_step["step (all)"] - per_step["lm head"]
    closes = timers.calls["close segments"]
    return dict(
        step_ms=total / steps * 1e3,
        parts=parts,
        closes_per_step=closes / steps,
        ms_per_close=timers.seconds["close segments"] / max(closes, 1) * 1e3,
        aten_ops=aten_ops_per_step(model, prompt, continuation),
    )


@torch.inference_mode()
def bench_profile(models: dict, args: argparse.Namespace) -> dict:
    """Per-step milliseconds of each LSLM part and aten ops per step; the baseline's step timed just before
    and just after each LSLM's (their mean is the LSLM's reference: load changes between loops)."""
    prompt, continuation = decode_inputs(args)
    baseline = models[BASELINE]
    steps = len(continuation)
    cached_loop(baseline, prompt, continuation)
    figures = {
        BASELINE: dict(
            name=args.baseline,
            aten_ops=aten_ops_per_step(baseline, prompt, continuation),
            n_layer=baseline.config.num_hidden_layers,
        )
    }
    for name, model in models.items():
        if name == BASELINE:
            continue
        before = cached_loop(baseline, prompt, continuation)
        figures[name] = lslm_step_profile(model, prompt, continuation)
        after = cached_loop(baseline, prompt, continuation)
        figures[name]["baseline_step_ms"] = (before + after) / 2 / steps * 1e3
    return figures


# -------------------------------------------------------------------------------------------- printing


def print_setup(models: dict, args: argparse.Namespace) -> None:
    baseline, lslm = models[BASELINE], models[f"lslm-{POOLINGS[0]}"]
    config, shape = lslm.config, baseline.config
    print(
        f"LSLM: layers token/segment/decoder {args.layers}, widths {config.token_hidden_size}/"
        f"{config.hidden_size}/{config.decoder_hidden_size}, {lslm.num_parameters()} parameters; "
        f"baseline {args.baseline} ({type(baseline).__name__}): layers={shape.num_hidden_layers} "
        f"width={shape.hidden_size} heads={shape.num_attention_heads}, {baseline.num_parameters()} "
        f"parameters; fp32 sdpa, threads={torch.get_num_threads()}, torch={torch.__version__}, "
        f"load average {_load()}"
    )


def print_decode(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\n[decode: greedy generate with the cache, batch 1, {args.new_bytes} new bytes after "
        f"{args.prompt_bytes} prompt bytes ({args.language}); per-byte time, median of {args.repeats}; "
        f"baseline {args.baseline}]"
    )
    name = args.baseline
    cells = []
    for row in rows:
        verdict = "met" if row["ratio"] <= TARGET_RATIO else "NOT met"
        figures = [f"{row['ms_per_byte']:.2f}", f"{row['baseline_ms_per_byte']:.2f}", f"{row['ratio']:.2f}"]
        cells.append(
            [
                row["mode"],
                row["model"],
                *figures,
                f"{row['boundary_rate']:.3f}",
                f"<= {TARGET_RATIO}x: {verdict}",
            ]
        )
    headers = ("mode", "model", "ms/byte", f"{name} ms", f"x {name}", "rate", "target")
    widths = (5, 12, 8, 8, 7, 6, None)
    seps = (" ", " ", " ", " ", " ", "  ")
    print(format_table(headers, cells, align="<<>>>><", widths=widths, sep=seps))


def print_train(rows: list[dict], args: argparse.Namespace) -> None:
    name = args.baseline
    print(
        f"\n[training: forward + backward, batch {args.train_batch} x {args.train_context} bytes; "
        f"bytes/s, ratio LSLM / {name} (above 1: faster)]"
    )
    formats = (
        ("bytes_per_s", ".0f"),
        ("baseline_bytes_per_s", ".0f"),
        ("ratio", ".2f"),
        ("boundary_rate", ".3f"),
    )
    cells = [[row["model"], *(format(row[key], spec) for key, spec in formats)] for row in rows]
    headers = ("model", "bytes/s", f"{name} B/s", f"x {name}", "rate")
    print(format_table(headers, cells, align="<>", widths=(12, 9, 9, 7, 6), sep=" "))


def print_profile(figures: dict) -> None:
    baseline = figures[BASELINE]
    name = baseline["name"]
    print(
        "\n[profile: cached decode loop over the forced text, ms per step (timing wrappers) and aten ops "
        f"per step; baseline {name} ({baseline['n_layer']} layers) timed before and after each LSLM, "
        f"{baseline['aten_ops']:.0f} aten ops per step]"
    )
    for model, entry in figures.items():
        if model == BASELINE:
            continue
        reference = entry["baseline_step_ms"]
        print(
            f"{model}: step {entry['step_ms']:.2f} ms, {name} {reference:.2f} ms = "
            f"{reference / baseline['n_layer']:.2f} ms per layer ({entry['step_ms'] / reference:.2f}x); "
            f"{entry['aten_ops']:.0f} aten ops; {entry['closes_per_step']:.3f} segment closes per step at "
            f"{entry['ms_per_close']:.2f} ms each"
        )
        for label, value in entry["parts"].items():
            print(f"  {label:<26} {value:>8.3f} ms  {value / entry['step_ms']:>6.1%}")


# ------------------------------------------------------------------------------------------------ main


def _load() -> str:
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    models = build_models(args)
    untrained = untrained_routers(models)
    print_setup(models, args)
    if os.getloadavg()[0] > 0.5 * len(os.sched_getaffinity(0)):
        # On a 2-core VM another busy process slows each threaded kernel many times over, unevenly.
        print("WARNING: the machine is busy (load above); timings and ratios of this run are unreliable")
    figures = {"routers": {}}
    if "decode" in args.parts:
        figures["routers"]["decode"] = set_routers(
            models, decode_row(args), args, "the decode text", untrained
        )
        figures["decode"] = bench_decode(models, args)
        print_decode(figures["decode"], args)
    if "train" in args.parts:
        batch = training_batch(args)
        figures["routers"]["train"] = set_routers(models, batch, args, "the training batch", untrained)
        figures["train"] = bench_train(models, batch, args)
        print_train(figures["train"], args)
    if "profile" in args.parts:
        figures["routers"]["profile"] = set_routers(
            models, decode_row(args), args, "the decode text", untrained
        )
        figures["profile"] = bench_profile(models, args)
        print_profile(figures["profile"])
    print(f"\nload average at the end {_load()} (1, 5, 15 min; {len(os.sched_getaffinity(0))} cores)")
    if args.json is not None:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=1)
    return figures


if __name__ == "__main__":
    main()
