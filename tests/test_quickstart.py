"""The README's per-family quickstart, run as written: its Python blocks are executed and its command lines
are passed to the CLI (train and generate lines get a few extra flags so that they take seconds), in a
folder holding a tiny Llama checkpoint and a small corpus."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from hf_concept.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"
FAMILIES = ("ConceptMoE", "Hidden Decoding", "DLCM", "LSLM")
# Appended to the README's lines (argparse keeps the last value of a repeated flag).
FAST = {
    "train": [
        "--max-steps",
        "2",
        "--per-device-train-batch-size",
        "2",
        "--block-size",
        "32",
        "--save-steps",
        "0",
    ],
    "generate": ["--max-new-tokens", "4", "--no-stream"],
}
CORPUS = "\n\n".join(
    f"The river ran past mill number {index}, and the miller counted {index * 3} sacks of grain."
    for index in range(40)
)


def quickstart_blocks(family: str) -> list[tuple[str, str]]:
    """(language, code) of the fenced blocks of one family's quickstart paragraph, in order."""
    text = README.read_text(encoding="utf-8")
    section = text.split("## Quickstart per family", 1)[1].split("\n## ", 1)[0]
    # What follows the last family (loading from the Hub) needs the network.
    section = section.split("Drop `--dry-run`", 1)[0]
    start = section.index(f"**{family}**")
    following = [section.find(f"**{other}**", start + 1) for other in FAMILIES]
    end = min([position for position in following if position > start] or [len(section)])
    return re.findall(r"```(python|sh)\n(.*?)```", section[start:end], flags=re.S)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A folder with `llama-checkpoint` (tiny Llama + tokenizer) and `corpus.txt`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    backend.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama-checkpoint")
    tokenizer.save_pretrained(tmp_path / "llama-checkpoint")
    (tmp_path / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    # DLCM has no tokenizer of its own: the README lets `train` fall back to the bundled one; here the
    # tiny checkpoint's tokenizer stands in for it so that the test does not train a BPE.
    monkeypatch.setattr("hf_concept.data.bpe.bundled_tokenizer", lambda *args, **kwargs: tokenizer)
    return tmp_path


def shrink(code: str) -> str:
    """The README's configs at test size: same fields, smaller numbers."""
    for field, small in (("hidden_size", 32), ("concept_hidden_size", 48), ("mup_base_width", 16)):
        code = re.sub(rf"\b{field}=\d+", f"{field}={small}", code)
    code = re.sub(r"num_attention_heads=\d+", "num_attention_heads=4", code)
    return code.replace("vocab_size=3072", "vocab_size=300")


@pytest.mark.parametrize("family", FAMILIES)
def test_quickstart_runs_as_written(family, workdir, capsys):
    blocks = quickstart_blocks(family)
    assert any(language == "sh" for language, _ in blocks), f"no commands for {family}"
    for language, code in blocks:
        if language == "python":
            exec(compile(shrink(code), f"README {family}", "exec"), {})
            continue
        for line in code.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if not line.startswith("hf-concept "):
                continue
            argv = shlex.split(line)[1:]
            argv += FAST.get(argv[0], [])
            status = main(argv)
            captured = capsys.readouterr()
            assert status == 0, f"{line}\n{captured.err[-2000:]}"
    # The tuned checkpoint of the family's quickstart loads as anyone would load it.
    from transformers import AutoModelForCausalLM

    output = [argv for argv in _train_lines(blocks)][-1]
    model = AutoModelForCausalLM.from_pretrained(output, trust_remote_code=True)
    assert type(model).__module__.startswith("transformers_modules")


def _train_lines(blocks: list[tuple[str, str]]) -> list[str]:
    """The output folders of the block's `hf-concept train` lines."""
    folders = []
    for language, code in blocks:
        for line in code.splitlines():
            if language == "sh" and line.startswith("hf-concept train"):
                argv = shlex.split(line)
                folders.append(argv[argv.index("--output-dir") + 1])
    return folders
