"""Checks that `hf-concept generate` and `hf-concept segment` make before a model runs: each problem is a
ValueError of one line naming the flag or file, the problem and what to do.

- `tokenizer_mismatches`: a tokenizer whose ids happen to fit the embedding still gives garbage when it
  is another model's. Compared with the checkpoint: its size against the config's `vocab_size` (more
  tokens than rows is always wrong; with no tokenizer in the checkpoint, far fewer than the rows, beyond
  padding to a multiple of `VOCAB_PADDING`, is too), the special ids (`bos`, `eos`, `pad` and the
  family's own markers, e.g. LSLM's `segment_start` / `segment_end`) against the config's, and, for
  `--tokenizer`, the class and size of the tokenizer the checkpoint itself holds.
- `resolve_device`: a device torch cannot use here (cuda on a CPU-only build, a GPU index past the
  last one) is refused before the model loads, instead of torch's AssertionError on the first `.to()`.
- `require_utf8`: text from the command line that holds bytes that are not UTF-8 (Python keeps them as
  lone surrogates) is refused naming the byte, instead of the tokenizer's TypeError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# A checkpoint's vocab_size may exceed its tokenizer's size by padding (rows no id reaches, often up to
# a multiple of 64 or 128; Phi-2 pads 50,295 tokens to 51,200): up to the next multiple of this.
VOCAB_PADDING = 1024
# Special ids every tokenizer may define, compared with the config's when both are set.
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Family markers: when the config uses one, the tokenizer must define the same id.
MARKER_IDS = ("segment_start_token_id", "segment_end_token_id")
SKIP_FLAG = "--skip-tokenizer-check"
# Files whose presence means "a tokenizer was saved here" (fast, slow or remote-code tokenizers).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_tokenizer(checkpoint: Path, tokenizer: Any, config: Any, tokenizer_path: str | None) -> None:
    """Raise one ValueError line listing every mismatch between `tokenizer` and the checkpoint."""
    problems = tokenizer_mismatches(checkpoint, tokenizer, config, tokenizer_path)
    if not problems:
        return
    where = (
        f"--tokenizer {tokenizer_path!r}"
        if tokenizer_path is not None
        else f"the tokenizer saved in {str(checkpoint)!r}"
    )
    raise ValueError(
        f"{where} does not belong to checkpoint {str(checkpoint)!r}: {'; '.join(problems)}; pass the "
        f"checkpoint's own tokenizer with --tokenizer PATH, or {SKIP_FLAG} if you know they agree"
    )


def tokenizer_mismatches(
    checkpoint: Path, tokenizer: Any, config: Any, tokenizer_path: str | None = None
) -> list[str]:
    """Why `tokenizer` does not fit the checkpoint whose config is `config`; empty when nothing is found.
    `tokenizer_path` is the --tokenizer folder (None: the checkpoint's own tokenizer)."""
    vocab_size = getattr(config, "vocab_size", None)
    problems = [] if vocab_size is None else _vocab_mismatches(checkpoint, len(tokenizer), vocab_size)
    for name in SPECIAL_IDS:
        expected, found = getattr(config, name, None), getattr(tokenizer, name, None)
        allowed = expected if isinstance(expected, list | tuple) else [expected]
        if expected is not None and found is not None and found not in allowed:
            problems.append(f"its {name} is {found}, the config's is {expected}")
    for name in MARKER_IDS:
        expected, found = getattr(config, name, None), getattr(tokenizer, name, None)
        if expected is not None and found != expected:
            problems.append(
                f"the config's {name} is {expected}, the tokenizer's is {found}"
                if found is not None
                else f"the config uses {name}={expected}, which the tokenizer does not define"
            )
    if tokenizer_path is not None:
        problems += _own_tokenizer_mismatches(checkpoint, tokenizer)
    return problems


def _vocab_mismatches(checkpoint: Path, size: int, vocab_size: int) -> list[str]:
    if size > vocab_size:
        return [f"it has {size} tokens and the config's vocab_size is {vocab_size} (ids past it have no row)"]
    padded = -(-size // VOCAB_PADDING) * VOCAB_PADDING
    # With the checkpoint's own tokenizer present, its class and size are the stronger evidence; a model
    # may also keep unused rows on purpose (a config written for a larger tokenizer).
    if vocab_size > padded and not has_tokenizer(checkpoint):
        return [
            f"it has {size} tokens and the config's vocab_size is {vocab_size}, more than padding "
            f"to a multiple of {VOCAB_PADDING} explains"
        ]
    return []


def has_tokenizer(folder: Path) -> bool:
    """Whether a tokenizer was saved in `folder` (one of TOKENIZER_FILES is there)."""
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def _own_tokenizer_mismatches(checkpoint: Path, tokenizer: Any) -> list[str]:
    """The checkpoint's own tokenizer (its tokenizer_config.json class, its tokenizer.json size) against
    the --tokenizer one."""
    import json

    problems = []
    config_path = checkpoint / "tokenizer_config.json"
    if config_path.is_file():
        try:
            named = json.loads(config_path.read_text(encoding="utf-8")).get("tokenizer_class")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            named = None
        if isinstance(named, str) and _class_key(named) != _class_key(type(tokenizer).__name__):
            found = type(tokenizer).__name__
            problems.append(f"the checkpoint names tokenizer_class {named!r}, this one is a {found}")
    if (checkpoint / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            own_size = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).get_vocab_size(True)
        # A tokenizer.json that this tokenizers version cannot read tells nothing either way.
        except Exception:
            own_size = None
        if own_size is not None and own_size != len(tokenizer):
            problems.append(
                f"the checkpoint's own tokenizer.json has {own_size} tokens, this one {len(tokenizer)}"
            )
    return problems


def _class_key(name: str) -> str:
    """A tokenizer class name with transformers' aliases resolved (PreTrainedTokenizerFast is
    TokenizersBackend in transformers 5) and the Fast suffix dropped (slow and fast share a vocabulary)."""
    import transformers

    try:
        resolved = getattr(transformers, name, None)
    # transformers' lazy module may fail to import a class whose optional dependency is missing.
    except Exception:
        resolved = None
    name = getattr(resolved, "__name__", name)
    return name.removesuffix("Fast")


def resolve_device(device: str | None) -> Any:
    """The torch.device for --device (None: cuda when available, else cpu); ValueError when torch cannot
    use it here, before any model loads."""
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device_obj = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"--device={device!r} is not a torch device ({error})") from None
    if device_obj.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            reason = "this torch build has no CUDA support"
        elif not torch.cuda.is_available():
            reason = "no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)"
        elif device_obj.index is not None and device_obj.index >= torch.cuda.device_count():
            reason = f"only {torch.cuda.device_count()} CUDA device(s) are visible (cuda:0 ...)"
        else:
            return device_obj
        raise ValueError(f"--device={device!r}: {reason}; pass --device cpu, or leave --device out")
    if device_obj.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(
            f"--device={device!r}: MPS (Apple GPU) is not available in this torch build or on this "
            "machine; pass --device cpu, or leave --device out"
        )
    try:
        torch.empty(0, device=device_obj)
    except (RuntimeError, AssertionError) as error:
        # torch's dispatcher messages run to pages: their first sentence names the problem.
        first_line = (str(error).splitlines() or [type(error).__name__])[0].split(". ")[0][:200]
        raise ValueError(
            f"--device={device!r} cannot be used here ({first_line}); pass --device cpu, or leave "
            "--device out"
        ) from None
    return device_obj


def require_utf8(text: str, what: str) -> None:
    """ValueError when `text` holds a character with no UTF-8 encoding: a byte of another encoding that
    Python kept from the command line (U+DC80..U+DCFF), or any other lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code_point = ord(text[error.start])
        if 0xDC80 <= code_point <= 0xDCFF:
            byte = code_point - 0xDC00
            problem = f"holds the byte 0x{byte:02X}, which is not UTF-8, at character {error.start}"
            hint = "the text is in another encoding; convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        else:
            problem = f"holds the lone surrogate U+{code_point:04X} at character {error.start}"
            hint = "it has no UTF-8 encoding; remove it"
        raise ValueError(f"{what} {problem}: {hint}") from None
