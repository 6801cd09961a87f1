"""`--corpus DIR` of the reproductions (benchmarks/corpus_data.py): training windows are read without
replacement (every window of the train split at most once, in a seed's order; a continued run after its
pretraining's; too many steps refused with the figures), and one `--quick --corpus` run of each of the
ConceptMoE, DLCM and Hidden Decoding scripts on a miniature saved corpus trains and scores on it."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import corpus_data  # noqa: E402

from hf_concept.training.data import load_saved_dataset  # noqa: E402


def windows_of(lengths: list[int], context: int) -> corpus_data.WindowOrder:
    """Documents of `lengths` whose token at flat position p is p: a window's first id is its start."""
    offsets = numpy.concatenate([[0], numpy.cumsum(lengths)])
    return corpus_data.WindowOrder(numpy.arange(offsets[-1]), offsets, context)


def test_every_window_is_read_at_most_once_and_inside_one_document():
    lengths, context = [50, 7, 33, 100, 16], 8
    windows = windows_of(lengths, context)
    assert len(windows) == sum(length // context for length in lengths)
    batches = corpus_data.WindowBatches(windows, 3, 0, len(windows) // 4, 4)
    starts = [int(row[0]) for batch in batches for row in batch]
    assert len(starts) == len(set(starts)) == 4 * (len(windows) // 4)
    ends = numpy.cumsum(lengths)
    for batch in batches:
        for row in batch:
            assert torch.equal(row, torch.arange(row[0], row[0] + context))
            # No window crosses into the next document.
            assert numpy.searchsorted(ends, int(row[0]), side="right") == numpy.searchsorted(
                ends, int(row[-1]), side="right"
            )
    # A seed fixes the order; another seed gives another.
    again = [
        int(row[0]) for batch in corpus_data.WindowBatches(windows, 3, 0, len(batches), 4) for row in batch
    ]
    other = [
        int(row[0]) for batch in corpus_data.WindowBatches(windows, 4, 0, len(batches), 4) for row in batch
    ]
    assert again == starts and other != starts


def test_a_continued_run_reads_the_windows_after_its_pretraining():
    windows = windows_of([400, 300], 10)
    pretraining = corpus_data.WindowBatches(windows, 0, 0, 5, 4)
    continuation = corpus_data.WindowBatches(windows, 0, 5 * 4, 5, 4)
    seen = [int(row[0]) for part in (pretraining, continuation) for batch in part for row in batch]
    assert len(seen) == len(set(seen)) == 40
    # Halves of a run (the progressive arm's phases) are the run's batches, in order.
    whole = corpus_data.WindowBatches(windows, 0, 0, 10, 4)
    halves = [*whole[:5], *whole[5:]]
    assert all(torch.equal(left, right) for left, right in zip(halves, whole, strict=True))
    args = argparse.Namespace(batch_size=4, context=10)
    _, draw = corpus_data.batch_source(dict(windows=windows), args, 1000, order_seed=0, skip_steps=5)
    assert torch.equal(draw(2), continuation[2])


def test_asking_for_more_windows_than_the_split_has_is_refused_with_the_figures(capsys):
    windows = windows_of([64, 64], 16)
    with pytest.raises(corpus_data.CorpusError, match="window 9 of 8 asked"):
        corpus_data.WindowBatches(windows, 0, 0, 3, 3)[2]
    args = argparse.Namespace(batch_size=3, context=16, corpus="mini")
    corpus_data.require_windows(dict(windows=windows), args, 2, "each run")
    with pytest.raises(SystemExit) as exit_:
        corpus_data.require_windows(dict(windows=windows), args, 3, "each run")
    assert exit_.value.code == 2
    message = capsys.readouterr().err
    assert "each run = 3 steps x 3 x 16 tokens = 144 tokens (9 windows)" in message
    assert "has 8 windows of 16 tokens (128 tokens)" in message and message.count("\n") == 1
    # The bundled text has no windows: nothing to check.
    corpus_data.require_windows(dict(rows=[]), args, 10**9, "each run")


def test_the_heldout_sample_follows_the_training_mix_of_cells():
    """The pooled held-out loss is over the cells' training shares (so that the gap compares like with
    like); a cell too small for its share still gets one context of tokens."""
    train = {"zh/classical": 700, "en/prose": 290, "zh/prose": 10}
    assert corpus_data.heldout_limits(train, 1000, 16) == {
        "zh/classical": 700,
        "en/prose": 290,
        "zh/prose": 16,
    }


def mini_corpus(folder: Path, heldout_documents: int = 1) -> Path:
    """A saved DatasetDict as `hf-concept build-corpus` writes it, of pseudo-random words (so that a BPE
    trained on them cannot swallow whole documents): three languages, two kinds, three splits."""
    import datasets

    rng = random.Random(0)
    alphabets = {"en": "abcdefghijklmnopqrstuvwxyz", "zh": "的一是不了人我在有他这中大来上国个到说们",
                 "ja": "あいうえおかきくけこさしすせそたちつてとなにぬねの"}  # fmt: skip
    splits = {}
    for split, count in (("train", 6), ("validation", 1), ("held_out", heldout_documents)):
        rows = dict(text=[], language=[], kind=[], source=[], document=[])
        for language, letters in alphabets.items():
            for index in range(count):
                kind = ("prose", "technical")[index % 2]
                words = ("".join(rng.choice(letters) for _ in range(rng.randint(1, 6))) for _ in range(1500))
                rows["text"].append(" ".join(words))
                rows["language"].append(language)
                rows["kind"].append(kind)
                rows["source"].append("mini")
                rows["document"].append(f"mini:{split}:{language}:{index}")
        splits[split] = datasets.Dataset.from_dict(rows)
    datasets.DatasetDict(splits).save_to_disk(str(folder))
    return folder


def test_the_heldout_sample_spreads_over_a_cells_documents_and_sweeps_record_it(tmp_path):
    """By default a cell's held-out windows come from all its documents (`first`: its first documents
    only, which in a built corpus are a source's first collections); the manifest records the choice,
    except `first`, so that a sweep begun before the flag resumes with `--heldout-sample first`."""
    corpus = mini_corpus(tmp_path / "corpus", heldout_documents=5)
    _, ids = corpus_data.tokenized_splits(corpus, load_saved_dataset(corpus), ("held_out",))
    english = [
        row["input_ids"] for row in ids["held_out"] if (row["language"], row["kind"]) == ("en", "prose")
    ]
    assert len(english) == 3

    def documents_read(sample: str) -> set[int]:
        args = argparse.Namespace(corpus=str(corpus), context=16, heldout_tokens=600, heldout_sample=sample)
        windows = [
            ids[:16].tolist() for cell, ids in corpus_data.load_corpus(args)["heldout"] if cell == "en/prose"
        ]
        return {
            index
            for window in windows
            for index, document in enumerate(english)
            if any(document[start : start + 16] == window for start in range(len(document) - 15))
        }

    assert documents_read("spread") == {0, 1, 2}
    assert documents_read("first") == {0}
    settings = {
        sample: corpus_data.corpus_settings(
            argparse.Namespace(corpus=str(corpus), heldout_tokens=600, heldout_sample=sample)
        )
        for sample in corpus_data.HELDOUT_SAMPLES
    }
    assert settings["spread"]["heldout_sample"] == "spread" and "heldout_sample" not in settings["first"]
    assert corpus_data.HELDOUT_SAMPLES[0] == "spread"


SCRIPTS = {
    "reproduce_dlcm.py": ["--threads", "1"],
    "reproduce_conceptmoe.py": ["--workers", "1"],
    "reproduce_hidden_decoding.py": ["--workers", "1"],
}


@pytest.mark.slow
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_a_quick_corpus_run_trains_and_scores_on_the_saved_corpus(tmp_path, script):
    corpus = mini_corpus(tmp_path / "corpus")
    figures_path = tmp_path / "figures.json"
    command = [sys.executable, str(BENCHMARKS / script), "--quick", *SCRIPTS[script], "--corpus", str(corpus)]
    environment = dict(os.environ, HF_CONCEPT_CACHE=str(tmp_path / "cache"))
    result = subprocess.run(
        [*command, "--json", str(figures_path)], capture_output=True, text=True, timeout=600, env=environment
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"corpus {corpus}: train " in result.stdout and "gap " in result.stdout
    figures = json.loads(figures_path.read_text())
    # Held-out figures come from the held_out split's language/kind cells.
    cells = {"en/prose", "en/technical", "ja/prose", "ja/technical", "zh/prose", "zh/technical"}
    assert set(figures["heldout_tokens"]) <= cells and len(figures["heldout_tokens"]) >= 3
    for run in figures["runs"]:
        gaps = [model["gap"] for model in run.get("models", [run])]
        assert all(math.isfinite(value) for value in gaps), run
    if script == "reproduce_dlcm.py":
        assert set(figures["runs"][0]["heldout"]["loss_by_type"]) == set(figures["heldout_tokens"])
    # The tokenised splits are cached files beside the corpus's tokenizer, read by a later run.
    cached = sorted(path.name for path in (tmp_path / "cache").rglob("*.arrow"))
    assert cached == ["held_out.arrow", "train.arrow"]


def test_byte_ids_and_heldout_texts_of_the_lslm_corpus():
    from hf_concept.modeling.tokenization_lslm import ByteTokenizer

    texts = ["héllo", "猫が"]
    ids = corpus_data.ByteIds()(texts)["input_ids"]
    expected = ByteTokenizer()(texts, add_special_tokens=False)["input_ids"]
    assert [row.tolist() for row in ids] == expected
    import datasets

    split = datasets.Dataset.from_dict(
        dict(text=["ab" * 10, "cd" * 10, "猫" * 10], language=["en", "en", "ja"], kind=["prose"] * 3)
    )
    cut = corpus_data.heldout_texts(split, 25)
    assert cut == {"en/prose": "ab" * 10 + "\n" + "cd" * 2, "ja/prose": "猫" * 8}


def test_the_spread_byte_heldout_takes_pieces_spread_over_all_of_a_cells_text(monkeypatch):
    import datasets

    texts = ["a" * 30, "b" * 30 + "B" * 5, "c" * 30, "猫" * 10, "x" * 3]
    split = datasets.Dataset.from_dict(
        dict(text=texts, language=["en"] * 3 + ["ja", "zh"], kind=["prose"] * 5)
    )
    monkeypatch.setattr(corpus_data, "SPREAD_PIECE_BYTES", 10)
    # Pieces of 10 bytes from each document's start; a remainder is kept when it reaches the context.
    assert corpus_data.document_pieces(texts[1], context=4) == [b"b" * 10] * 3 + [b"B" * 5]
    assert corpus_data.document_pieces(texts[1], context=6) == [b"b" * 10] * 3
    spread = corpus_data.spread_texts(split, 25, context=4)
    # en: 10 pieces of 9.5 bytes on average; 25 bytes take 3, evenly spaced (the first, the fifth, the
    # last): the middle document's second piece, not its start; cut to 25 bytes with the line breaks.
    assert spread["en/prose"] == "a" * 10 + "\n" + "b" * 10 + "\n" + "c" * 3
    # ja: three pieces trimmed to whole characters (a character split between two pieces is dropped);
    # all three, cut to 25 bytes at a character boundary (the last character would end at byte 26).
    assert spread["ja/prose"] == "猫猫猫\n猫猫\n猫猫"
    # zh: its only document is shorter than the context, so it has no train windows and no piece.
    assert "zh/prose" not in spread


@pytest.mark.slow
def test_a_quick_lslm_corpus_run_scores_every_cell_and_prints_the_gap(tmp_path):
    corpus = mini_corpus(tmp_path / "corpus")
    figures_path = tmp_path / "figures.json"
    command = [sys.executable, str(BENCHMARKS / "reproduce_lslm.py"), "--quick", "--corpus", str(corpus)]
    environment = dict(os.environ, HF_CONCEPT_CACHE=str(tmp_path / "cache"))
    result = subprocess.run(
        [*command, "--heldout-bytes", "600", "--json", str(figures_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=environment,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"corpus {corpus}: train " in result.stdout and "gap (held-out - training" in result.stdout
    figures = json.loads(figures_path.read_text())
    cells = {"en/prose", "ja/prose", "zh/prose"}  # the mini corpus's held-out documents
    assert [run["model"] for run in figures["runs"]][-2:] == ["unigram", "bigram"]
    for run in figures["runs"]:
        # The count references train nothing, so they have no training loss to compare with.
        trained = run["model"] not in ("unigram", "bigram")
        assert set(run["bits_per_byte"]) == cells and (not trained or math.isfinite(run["gap"]))
        if run["model"] in ("lslm", "dtp"):
            assert set(run["heldout"]["languages"]) == cells
