"""Bundled evaluation text (hf_concept.data), bits per byte (hf_concept.evaluation) and the eval script."""

from __future__ import annotations

import fnmatch
import json
import math
import subprocess
import sys
import tomllib
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_concept.data import LANGUAGES, heldout_offset, load_text
from hf_concept.evaluation import (
    bits_per_byte,
    byte_gpt2_baseline,
    gpt2_num_parameters,
    match_gpt2_to,
)
from hf_concept.modeling.tokenization_lslm import BYTE_OFFSET, SEQUENCE_START_ID, VOCAB_SIZE, ByteTokenizer

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "eval_bits_per_byte.py"
MIN_BYTES = {"en": 30_000, "zh": 20_000, "ja": 20_000}
MIXED_TEXT = "Tea at 4pm? 茶を飲みましょう。好的！ <nxt> ok\n"


@pytest.fixture(scope="module")
def tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


def token_ids(text: str) -> torch.Tensor:
    return torch.tensor([SEQUENCE_START_ID, *(BYTE_OFFSET + b for b in text.encode("utf-8"))])


def full_sequence_nats(model: nn.Module, text: str) -> float:
    """-log p of every byte given all bytes before it and <BoS>, in one forward pass."""
    ids = token_ids(text)
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0]
    return F.cross_entropy(logits[:-1].double(), ids[1:], reduction="sum").item()


class Bigram(nn.Module):
    """Logits depend on the current token only: any window that holds a byte's predecessor scores it alike."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.table = nn.Embedding(VOCAB_SIZE, VOCAB_SIZE)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> SimpleNamespace:
        return SimpleNamespace(logits=self.table(input_ids))


class Uniform(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> SimpleNamespace:
        return SimpleNamespace(logits=torch.zeros(*input_ids.shape, VOCAB_SIZE))


@pytest.fixture(scope="module")
def tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    return byte_gpt2_baseline(n_layer=2, n_embd=32, n_head=4, n_positions=128).eval()


@pytest.mark.parametrize("language", LANGUAGES)
def test_bundled_text_is_valid_sizeable_and_varied(language):
    raw = resources.files("hf_concept.data").joinpath(f"{language}.txt").read_bytes()
    text = raw.decode("utf-8")  # strict: raises on any invalid byte
    assert load_text(language, "all") == text
    assert len(raw) >= MIN_BYTES[language]
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) >= 60
    assert len(set(lines)) / len(lines) >= 0.98
    if language == "zh":
        assert sum("\u4e00" <= char <= "\u9fff" for char in text) > 0.7 * len(text)
    if language == "ja":
        assert sum("\u3040" <= char <= "\u30ff" for char in text) > 0.3 * len(text)  # kana
    if language == "en":
        assert sum(char.isascii() for char in text) > 0.99 * len(text)


@pytest.mark.parametrize("language", LANGUAGES)
def test_splits_are_disjoint_cover_the_file_and_cut_at_a_line(language):
    everything = load_text(language, "all").encode("utf-8")
    train = load_text(language, "train").encode("utf-8")
    heldout = load_text(language, "heldout").encode("utf-8")
    assert train + heldout == everything
    assert load_text(language) == load_text(language, "train")
    offset = heldout_offset(language)
    assert len(train) == offset and train.endswith(b"\n")
    # The documented rule: just after the first newline at or after 80% of the bytes.
    assert everything.index(b"\n", int(0.8 * len(everything))) + 1 == offset
    assert 0.15 < len(heldout) / len(everything) <= 0.2
    train_lines = {line for line in train.decode().splitlines() if line.strip()}
    assert not train_lines & {line for line in heldout.decode().splitlines() if line.strip()}


def test_unknown_language_or_split_names_the_value():
    with pytest.raises(ValueError, match="language='fr'"):
        load_text("fr")
    with pytest.raises(ValueError, match="split='test'"):
        load_text("en", "test")


def test_the_text_files_ship_as_package_data():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = patterns["hf_concept"]
    for name in [*(f"{language}.txt" for language in LANGUAGES), "README.md", "LICENSE.md"]:
        assert (ROOT / "src" / "hf_concept" / "data" / name).is_file()
        assert any(fnmatch.fnmatch(f"data/{name}", pattern) for pattern in shipped), name


def test_one_window_equals_full_sequence_cross_entropy(tiny_gpt2, tokenizer):
    num_bytes = len(MIXED_TEXT.encode("utf-8"))
    context = num_bytes + 1
    result = bits_per_byte(tiny_gpt2, tokenizer, MIXED_TEXT, context=context, stride=context - 1)
    assert result.num_bytes == num_bytes
    assert result.nats == pytest.approx(full_sequence_nats(tiny_gpt2, MIXED_TEXT), rel=1e-5)
    assert result.bits_per_byte == pytest.approx(result.nats / num_bytes / math.log(2))


@pytest.mark.parametrize(("context", "stride", "batch_size"), [(2, 1, 1), (5, 3, 2), (16, 15, 3), (9, 1, 64)])
def test_sliding_windows_count_every_byte_exactly_once(tokenizer, context, stride, batch_size):
    # Under a bigram model every window that scores a byte scores it the same, so the total equals the
    # full-sequence sum only if no byte is skipped or counted twice.
    model = Bigram()
    result = bits_per_byte(
        model, tokenizer, MIXED_TEXT, context=context, stride=stride, batch_size=batch_size
    )
    assert result.num_bytes == len(MIXED_TEXT.encode("utf-8"))
    assert result.nats == pytest.approx(full_sequence_nats(model, MIXED_TEXT), rel=1e-6)


def test_sliding_windows_give_each_byte_the_documented_context(tiny_gpt2, tokenizer):
    context, stride = 12, 5
    ids = token_ids(MIXED_TEXT)
    expected = 0.0
    with torch.no_grad():
        for target in range(1, len(ids)):
            # Window k scores targets [1 + k*stride, 1 + (k+1)*stride) and reads `context` tokens ending
            # at its last one.
            end = min(1 + ((target - 1) // stride + 1) * stride, len(ids))
            start = max(0, end - context)
            logits = tiny_gpt2(input_ids=ids[None, start:end]).logits[0, target - 1 - start]
            expected -= F.log_softmax(logits.double(), dim=-1)[ids[target]].item()
    result = bits_per_byte(tiny_gpt2, tokenizer, MIXED_TEXT, context=context, stride=stride, batch_size=3)
    assert result.nats == pytest.approx(expected, rel=1e-5)
    # The truncated context matters for a transformer: the full-context total is different.
    assert abs(result.nats - full_sequence_nats(tiny_gpt2, MIXED_TEXT)) > 1e-3


def test_uniform_model_scores_log2_of_the_vocabulary(tokenizer):
    text = load_text("ja", "heldout")[:300]
    result = bits_per_byte(Uniform(), tokenizer, text, context=64)
    # Only the bytes are counted: no <eos>, no <BoS>, so exactly log2(261) bits each.
    assert result.num_bytes == len(text.encode("utf-8"))
    assert result.nats == pytest.approx(result.num_bytes * math.log(VOCAB_SIZE), rel=1e-12)
    assert result.bits_per_byte == pytest.approx(math.log2(VOCAB_SIZE), rel=1e-12)


def test_training_flag_is_restored(tiny_gpt2, tokenizer):
    tiny_gpt2.train()
    bits_per_byte(tiny_gpt2, tokenizer, "abc", context=8)
    assert tiny_gpt2.training
    tiny_gpt2.eval()


def test_bad_arguments_raise_naming_the_field(tiny_gpt2, tokenizer):
    with pytest.raises(ValueError, match="text=''"):
        bits_per_byte(tiny_gpt2, tokenizer, "", context=8)
    with pytest.raises(ValueError, match="stride=8"):
        bits_per_byte(tiny_gpt2, tokenizer, "abc", context=8, stride=8)
    with pytest.raises(ValueError, match="context=1 "):
        bits_per_byte(tiny_gpt2, tokenizer, "abc", context=1)
    with pytest.raises(ValueError, match="context=129 exceeds the model's 128 positions"):
        bits_per_byte(tiny_gpt2, tokenizer, "abc", context=129)
    with pytest.raises(ValueError, match="batch_size=0"):
        bits_per_byte(tiny_gpt2, tokenizer, "abc", context=8, batch_size=0)

    def shifted(text, **kwargs):
        return {"input_ids": [byte for byte in text.encode("utf-8")]}

    with pytest.raises(ValueError, match="does not map byte b to id b \\+ 5"):
        bits_per_byte(tiny_gpt2, shifted, "abc", context=8)


@pytest.mark.parametrize("target", [150_000, 1_000_000, 5_000_000, 30_000_000, 120_000_000])
def test_match_gpt2_lands_within_tolerance(target):
    shape = match_gpt2_to(target, tolerance=0.03)
    assert abs(shape.num_parameters - target) <= 0.03 * target
    assert shape.n_embd % shape.n_head == 0 and shape.n_embd % 16 == 0
    assert shape.num_parameters == gpt2_num_parameters(shape.n_layer, shape.n_embd, 1024)


@pytest.mark.parametrize("target", [300_000, 2_000_000])
def test_baseline_has_the_matched_count_and_the_byte_ids(target):
    model = byte_gpt2_baseline(target, n_layer=3)
    assert model.config.n_layer == 3
    assert model.num_parameters() == match_gpt2_to(target, n_layer=3).num_parameters
    assert abs(model.num_parameters() - target) <= 0.03 * target
    config = model.config
    assert (config.vocab_size, config.pad_token_id, config.bos_token_id, config.eos_token_id) == (
        261,
        0,
        1,
        2,
    )


def test_parameter_formula_matches_transformers():
    for n_layer, n_embd, n_positions in [(1, 16, 32), (3, 48, 200)]:
        model = byte_gpt2_baseline(n_layer=n_layer, n_embd=n_embd, n_positions=n_positions)
        assert model.num_parameters() == gpt2_num_parameters(n_layer, n_embd, n_positions)


def test_unreachable_matches_and_conflicts_raise():
    with pytest.raises(ValueError, match="num_parameters=1000: no GPT-2 shape"):
        match_gpt2_to(1000)
    with pytest.raises(ValueError, match="num_parameters=0"):
        match_gpt2_to(0)
    with pytest.raises(ValueError, match="n_embd=64 conflicts"):
        byte_gpt2_baseline(1_000_000, n_embd=64)
    with pytest.raises(ValueError, match="n_head=5 must divide n_embd=64"):
        byte_gpt2_baseline(n_layer=1, n_embd=64, n_head=5)


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--threads", "1", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def table_row(printed: str, name: str) -> list[str]:
    return next(line.split() for line in printed.splitlines() if line.startswith(name + " "))


def test_script_quick_run_and_reloaded_checkpoint_agree(tmp_path):
    saved, report = tmp_path / "gpt2-byte", tmp_path / "report.json"
    first = run_script("--save", str(saved), "--json", str(report))
    assert first.returncode == 0, first.stderr[-2000:]
    assert "held-out bits per byte" in first.stdout
    row = table_row(first.stdout, "gpt2-byte")
    bits = [float(cell) for cell in row[-3:]]
    # A few steps from random initialisation: below uniform already, far from a trained model.
    assert all(4.0 < value < math.log2(VOCAB_SIZE) for value in bits)
    (result,) = json.loads(report.read_text())["results"]
    assert [result["bits_per_byte"][language] for language in LANGUAGES] == pytest.approx(bits, abs=5e-4)
    second = run_script("--no-baseline", "--model", str(saved))
    assert second.returncode == 0, second.stderr[-2000:]
    assert table_row(second.stdout, "gpt2-byte")[-3:] == row[-3:]


def lm_eval_rolling_nats(model: nn.Module, tokenizer, text: str, max_length: int) -> float:
    """-log p of `text` as lm-evaluation-harness's `loglikelihood_rolling` scores it, one block at a time.

    Its documented rule: encode the text with the tokenizer's default special tokens, predict every
    token, the first from a prefix token (bos, else eos); the first block predicts tokens 0..L-1 from
    <prefix> + tokens 0..L-2; each later block predicts the next L tokens (fewer at the end) reading the
    L tokens that end just before its last token."""
    tokens = tokenizer.encode(text)
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    total, predicted = 0.0, 0
    while predicted < len(tokens):
        count = min(max_length, len(tokens) - predicted)
        end = predicted + count
        inputs = [prefix, *tokens[: count - 1]] if predicted == 0 else tokens[end - max_length - 1 : end - 1]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([inputs])).logits[0, len(inputs) - count :]
        targets = torch.tensor(tokens[predicted:end])
        total += F.cross_entropy(logits.double(), targets, reduction="sum").item()
        predicted = end
    return total


@pytest.mark.parametrize(("text", "max_length"), [(MIXED_TEXT * 5, 16), (MIXED_TEXT * 5, None), ("a", 4)])
def test_lm_eval_convention_reproduces_lm_evals_rolling_loglikelihood(tiny_gpt2, tokenizer, text, max_length):
    result = bits_per_byte(tiny_gpt2, tokenizer, text, context=max_length, batch_size=3, convention="lm-eval")
    expected = lm_eval_rolling_nats(tiny_gpt2, tokenizer, text, max_length or 128)
    assert result.num_bytes == len(text.encode("utf-8"))
    assert result.nats == pytest.approx(expected, rel=1e-9)
    # lm-eval's bits_per_byte: -(sum of log-likelihoods) / (sum of UTF-8 bytes) / ln 2.
    assert result.bits_per_byte == pytest.approx(expected / len(text.encode("utf-8")) / math.log(2), abs=1e-9)


def test_lm_eval_convention_also_scores_the_special_tokens(tokenizer):
    # <BoS> (after the <BoS> prefix) and <eos> are predicted too, over the same byte count.
    text = load_text("en", "heldout")[:300]
    num_bytes = len(text.encode("utf-8"))
    result = bits_per_byte(Uniform(), tokenizer, text, context=64, convention="lm-eval")
    assert result.num_bytes == num_bytes
    assert result.bits_per_byte == pytest.approx(
        math.log2(VOCAB_SIZE) * (num_bytes + 2) / num_bytes, rel=1e-12
    )


def test_lm_eval_convention_arguments(tiny_gpt2, tokenizer):
    with pytest.raises(ValueError, match="convention='lm_eval'"):
        bits_per_byte(tiny_gpt2, tokenizer, "abc", convention="lm_eval")
    with pytest.raises(ValueError, match="stride=4 must be None"):
        bits_per_byte(tiny_gpt2, tokenizer, "abc", context=8, stride=4, convention="lm-eval")
    with pytest.raises(ValueError, match="context=129 exceeds the model's 128 positions"):
        bits_per_byte(tiny_gpt2, tokenizer, "abc", context=129, convention="lm-eval")
    with pytest.raises(ValueError, match="text=''"):
        bits_per_byte(tiny_gpt2, tokenizer, "", convention="lm-eval")
    with pytest.raises(ValueError, match="names no positions limit"):
        bits_per_byte(Uniform(), tokenizer, "abc", convention="lm-eval")
