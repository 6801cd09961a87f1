"""A byte-level BPE tokenizer trained on the bundled corpus (`hf_concept.data.corpus`) at first use.

`bundled_tokenizer()` trains it with `tokenizers` on the corpus's train split (a few seconds), wraps it
as a `PreTrainedTokenizerFast` with `<pad>`, `<s>` (bos) and `</s>` (eos), and saves it in Hugging Face
format to a cache folder named by a hash of the corpus and the settings; later calls load that folder.
The folder is written under a temporary name and renamed when complete, so an interrupted run never
leaves a half-written tokenizer that a later call would load.

Byte-level means every UTF-8 string encodes and decodes back to itself exactly (no unknown token), which
is what code, Chinese and Japanese need. Encoding adds `<s>` in front (`add_special_tokens=True`, the
default), as a model trained with it expects when it generates from a prompt.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from hf_concept.staging import staged

VOCAB_SIZE = 3072
MIN_FREQUENCY = 2
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
# Ids 0, 1, 2 in this order: tiny model configs can rely on them.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
MODEL_MAX_LENGTH = 4096
CACHE_ENV = "HF_CONCEPT_CACHE"


def default_cache_dir() -> Path:
    """`$HF_CONCEPT_CACHE`, else `$XDG_CACHE_HOME/hf_concept`, else `~/.cache/hf_concept`."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hf_concept"


def tokenizer_settings(vocab_size: int = VOCAB_SIZE) -> dict:
    """Everything that changes the trained tokenizer besides the corpus (part of the cache key)."""
    import tokenizers

    return {
        "kind": "byte-level-bpe",
        "vocab_size": vocab_size,
        "min_frequency": MIN_FREQUENCY,
        "special_tokens": list(SPECIAL_TOKENS),
        "model_max_length": MODEL_MAX_LENGTH,
        "tokenizers_version": tokenizers.__version__,
    }


def tokenizer_folder_name(vocab_size: int = VOCAB_SIZE) -> str:
    """`tokenizer-<hash>`: the hash covers the train split's text and `tokenizer_settings`."""
    from hf_concept.data.corpus import corpus_fingerprint

    key = json.dumps({"corpus": corpus_fingerprint(), **tokenizer_settings(vocab_size)}, sort_keys=True)
    return f"tokenizer-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def train_bpe(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """A `tokenizers.Tokenizer`: byte-level BPE trained on `texts`, `<s>` prepended on encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if not (isinstance(vocab_size, int) and vocab_size > 256 + len(SPECIAL_TOKENS)):
        raise ValueError(f"vocab_size={vocab_size!r} must be an integer above 259 (256 bytes + specials)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=MIN_FREQUENCY,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte is in the vocabulary, so nothing is ever unknown.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return tokenizer


def wrap_tokenizer(tokenizer):
    """`tokenizer` (a `tokenizers.Tokenizer`) as a `PreTrainedTokenizerFast` with pad/bos/eos set."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
        # Decoding must give back the exact text (code keeps " ." and " ,").
        clean_up_tokenization_spaces=False,
    )


def _save_atomically(tokenizer, folder: Path) -> None:
    """Save into a staging sibling, then rename it to `folder`; a concurrent writer's result is kept."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        with staged(folder, staging):
            tokenizer.save_pretrained(staging)
    except OSError:
        # Another process finished the same folder first (rename onto a non-empty folder fails).
        if not (folder / "tokenizer.json").is_file():
            raise


def bundled_tokenizer(cache_dir: str | Path | None = None):
    """The byte-level BPE tokenizer of the bundled corpus, as a `PreTrainedTokenizerFast`.

    Trained on `corpus_text("train")` the first time (seconds), saved in Hugging Face format to
    `cache_dir/tokenizer-<hash>` (default `default_cache_dir()`), and loaded from there afterwards.
    """
    from transformers import PreTrainedTokenizerFast

    from hf_concept.data.corpus import corpus_documents

    cache_dir = default_cache_dir() if cache_dir is None else Path(cache_dir)
    if cache_dir.exists() and not cache_dir.is_dir():
        raise ValueError(f"cache_dir={str(cache_dir)!r} exists and is not a folder")
    folder = cache_dir / tokenizer_folder_name()
    if not (folder / "tokenizer.json").is_file():
        texts = [text for _, text in corpus_documents("train")]
        _save_atomically(wrap_tokenizer(train_bpe(texts)), folder)
    return PreTrainedTokenizerFast.from_pretrained(str(folder))
