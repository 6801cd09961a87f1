"""The LSLM byte tokenizer: vocabulary layout, lossless round trips, the surrogate and invalid-byte rules,
special-token handling, left-padded batches, and loading from a saved folder (also in a fresh process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hf_concept.modeling.tokenization_lslm import (
    BYTE_OFFSET,
    EOS_ID,
    PAD_ID,
    SEGMENT_END_ID,
    SEGMENT_START_ID,
    SEQUENCE_START_ID,
    ByteTokenizer,
)

ROUND_TRIP_TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog.",
    "chinese": "潜在分段语言模型逐字节生成文本。",
    "japanese": "吾輩は猫である。名前はまだ無い。カタカナ",
    "emoji_zwj": "family 👩\u200d👩\u200d👧\u200d👦, flag 🇯🇵, skin 👍🏽, astral \U0010ffff",
    "combining_marks": "e\u0301 a\u0308\u0323 Z\u0351\u0352\u0353 Tiê\u0301ng Viê\u0323t",
    "control_chars": "\x00NUL\x01\x1b[0m\x7f\r\n\t\x0b\x0c\u2028\ufeff\ufffd",
    "empty": "",
    "looks_special": "<pad><BoS><eos><bos><nxt> <0x41> <unk> </s>",
}


def byte_ids(text: str) -> list[int]:
    return [BYTE_OFFSET + value for value in text.encode("utf-8")]


@pytest.fixture(scope="module")
def tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


def test_vocabulary_layout(tokenizer):
    assert tokenizer.vocab_size == len(tokenizer) == 261
    vocab = tokenizer.get_vocab()
    assert sorted(vocab.values()) == list(range(261))
    specials = {"<pad>": PAD_ID, "<BoS>": SEQUENCE_START_ID, "<eos>": EOS_ID, "<bos>": SEGMENT_START_ID}
    assert {token: vocab[token] for token in specials} == specials
    assert vocab["<nxt>"] == SEGMENT_END_ID == 4
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert (tokenizer.segment_start_token_id, tokenizer.segment_end_token_id) == (3, 4)
    assert sorted(tokenizer.all_special_ids) == [0, 1, 2, 3, 4]
    assert tokenizer.convert_tokens_to_ids(["<0x00>", "<0x41>", "<0xFF>"]) == [5, 70, 260]
    assert tokenizer.convert_ids_to_tokens([5, 70, 260, 3]) == ["<0x00>", "<0x41>", "<0xFF>", "<bos>"]
    assert tokenizer.tokenize("Aé") == ["<0x41>", "<0xC3>", "<0xA9>"]
    assert tokenizer.padding_side == "left"


@pytest.mark.parametrize("name", sorted(ROUND_TRIP_TEXTS))
def test_round_trip_is_lossless(tokenizer, name):
    text = ROUND_TRIP_TEXTS[name]
    ids = tokenizer(text)["input_ids"]
    assert ids == [SEQUENCE_START_ID, *byte_ids(text), EOS_ID]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(ids) == f"<BoS>{text}<eos>"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.decode_bytes(ids) == text.encode("utf-8")


def test_special_token_text_is_bytes_unless_parsing_is_asked_for(tokenizer):
    text = "a <nxt>b<BoS><bos>"
    assert tokenizer.encode(text, add_special_tokens=False) == byte_ids(text)
    parsed = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=False)
    # Parsed tokens keep the spaces around them (no stripping), and case tells <BoS> from <bos>.
    assert parsed == [*byte_ids("a "), SEGMENT_END_ID, *byte_ids("b"), SEQUENCE_START_ID, SEGMENT_START_ID]
    upper = tokenizer.encode("<NXT>", add_special_tokens=False, split_special_tokens=False)
    assert upper == byte_ids("<NXT>")
    parsing = ByteTokenizer(split_special_tokens=False)
    assert parsing.encode(text, add_special_tokens=False) == parsed
    assert parsing.encode(text, add_special_tokens=False, split_special_tokens=True) == byte_ids(text)


def test_lone_surrogate_raises_naming_the_index(tokenizer):
    with pytest.raises(ValueError, match=r"text\[2\] is the lone surrogate U\+D800"):
        tokenizer("ab\ud800c")
    with pytest.raises(ValueError, match=r"text\[0\] is the lone surrogate U\+DFFF"):
        tokenizer(["fine", "\udfff"], padding=True)
    # The index is into the caller's string even when special tokens are parsed out of it first.
    with pytest.raises(ValueError, match=r"text\[6\] is the lone surrogate U\+DC80"):
        tokenizer("<nxt>x\udc80", split_special_tokens=False)
    # A surrogate pair written as two code units is two lone surrogates to UTF-8, not an emoji.
    with pytest.raises(ValueError, match=r"text\[0\] is the lone surrogate U\+D83D"):
        tokenizer("\ud83d\ude00")


def test_invalid_utf8_decodes_by_the_chosen_error_rule(tokenizer):
    ids = [SEQUENCE_START_ID, *byte_ids("A"), BYTE_OFFSET + 0xFF, BYTE_OFFSET + 0xC3, *byte_ids("B"), EOS_ID]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "A\ufffd\ufffdB"
    assert tokenizer.decode(ids, skip_special_tokens=True, errors="ignore") == "AB"
    assert tokenizer.decode(ids, skip_special_tokens=True, errors="backslashreplace") == "A\\xff\\xc3B"
    with pytest.raises(ValueError, match=r"token_ids\[2:3\] hold the bytes ff"):
        tokenizer.decode(ids, errors="strict")
    with pytest.raises(ValueError, match="errors='nonsense'"):
        tokenizer.decode(ids, errors="nonsense")
    assert tokenizer.decode_bytes(ids) == b"A\xff\xc3B"
    assert tokenizer.decode([[*ids], byte_ids("ok")], skip_special_tokens=True) == ["A\ufffd\ufffdB", "ok"]


def test_skipped_markers_do_not_split_a_character(tokenizer):
    lead, trail = byte_ids("é")
    ids = [SEQUENCE_START_ID, lead, SEGMENT_END_ID, SEGMENT_START_ID, trail, EOS_ID, PAD_ID]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "é"
    assert tokenizer.decode(ids) == "<BoS>\ufffd<nxt><bos>\ufffd<eos><pad>"
    segment = [SEGMENT_START_ID, *byte_ids("ab"), SEGMENT_END_ID]
    assert tokenizer.decode(segment, skip_special_tokens=True) == "ab"


def test_ids_and_tokens_outside_the_vocabulary_raise(tokenizer):
    with pytest.raises(ValueError, match=r"token_ids\[1\]=261 is not in the vocabulary"):
        tokenizer.decode([BYTE_OFFSET, 261])
    with pytest.raises(ValueError, match=r"token_ids\[0\]=-1 is not in the vocabulary"):
        tokenizer.decode(torch.tensor([-1, 7]))
    with pytest.raises(ValueError, match="token 'A' is not in the vocabulary"):
        tokenizer.convert_tokens_to_ids(["A"])
    with pytest.raises(ValueError, match=r"token_ids\[1\]=4 is the special token '<nxt>'"):
        tokenizer.decode_bytes([BYTE_OFFSET, SEGMENT_END_ID], skip_special_tokens=False)


def test_left_padded_batch_with_attention_mask(tokenizer):
    batch = tokenizer(["a", "日", ""], padding=True, return_tensors="pt")
    a, (r1, r2, r3) = BYTE_OFFSET + ord("a"), byte_ids("日")
    expected_ids = [[0, 0, 1, a, 2], [1, r1, r2, r3, 2], [0, 0, 0, 1, 2]]
    assert batch["input_ids"].tolist() == expected_ids
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert set(batch) == {"input_ids", "attention_mask"}
    assert tokenizer.decode(batch["input_ids"], skip_special_tokens=True) == ["a", "日", ""]
    right = tokenizer(["a", "日"], padding=True, padding_side="right")["input_ids"]
    assert right == [[1, a, 2, 0, 0], [1, r1, r2, r3, 2]]


def test_special_tokens_mask_and_truncation_count_the_markers(tokenizer):
    encoded = tokenizer("abc", return_special_tokens_mask=True)
    assert encoded["special_tokens_mask"] == [1, 0, 0, 0, 1]
    assert tokenizer("abcdef", truncation=True, max_length=4)["input_ids"] == [1, *byte_ids("ab"), 2]
    no_eos = ByteTokenizer(append_eos_token=False)
    assert no_eos("abc", return_special_tokens_mask=True)["special_tokens_mask"] == [1, 0, 0, 0]


def test_generation_prompts_have_no_eos(tokenizer):
    assert tokenizer.encode_prompt("ab")["input_ids"] == [1, *byte_ids("ab")]
    single = tokenizer.encode_prompt("ab", return_tensors="pt")
    assert single["input_ids"].tolist() == [[1, *byte_ids("ab")]]
    batch = tokenizer.encode_prompt(["ab", "xyz<nxt>"], return_tensors="pt", split_special_tokens=False)
    assert batch["input_ids"].tolist() == [[0, 0, 1, *byte_ids("ab")], [1, *byte_ids("xyz"), SEGMENT_END_ID]]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert ByteTokenizer(append_eos_token=False)("ab")["input_ids"] == [1, *byte_ids("ab")]


def test_bad_arguments_raise_naming_the_field(tokenizer):
    with pytest.raises(ValueError, match="text_pair is not supported"):
        tokenizer("a", "b")
    with pytest.raises(ValueError, match="append_eos_token='yes'"):
        ByteTokenizer(append_eos_token="yes")
    with pytest.raises(ValueError, match="split_special_tokens=1"):
        ByteTokenizer(split_special_tokens=1)
    with pytest.raises(ValueError, match="bos_token='<s>'"):
        ByteTokenizer(bos_token="<s>")
    with pytest.raises(ValueError, match="extra_special_tokens="):
        ByteTokenizer(extra_special_tokens=["<nxt>", "<bos>"])


def test_save_and_load_keep_layout_and_settings(tmp_path):
    tokenizer = ByteTokenizer(split_special_tokens=False)
    # Settings changed after construction must be what gets saved.
    tokenizer.append_eos_token = False
    tokenizer.padding_side = "right"
    tokenizer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["auto_map"]["AutoTokenizer"][0] == "tokenization_lslm.ByteTokenizer"
    assert (tmp_path / "tokenization_lslm.py").is_file()
    loaded = ByteTokenizer.from_pretrained(tmp_path)
    settings = (loaded.append_eos_token, loaded.padding_side, loaded.split_special_tokens)
    assert settings == (False, "right", False)
    assert loaded.get_vocab() == tokenizer.get_vocab()
    texts = ["x<nxt>", ROUND_TRIP_TEXTS["emoji_zwj"]]
    assert loaded(texts, padding=True)["input_ids"] == tokenizer(texts, padding=True)["input_ids"]


FRESH_PROCESS_TOKENIZER = """
import json, sys
sys.modules["hf_concept"] = None
from transformers import AutoTokenizer
texts = json.loads(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)
batch = tokenizer(texts, padding=True)
print(json.dumps({
    "class": type(tokenizer).__name__,
    "module": type(tokenizer).__module__,
    "input_ids": batch["input_ids"],
    "attention_mask": batch["attention_mask"],
    "decoded": tokenizer.decode(batch["input_ids"], skip_special_tokens=True),
}))
"""


def test_auto_tokenizer_loads_in_a_fresh_process_without_hf_concept(tmp_path):
    tokenizer = ByteTokenizer()
    tokenizer.save_pretrained(tmp_path / "checkpoint")
    (tmp_path / "fresh.py").write_text(FRESH_PROCESS_TOKENIZER)
    texts = [ROUND_TRIP_TEXTS["japanese"], "<nxt>", ROUND_TRIP_TEXTS["control_chars"]]
    environment = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-I", "fresh.py", str(tmp_path / "checkpoint"), json.dumps(texts)],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded["class"] == "ByteTokenizer"
    # The class came from the copied file, not from an installed hf_concept.
    assert loaded["module"].startswith("transformers_modules.")
    expected = tokenizer(texts, padding=True)
    assert loaded["input_ids"] == expected["input_ids"]
    assert loaded["attention_mask"] == expected["attention_mask"]
    assert loaded["decoded"] == texts
