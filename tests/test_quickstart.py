"""The quickstarts, run as written: the README's (convert, train, generate, load) and each family page's
(docs/conceptmoe.md, docs/hidden-decoding.md, docs/dlcm.md, docs/lslm.md), each the "## Quickstart"
section of its page. Their Python blocks are executed and their command lines are passed to the CLI
(train and generate lines get a few extra flags so that they take seconds), in a folder holding a tiny
Llama checkpoint and a small corpus."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from hf_concept.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FAMILIES = ("ConceptMoE", "Hidden Decoding", "DLCM", "LSLM")
# Where each quickstart lives: the README's own, then one per family page.
PAGES = {
    "README": README,
    "ConceptMoE": ROOT / "docs" / "conceptmoe.md",
    "Hidden Decoding": ROOT / "docs" / "hidden-decoding.md",
    "DLCM": ROOT / "docs" / "dlcm.md",
    "LSLM": ROOT / "docs" / "lslm.md",
}
HEADING = "## Quickstart"
# Appended to the quickstarts' lines (argparse keeps the last value of a repeated flag).
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


def quickstart_blocks(name: str) -> list[tuple[str, str]]:
    """(language, code) of the fenced blocks of the "## Quickstart" section of `name`'s page (a family,
    or "README"), in order."""
    text = PAGES[name].read_text(encoding="utf-8")
    marker = f"\n{HEADING}\n"
    assert marker in text, f"{PAGES[name].relative_to(ROOT)} has no '{HEADING}' section"
    section = text.split(marker, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(python|sh)\n(.*?)```", section, flags=re.S)


def subcommands(blocks: list[tuple[str, str]]) -> set[str]:
    """The `hf-concept` subcommands that the blocks' command lines run."""
    return {
        shlex.split(line)[1]
        for language, code in blocks if language == "sh"
        for line in code.replace("\\\n", " ").splitlines() if line.startswith("hf-concept ")
    }  # fmt: skip


def test_the_readme_quickstart_converts_trains_generates_and_loads():
    blocks = quickstart_blocks("README")
    assert {"convert", "train", "generate"} <= subcommands(blocks), blocks
    python = "".join(code for language, code in blocks if language == "python")
    assert "AutoModelForCausalLM.from_pretrained(" in python and "trust_remote_code=True" in python


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_page_has_the_full_quickstart(family):
    """Every family page keeps the steps its quickstart had in the README: train, generate, segment, push
    (and convert for the two families that convert)."""
    expected = {"train", "generate", "segment", "push"}
    if family in ("ConceptMoE", "Hidden Decoding"):
        expected.add("convert")
    assert expected <= subcommands(quickstart_blocks(family)), family


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
    # DLCM has no tokenizer of its own: its quickstart lets `train` fall back to the bundled one; here the
    # tiny checkpoint's tokenizer stands in for it so that the test does not train a BPE.
    monkeypatch.setattr("hf_concept.data.bpe.bundled_tokenizer", lambda *args, **kwargs: tokenizer)
    return tmp_path


def shrink(code: str) -> str:
    """The quickstarts' configs at test size: same fields, smaller numbers."""
    for field, small in (("hidden_size", 32), ("concept_hidden_size", 48), ("mup_base_width", 16)):
        code = re.sub(rf"\b{field}=\d+", f"{field}={small}", code)
    code = re.sub(r"num_attention_heads=\d+", "num_attention_heads=4", code)
    return code.replace("vocab_size=3072", "vocab_size=300")


@pytest.mark.parametrize("family", ["README", *FAMILIES])
def test_quickstart_runs_as_written(family, workdir, capsys):
    blocks = quickstart_blocks(family)
    assert any(language == "sh" for language, _ in blocks), f"no commands for {family}"
    for language, code in blocks:
        if language == "python":
            exec(compile(shrink(code), f"{PAGES[family].name} {family}", "exec"), {})
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
    # The tuned checkpoint of the quickstart loads as anyone would load it.
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
