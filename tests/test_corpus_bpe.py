"""The bundled training corpus (hf_concept.data.corpus) and its BPE tokenizer (hf_concept.data.bpe)."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from importlib import resources
from pathlib import Path

import pytest

from hf_concept.data import bpe as bpe_module
from hf_concept.data import load_text
from hf_concept.data.bpe import (
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    bundled_tokenizer,
    tokenizer_folder_name,
    train_bpe,
)
from hf_concept.data.corpus import (
    VALIDATION_FRACTION,
    corpus_documents,
    corpus_files,
    corpus_text,
    validation_offset,
)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "src" / "hf_concept" / "data"
SAMPLES = {
    "en": 'The keeper climbed ninety-one steps. "Boring is when nothing changes," she said.',
    "zh": "每年十月的第二个星期六，全村人一起去摘苹果。",
    "ja": "路線の廃止が検討されたとき、猫の写真を載せた署名を集めた。",
    "python": 'def area(r: float) -> float:\n\treturn 3.14 * r ** 2  # π r²\n\n\nprint(f"{area(2):.2f}")\n',
    "shell": 'for f in *.txt; do\n    wc -l -- "$f" ; done\r\n',
    "odd spacing": "  a  ,  b .\n\n\n  x\t= [ 1 ,2 ]  ",
    "emoji": "tea 🍵 and café ☕, naïve résumé",
}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tokenizer-cache")


@pytest.fixture(scope="module")
def tokenizer(cache_dir):
    return bundled_tokenizer(cache_dir)


def test_every_corpus_file_is_split_at_a_line_into_train_and_validation():
    names = corpus_files()
    assert len(names) >= 8
    train, validation = dict(corpus_documents("train")), dict(corpus_documents("validation"))
    for name in names:
        text = resources.files("hf_concept.data").joinpath("corpus", name).read_text(encoding="utf-8")
        cut = validation_offset(text)
        assert text[cut - 1] == "\n", name
        assert train[f"corpus/{name}"] == text[:cut].strip("\n")
        assert validation[f"corpus/{name}"] == text[cut:].strip("\n")
        share = len(text[cut:].encode()) / len(text.encode())
        assert 0 < share <= VALIDATION_FRACTION, (name, share)


def test_the_language_samples_keep_their_own_heldout_split():
    train, validation = dict(corpus_documents("train")), dict(corpus_documents("validation"))
    for language in ("en", "zh", "ja"):
        assert train[f"{language}.txt"] == load_text(language, "train").strip("\n")
        assert validation[f"{language}.txt"] == load_text(language, "heldout").strip("\n")


def test_no_long_validation_line_appears_in_the_train_split():
    train_lines = set(corpus_text("train").splitlines())
    repeated = [
        line for line in corpus_text("validation").splitlines() if len(line) > 50 and line in train_lines
    ]
    assert repeated == []


def test_the_corpus_mixes_prose_code_and_cjk_within_the_size_budget():
    train = corpus_text("train")
    size = len(train.encode()) + len(corpus_text("validation").encode())
    assert 200_000 <= size <= 2_000_000
    assert train.count("def ") > 50 and "function " in train and "#include" in train and "SELECT" in train
    assert len(re.findall(r"[\u4e00-\u9fff]", train)) > 5_000
    assert len(re.findall(r"[\u3040-\u30ff]", train)) > 2_000
    assert len(re.findall(r"\b(?:the|and|of)\b", train)) > 2_000


def test_an_unknown_split_is_refused_by_name():
    with pytest.raises(ValueError, match="split='test'"):
        corpus_text("test")


def _glob_matches(path: str, pattern: str) -> bool:
    """setuptools' package-data glob: `*` stays within one folder (fnmatch alone would cross `/`)."""
    parts, pattern_parts = path.split("/"), pattern.split("/")
    return len(parts) == len(pattern_parts) and all(map(fnmatch.fnmatchcase, parts, pattern_parts))


def test_every_corpus_file_ships_as_package_data_and_is_licensed():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    licence = (DATA / "LICENSE.md").read_text()
    readme = (DATA / "README.md").read_text()
    for name in corpus_files():
        assert any(_glob_matches(f"data/corpus/{name}", pattern) for pattern in patterns["hf_concept"]), name
        assert f"`{name}`" in licence and f"`{name}`" in readme, name


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_text_round_trips_exactly(tokenizer, sample):
    text = SAMPLES[sample]
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_special_tokens_and_vocabulary(tokenizer):
    assert len(tokenizer) == VOCAB_SIZE
    assert [tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token] == list(SPECIAL_TOKENS)
    assert [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id] == [0, 1, 2]
    batch = tokenizer(["short", "a much longer line of text"], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, -1] == tokenizer.pad_token_id and batch["attention_mask"][0, -1] == 0
    # Trained on this corpus, common English and Python pieces are single tokens.
    for piece in (" the", " and", " return", " def"):
        assert len(tokenizer(piece, add_special_tokens=False)["input_ids"]) == 1, piece


def test_a_second_call_loads_the_cached_folder_without_training(tokenizer, cache_dir, monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("the tokenizer was trained again")

    monkeypatch.setattr(bpe_module, "train_bpe", no_training)
    again = bundled_tokenizer(cache_dir)
    assert again.get_vocab() == tokenizer.get_vocab()
    assert [path.name for path in cache_dir.iterdir()] == [tokenizer_folder_name()]


def test_the_saved_folder_loads_with_auto_tokenizer(tokenizer, cache_dir, tmp_path):
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(cache_dir / tokenizer_folder_name())
    tokenizer.save_pretrained(tmp_path / "copy")
    copied = AutoTokenizer.from_pretrained(tmp_path / "copy")
    for other in (loaded, copied):
        assert other.get_vocab() == tokenizer.get_vocab()
        assert (other.pad_token_id, other.bos_token_id, other.eos_token_id) == (0, 1, 2)
        for text in SAMPLES.values():
            ids = other(text)["input_ids"]
            assert ids == tokenizer(text)["input_ids"]
            assert other.decode(ids, skip_special_tokens=True) == text


def test_training_is_deterministic_and_the_cache_key_follows_the_settings(cache_dir):
    texts = [text for _, text in corpus_documents("train")]
    saved = json.loads((cache_dir / tokenizer_folder_name() / "tokenizer.json").read_text())
    retrained = json.loads(train_bpe(texts).to_str())
    assert retrained["model"]["vocab"] == saved["model"]["vocab"]
    assert retrained["model"]["merges"] == saved["model"]["merges"]
    assert tokenizer_folder_name() == tokenizer_folder_name()
    assert tokenizer_folder_name(VOCAB_SIZE + 1024) != tokenizer_folder_name()


def test_an_interrupted_save_leaves_nothing_behind(tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    def crash(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", crash)
    with pytest.raises(OSError, match="disk full"):
        bundled_tokenizer(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments_are_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cache_dir="):
        bundled_tokenizer(tmp_path / "file")
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_bpe(["some text"], vocab_size=100)
