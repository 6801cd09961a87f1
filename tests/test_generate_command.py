"""`hf-concept generate`: the CLI's text equals `tokenizer.decode(model.generate(...))` of the same checkpoint
loaded as a user would, for every family; it streams token by token; sampling follows `--seed`; the summary
reports the cache that generate used; user errors exit 2 with one line.

Checkpoints are tiny random models (tests/conformance/families.py configs) saved with a byte-level BPE
tokenizer trained here on a few lines, so the texts are real subword pieces, not ids.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer, set_seed

from hf_concept.cli import main
from hf_concept.modeling.forward_only_cache import cache_num_bytes
from hf_concept.modeling.transformers_compat import output_cache
from tests.conformance.families import FAMILIES

SPECS = {spec.name: spec for spec in FAMILIES}
# 256 byte symbols + 3 specials + merges.
VOCAB_SIZE = 320
TRAINING_LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "A concept groups a few tokens; a stream expands one token.",
    "if a < b && c > d: print('x & y')",
    "Un café au lait, s'il vous plaît. Naïve façade, déjà vu.",
    "The model reads the text and writes the next token.",
]
PROMPT = "The quick brown"
MAX_NEW_TOKENS = 12
SUMMARY = re.compile(
    r"(\d+) new tokens in [\d.]+ s \(([\d.]+) tokens/s, prefill included\); cache: (\w+), ([\d,]+) bytes"
)


def bpe_tokenizer():
    """A byte-level BPE (GPT-2 style) tokenizer with <pad>=0, <s>=1, </s>=2, as the tiny configs expect."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(TRAINING_LINES, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def save_checkpoint(folder: Path, family: str, with_tokenizer: bool = True, **overrides) -> Path:
    """A tiny random checkpoint of `family` (a FAMILIES name) saved with its remote code (and tokenizer)."""
    spec = SPECS[family]
    torch.manual_seed(0)
    config = spec.make_config(**{"vocab_size": VOCAB_SIZE, **overrides})
    spec.model_class()(config).save_pretrained(folder)
    if with_tokenizer:
        bpe_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("generate")
    names = ("conceptmoe-first", "hidden-decoding", "dlcm", "plain")
    return {name: save_checkpoint(root / name, name) for name in names}


def reference(checkpoint: Path, prompt: str, seed: int | None = None, **kwargs):
    """(new text, generate output) of the checkpoint loaded with the Auto classes, as a user would."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=True)
    # LSLM's byte tokenizer builds its own generation prompt (no <eos> at the end).
    encode = getattr(tokenizer, "encode_prompt", tokenizer)
    inputs = encode(prompt, return_tensors="pt")
    kwargs = {"max_new_tokens": MAX_NEW_TOKENS, "pad_token_id": 0, "return_dict_in_generate": True, **kwargs}
    if seed is not None:
        set_seed(seed)
    with torch.no_grad():
        output = model.generate(**inputs, **kwargs)
    new_ids = output.sequences[0, inputs.input_ids.shape[1] :]
    return tokenizer.decode(new_ids, skip_special_tokens=True), output


def generate_cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["generate", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    ("family", "cache_class"),
    [
        ("conceptmoe-first", "ConceptCache"),
        ("hidden-decoding", "StreamCache"),
        ("dlcm", "ConceptCache"),
        ("plain", "DynamicCache"),
    ],
)
def test_cli_text_equals_greedy_generate_and_summary_reports_the_cache(
    capsys, checkpoints, family, cache_class
):
    checkpoint = checkpoints[family]
    code, out, err = generate_cli(capsys, checkpoint, PROMPT, "--max-new-tokens", MAX_NEW_TOKENS)
    expected, output = reference(checkpoint, PROMPT, do_sample=False)
    assert code == 0, err
    assert expected.strip(), "the tiny model generated nothing; pick another prompt"
    assert out == expected + "\n"
    summary = SUMMARY.search(err)
    assert summary is not None, err
    new_tokens = output.sequences.shape[1] - len(
        AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=True)(PROMPT).input_ids
    )
    assert int(summary.group(1)) == new_tokens
    assert summary.group(3) == cache_class == type(output_cache(output)).__name__
    assert int(summary.group(4).replace(",", "")) == cache_num_bytes(output_cache(output)) > 0


def test_lslm_generates_from_its_byte_prompt(capsys, tmp_path):
    from hf_concept.modeling.configuration_lslm import LSLMConfig
    from hf_concept.modeling.modeling_lslm import LSLMForCausalLM
    from hf_concept.modeling.tokenization_lslm import ByteTokenizer
    from tests.test_lslm_model import TINY

    torch.manual_seed(0)
    LSLMForCausalLM(LSLMConfig(**TINY)).save_pretrained(tmp_path)
    ByteTokenizer().save_pretrained(tmp_path)
    code, out, err = generate_cli(capsys, tmp_path, "héllo", "--max-new-tokens", MAX_NEW_TOKENS)
    expected, output = reference(tmp_path, "héllo", do_sample=False)
    assert code == 0, err
    assert output.sequences.shape[1] > 1 + len("héllo".encode())
    assert out == expected + "\n"
    summary = SUMMARY.search(err)
    assert summary is not None, err
    assert summary.group(3) == type(output_cache(output)).__name__


def test_streams_token_by_token_unless_no_stream(capsys, checkpoints, monkeypatch):
    calls: list[str] = []
    original = TextStreamer.on_finalized_text

    def record(self, text: str, stream_end: bool = False) -> None:
        calls.append(text)
        original(self, text, stream_end)

    monkeypatch.setattr(TextStreamer, "on_finalized_text", record)
    checkpoint = checkpoints["conceptmoe-first"]
    code, streamed, _ = generate_cli(capsys, checkpoint, PROMPT, "--max-new-tokens", MAX_NEW_TOKENS)
    assert code == 0
    # One call per new token (the prompt is skipped) and one at the end.
    assert len(calls) == MAX_NEW_TOKENS + 1
    calls.clear()
    code, printed, _ = generate_cli(
        capsys, checkpoint, PROMPT, "--max-new-tokens", MAX_NEW_TOKENS, "--no-stream"
    )
    assert code == 0 and calls == []
    assert printed == streamed


def test_sampling_follows_the_seed_and_beams_match_generate(capsys, checkpoints):
    checkpoint = checkpoints["hidden-decoding"]
    flags = ["--max-new-tokens", MAX_NEW_TOKENS, "--do-sample", "--top-k", "20", "--temperature", "1.5"]
    first = generate_cli(capsys, checkpoint, PROMPT, *flags, "--seed", "7")
    again = generate_cli(capsys, checkpoint, PROMPT, *flags, "--seed", "7")
    other = generate_cli(capsys, checkpoint, PROMPT, *flags, "--seed", "8")
    assert first[1] == again[1] != other[1]
    expected, _ = reference(checkpoint, PROMPT, seed=7, do_sample=True, top_k=20, temperature=1.5)
    assert first[1] == expected + "\n"
    code, beams, err = generate_cli(capsys, checkpoint, PROMPT, "--max-new-tokens", "6", "--num-beams", "3")
    expected, _ = reference(checkpoint, PROMPT, max_new_tokens=6, num_beams=3, do_sample=False)
    assert code == 0, err
    assert beams == expected + "\n"


def test_checkpoint_without_tokenizer_asks_for_one(capsys, checkpoints, tmp_path):
    bare = save_checkpoint(tmp_path / "bare", "conceptmoe-first", with_tokenizer=False)
    code, out, err = generate_cli(capsys, bare, PROMPT)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("hf-concept generate: error: ") and "no tokenizer" in err and "--tokenizer" in err
    tokenizer_folder = checkpoints["conceptmoe-first"]
    code, out, err = generate_cli(
        capsys, bare, PROMPT, "--tokenizer", tokenizer_folder, "--max-new-tokens", MAX_NEW_TOKENS
    )
    assert code == 0, err
    # The same weights (seed 0) with the same tokenizer: the same text as the complete checkpoint.
    assert out == reference(tokenizer_folder, PROMPT, do_sample=False)[0] + "\n"


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (lambda root, ok: [root / "missing", PROMPT], "is not a folder"),
        (lambda root, ok: [root, PROMPT], "config.json' is missing"),
        (lambda root, ok: [ok, PROMPT, "--device", "warp-drive"], "--device='warp-drive'"),
        (lambda root, ok: [ok, PROMPT, "--tokenizer", root], "--tokenizer"),
    ],
)
def test_user_errors_exit_2_with_one_line(capsys, checkpoints, tmp_path, make_args, message):
    code, out, err = generate_cli(capsys, *make_args(tmp_path, checkpoints["plain"]))
    assert code == 2 and out == ""
    assert err.startswith("hf-concept generate: error: ") and len(err.strip().splitlines()) == 1
    assert message in err, err


def test_tokenizer_of_another_vocabulary_is_refused(capsys, tmp_path):
    small = save_checkpoint(tmp_path / "small", "plain", vocab_size=97)
    code, _, err = generate_cli(capsys, small, "café <&>")
    assert code == 2
    assert "vocab_size is 97" in err and "--tokenizer" in err


def test_non_positive_max_new_tokens_is_an_argument_error(capsys, checkpoints):
    with pytest.raises(SystemExit) as raised:
        main(["generate", str(checkpoints["plain"]), PROMPT, "--max-new-tokens", "0"])
    assert raised.value.code == 2
    assert "must be a positive integer" in capsys.readouterr().err
