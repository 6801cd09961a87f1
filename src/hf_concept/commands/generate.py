"""`hf-concept generate CHECKPOINT "prompt"`: generate from a checkpoint folder, streaming the new text.

The checkpoint loads as any user would load it (`AutoModelForCausalLM` / `AutoTokenizer` with
`trust_remote_code=True`), and `generate()` picks the family's own cache (ConceptCache, StreamCache, or
transformers' DynamicCache for the plain family). New text goes to stdout as it is produced
(transformers' `TextStreamer`, prompt skipped); a one-line summary — new tokens, tokens per second, cache
size — goes to stderr, so `hf-concept generate ... > out.txt` keeps only the text. Beam search cannot
stream (transformers refuses a streamer with beams), so with `--num-beams > 1` the text is printed at
the end. User errors print one line and exit 2 before the model loads: a missing folder or tokenizer, bad
flag values, a `--device` torch cannot use here (cuda on a CPU-only build), a prompt that is not UTF-8,
and a tokenizer that does not belong to the checkpoint (`checks.check_tokenizer`: vocabulary size, special
ids, the tokenizer class the checkpoint names; `--skip-tokenizer-check` runs anyway).

`load_checkpoint` and `add_loading_flags` are shared with `hf-concept segment`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from hf_concept.commands import checks

DTYPES = ("auto", "float32", "bfloat16", "float16")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


def add_loading_flags(parser: argparse.ArgumentParser) -> None:
    """--tokenizer, --device, --dtype: how CHECKPOINT is loaded (generate and segment)."""
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="Tokenizer folder, when the checkpoint has none (default: the checkpoint folder).",
    )
    parser.add_argument(
        "--device", default=None, help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda if available)."
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="Weights dtype (default: the checkpoint's)."
    )
    parser.add_argument(
        "--skip-tokenizer-check",
        action="store_true",
        help="Run even when the tokenizer does not match the checkpoint (vocabulary size, special ids, "
        "tokenizer class), which is refused by default because the output would be garbage.",
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="Generate text from a checkpoint, streaming tokens to stdout.",
        description="Load CHECKPOINT with trust_remote_code=True and continue PROMPT; the family's cache "
        "is used. The text streams to stdout, a summary (tokens/s, cache bytes) goes to stderr.",
    )
    parser.add_argument("checkpoint", type=Path, help="Checkpoint folder (config, weights, tokenizer).")
    parser.add_argument("prompt", help="Text to continue.")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=64, help="Default 64.")
    parser.add_argument("--do-sample", action="store_true", help="Sample instead of greedy decoding.")
    parser.add_argument("--temperature", type=float, default=None, help="Sampling temperature.")
    parser.add_argument("--top-p", type=float, default=None, help="Nucleus sampling probability mass.")
    parser.add_argument("--top-k", type=int, default=None, help="Sample among the K likeliest tokens.")
    parser.add_argument("--num-beams", type=_positive_int, default=1, help="Beam search (no streaming).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the sampler (default 0).")
    parser.add_argument("--no-stream", action="store_true", help="Print the text once, at the end.")
    add_loading_flags(parser)


def run(args: argparse.Namespace) -> int:
    try:
        return _generate(args)
    except (ValueError, OSError, ImportError) as error:
        print(f"hf-concept generate: error: {error}", file=sys.stderr)
        return 2


def read_model_type(checkpoint: Path) -> str:
    """`model_type` from CHECKPOINT/config.json; a missing folder or config is a clear error."""
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"checkpoint {str(checkpoint)!r} is not a folder")
    config_path = checkpoint / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{str(config_path)!r} is missing: CHECKPOINT must be a saved model folder")
    try:
        return str(json.loads(config_path.read_text(encoding="utf-8")).get("model_type", ""))
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(config_path)!r} is not valid JSON ({error})") from None


def load_checkpoint(
    checkpoint: Path,
    tokenizer_path: str | None = None,
    device: str | None = None,
    dtype: str = "auto",
    check_tokenizer: bool = True,
) -> tuple[Any, Any]:
    """(model in eval mode on `device`, tokenizer), both loaded with `trust_remote_code=True`. The device
    and (unless `check_tokenizer=False`) the tokenizer are checked against the checkpoint first."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    read_model_type(checkpoint)
    source = tokenizer_path if tokenizer_path is not None else str(checkpoint)
    if Path(source).is_dir() and not checks.has_tokenizer(Path(source)):
        where = f"checkpoint {str(checkpoint)!r}" if tokenizer_path is None else f"--tokenizer {source!r}"
        hint = "; pass --tokenizer PATH (a folder with a saved tokenizer)" if tokenizer_path is None else ""
        files = ", ".join(checks.TOKENIZER_FILES)
        raise FileNotFoundError(f"{where} has no tokenizer (none of {files}){hint}")
    device_obj = checks.resolve_device(device)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=True)
    config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=True)
    if check_tokenizer:
        checks.check_tokenizer(checkpoint, tokenizer, config, tokenizer_path)
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint,
        config=config,
        trust_remote_code=True,
        dtype=dtype if dtype == "auto" else getattr(torch, dtype),
    )
    return model.to(device_obj).eval(), tokenizer


def encode_prompt(tokenizer: Any, prompt: str, vocab_size: int) -> dict[str, Any]:
    """(1, L) input_ids and attention_mask of `prompt`. A tokenizer with `encode_prompt` (LSLM's bytes)
    knows its own generation prompt (no end-of-sequence marker)."""
    if hasattr(tokenizer, "encode_prompt"):
        encoded = tokenizer.encode_prompt(prompt, return_tensors="pt")
    else:
        encoded = tokenizer(prompt, return_tensors="pt")
    input_ids = encoded["input_ids"]
    if input_ids.shape[1] == 0:
        raise ValueError(f"prompt={prompt!r} gives no tokens; give some text to continue")
    largest = int(input_ids.max())
    if largest >= vocab_size:
        raise ValueError(
            f"the tokenizer gives id {largest}, but the model's vocab_size is {vocab_size}: the tokenizer "
            "does not belong to this checkpoint (see --tokenizer)"
        )
    attention_mask = encoded.get("attention_mask")
    if attention_mask is None:
        attention_mask = input_ids.new_ones(input_ids.shape)
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def generation_kwargs(args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    """The keyword arguments of `generate()` that the flags set (unset sampling flags keep the
    checkpoint's generation_config)."""
    kwargs: dict[str, Any] = dict(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        num_beams=args.num_beams,
        return_dict_in_generate=True,
    )
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(args, name)
        if value is not None:
            kwargs[name] = value
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_token_id is not None:
        kwargs["pad_token_id"] = pad_token_id
    return kwargs


def _generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import TextStreamer, set_seed

    from hf_concept.modeling.transformers_compat import output_cache

    checks.require_utf8(args.prompt, "PROMPT")
    model, tokenizer = load_checkpoint(
        args.checkpoint, args.tokenizer, args.device, args.dtype, not args.skip_tokenizer_check
    )
    inputs = encode_prompt(tokenizer, args.prompt, model.config.vocab_size)
    inputs = {name: tensor.to(model.device) for name, tensor in inputs.items()}
    stream = not args.no_stream and args.num_beams == 1
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    set_seed(args.seed)
    started = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(**inputs, streamer=streamer, **generation_kwargs(args, tokenizer))
    elapsed = time.perf_counter() - started
    new_ids = output.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    if not stream:
        print(tokenizer.decode(new_ids, skip_special_tokens=True))
    print(summary(new_ids, elapsed, output_cache(output), model.generation_config), file=sys.stderr)
    return 0


def summary(new_ids: list[int], elapsed: float, cache: Any, generation_config: Any) -> str:
    """'N new tokens in S s (R tokens/s, prefill included); cache: CLASS, B bytes'."""
    from hf_concept.modeling.forward_only_cache import cache_num_bytes

    eos = generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    # Tokens up to and including the first end-of-sequence (later ones are padding).
    count = next((index + 1 for index, token_id in enumerate(new_ids) if token_id in eos_ids), len(new_ids))
    line = f"hf-concept generate: {count} new tokens in {elapsed:.2f} s ({count / max(elapsed, 1e-9):.1f} "
    line += "tokens/s, prefill included)"
    if cache is not None:
        try:
            line += f"; cache: {type(cache).__name__}, {cache_num_bytes(cache):,} bytes"
        except ValueError:
            line += f"; cache: {type(cache).__name__}"
    return line
