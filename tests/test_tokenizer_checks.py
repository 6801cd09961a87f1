"""`generate` and `segment` check the tokenizer, the device and the text before a model runs.

- Another model's tokenizer whose ids happen to fit the embedding (another BPE of fewer tokens, bytes
  into a 3,072-token model, a BPE into LSLM) is refused with one line naming the mismatch, instead of
  garbage with exit 0 or an IndexError; `--skip-tokenizer-check` runs anyway. The checkpoint's own
  tokenizer, and a vocab_size padded past the tokenizer's size, pass.
- Text that is not UTF-8 (bytes of another encoding on the command line), and `--device cuda` on a torch
  build without CUDA, are one line and exit 2 instead of a TypeError or an AssertionError.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_concept.cli import main
from tests.test_generate_command import PROMPT, bpe_tokenizer, save_checkpoint

# What Python makes of the byte 0xFF in a command-line argument (os.fsdecode, surrogateescape).
NOT_UTF8 = b"caf\xff au lait".decode("utf-8", "surrogateescape")


def other_bpe_tokenizer():
    """A byte-level BPE trained on other text: the same special ids as `bpe_tokenizer`, under 300 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(["Zebras graze; quokkas smile.", "Twelve yaks queue quietly."], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from hf_concept.modeling.configuration_lslm import LSLMConfig
    from hf_concept.modeling.modeling_lslm import LSLMForCausalLM
    from hf_concept.modeling.tokenization_lslm import ByteTokenizer
    from tests.test_lslm_model import TINY

    root = tmp_path_factory.mktemp("tokenizer-checks")
    torch.manual_seed(0)
    LSLMForCausalLM(LSLMConfig(**TINY)).save_pretrained(root / "lslm")
    ByteTokenizer().save_pretrained(root / "lslm")
    other_bpe_tokenizer().save_pretrained(root / "other-bpe")
    return {
        "conceptmoe": save_checkpoint(root / "conceptmoe", "conceptmoe-first"),
        "bare-3072": save_checkpoint(root / "bare-3072", "plain", with_tokenizer=False, vocab_size=3072),
        "lslm": root / "lslm",
        "other-bpe": root / "other-bpe",
    }


def cli(capsys, *args: object) -> tuple[int, str, list[str]]:
    capsys.readouterr()
    code = main([str(arg) for arg in args])
    captured = capsys.readouterr()
    # transformers' own "Loading weights" progress bar is not ours.
    lines = [line for line in captured.err.splitlines() if line.strip()]
    return code, captured.out, [line for line in lines if not line.startswith("Loading weights")]


def assert_one_line(code: int, out: str, err: list[str], command: str, *needles: str) -> None:
    assert code == 2 and out == "" and len(err) == 1, (code, out, err)
    assert err[0].startswith(f"hf-concept {command}: error: "), err
    for needle in needles:
        assert needle in err[0], (needle, err[0])


def test_another_bpe_that_fits_the_vocabulary_is_refused_and_the_flag_runs_it(capsys, folders):
    flags = ["--tokenizer", folders["other-bpe"], "--max-new-tokens", "4"]
    code, out, err = cli(capsys, "generate", folders["conceptmoe"], PROMPT, *flags)
    assert_one_line(
        code,
        out,
        err,
        "generate",
        f"--tokenizer '{folders['other-bpe']}' does not belong to checkpoint",
        "own tokenizer.json has 320 tokens, this one ",
        "--skip-tokenizer-check",
    )
    code, _, err = cli(capsys, "generate", folders["conceptmoe"], PROMPT, *flags, "--skip-tokenizer-check")
    assert code == 0, err


def test_byte_ids_into_a_3072_token_model_are_refused(capsys, folders):
    code, out, err = cli(capsys, "generate", folders["bare-3072"], PROMPT, "--tokenizer", folders["lslm"])
    assert_one_line(code, out, err, "generate", "it has 261 tokens and the config's vocab_size is 3072")
    # The checkpoint's own tokenizer folder names its class: bytes are not that BPE.
    code, out, err = cli(capsys, "segment", folders["conceptmoe"], PROMPT, "--tokenizer", folders["lslm"])
    assert_one_line(
        code, out, err, "segment", "names tokenizer_class 'TokenizersBackend', this one is a ByteTokenizer"
    )


def test_a_bpe_into_lslm_is_refused_not_an_index_error(capsys, folders):
    text = "The quick brown fox jumps"
    code, out, err = cli(capsys, "segment", folders["lslm"], text, "--tokenizer", folders["conceptmoe"])
    assert_one_line(
        code,
        out,
        err,
        "segment",
        "it has 320 tokens and the config's vocab_size is 261",
        "segment_start_token_id=3, which the tokenizer does not define",
        "tokenizer_class 'ByteTokenizer'",
    )
    # Past the check, segment_text itself names the id the embedding has no row for.
    flags = ["--tokenizer", folders["conceptmoe"], "--skip-tokenizer-check"]
    code, out, err = cli(capsys, "segment", folders["lslm"], text, *flags)
    assert_one_line(code, out, err, "segment", "vocab_size is 261", "does not belong to this model")


def test_mismatches_and_matches_without_loading_a_model(folders):
    from hf_concept.commands import checks

    bare = folders["bare-3072"]
    tokenizer = bpe_tokenizer()
    config = SimpleNamespace(vocab_size=320, bos_token_id=1, eos_token_id=[7, 2], pad_token_id=0)
    assert checks.tokenizer_mismatches(bare, tokenizer, config, "tok") == []
    # Embedding rows padded past the tokenizer (as many checkpoints do) are not a mismatch.
    assert checks.tokenizer_mismatches(bare, tokenizer, SimpleNamespace(vocab_size=1024), "tok") == []
    config = SimpleNamespace(vocab_size=320, bos_token_id=1, eos_token_id=5, pad_token_id=3)
    assert checks.tokenizer_mismatches(bare, tokenizer, config, "tok") == [
        "its eos_token_id is 2, the config's is 5",
        "its pad_token_id is 0, the config's is 3",
    ]
    with pytest.raises(ValueError, match=r"the tokenizer saved in .* eos_token_id is 2, the config's is 5"):
        checks.check_tokenizer(bare, tokenizer, config, None)


@pytest.mark.parametrize("command", ["segment", "generate"])
def test_text_that_is_not_utf8_is_one_line(capsys, folders, command):
    code, out, err = cli(capsys, command, folders["conceptmoe"], NOT_UTF8)
    what = "TEXT" if command == "segment" else "PROMPT"
    assert_one_line(
        code, out, err, command, f"{what} holds the byte 0xFF, which is not UTF-8, at character 3"
    )
    if command == "segment":
        code, out, err = cli(capsys, command, folders["conceptmoe"], "fine", NOT_UTF8)
        assert_one_line(code, out, err, command, "TEXT 2 holds the byte 0xFF")


def test_segment_text_names_a_lone_surrogate():
    from hf_concept.segmentation import segment_text
    from tests.test_segmentation import tiny_model

    with pytest.raises(ValueError, match=r"text\[3\] is U\+DCFF, a lone surrogate"):
        segment_text(tiny_model("conceptmoe-first"), bpe_tokenizer(), NOT_UTF8)


def test_cuda_on_a_torch_without_cuda_is_one_line(capsys, folders, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = cli(capsys, "generate", folders["conceptmoe"], PROMPT, "--device", "cuda")
    assert_one_line(
        code, out, err, "generate", "--device='cuda': this torch build has no CUDA support", "--device cpu"
    )


def test_a_cuda_index_past_the_last_device_is_refused(monkeypatch):
    from hf_concept.commands import checks

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"--device='cuda:2': only 1 CUDA device\(s\) are visible"):
        checks.resolve_device("cuda:2")
    assert checks.resolve_device("cpu") == torch.device("cpu")
