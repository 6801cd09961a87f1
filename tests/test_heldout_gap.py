"""benchmarks/heldout_gap.py: a sweep run's gap split into what it read, what it did not, and other
documents. A model that memorised the windows it read scores them far below the unread ones; the held-out
figure is the runners' own."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy
import pytest
import torch

from tests.test_reproduce_corpus import BENCHMARKS, mini_corpus, windows_of

sys.path.insert(0, str(BENCHMARKS))

import corpus_data
import heldout_gap
import reproduce_hidden_decoding


def test_each_window_is_labelled_with_its_documents_cell():
    lengths, context = [40, 9, 24, 33], 8
    data = dict(
        windows=windows_of(lengths, context),
        document_offsets=numpy.concatenate([[0], numpy.cumsum(lengths)]),
        document_cells=["en/prose", "ja/prose", "zh/classical", "en/technical"],
    )
    picked = numpy.arange(len(data["windows"]))
    expected = ["en/prose"] * 5 + ["ja/prose"] + ["zh/classical"] * 3 + ["en/technical"] * 4
    assert corpus_data.window_cells(data, picked) == expected
    assert corpus_data.window_cells(data, picked[::-1]) == expected[::-1]


def test_spread_windows_give_every_document_its_share():
    """Four en/prose documents of 40 tokens and one zh/prose of 200 (ids = flat positions): 4 windows of 8
    for en/prose come one from each document, where the first-documents cut takes them all from the
    first; a cell asked for more windows than it has gets them all; a cell not asked for, none."""
    import datasets

    lengths = [40, 40, 40, 40, 200, 16]
    cells = [("en", "prose")] * 4 + [("zh", "prose"), ("ja", "prose")]
    start, rows = 0, []
    for length in lengths:
        rows.append(list(range(start, start + length)))
        start += length
    split = datasets.Dataset.from_dict(
        dict(input_ids=rows, language=[c[0] for c in cells], kind=[c[1] for c in cells])
    )
    chosen = corpus_data.spread_windows(split, {"en/prose": 32, "zh/prose": 1000}, 8)
    en = [int(ids[0]) for cell, ids in chosen if cell == "en/prose"]
    assert [first // 40 for first in en] == [0, 1, 2, 3]
    assert all(len(ids) == 8 and int(ids[-1]) == int(ids[0]) + 7 for _, ids in chosen)
    assert sum(cell == "zh/prose" for cell, _ in chosen) == 25 and "ja/prose" not in {c for c, _ in chosen}
    first = corpus_data.heldout_documents(split, {"en/prose": 32})
    assert [int(ids[0]) // 40 for _, ids in first] == [0]


def memorised_model(corpus: Path, args: list[str], steps: int) -> Path:
    """A tiny Llama trained `steps` times on the windows a run of `args` read (the runners' first batch
    of `--read-windows` windows of `--order-seed`'s order), saved beside the corpus."""
    from transformers import LlamaConfig, LlamaForCausalLM

    options = heldout_gap.parse_args([*args, "--model", "-"])
    data = corpus_data.load_corpus(options)
    batch = corpus_data.WindowBatches(data["windows"], options.order_seed, 0, 1, options.read_windows)[0]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=data["vocab_size"], hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)  # fmt: skip
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(corpus.parent / "model")
    return corpus.parent / "model"


def test_memorised_windows_score_below_unread_ones_and_the_heldout_figure_is_the_runners(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_CONCEPT_CACHE", str(tmp_path / "cache"))
    corpus = mini_corpus(tmp_path / "corpus")
    args = ["--corpus", str(corpus), "--context", "32", "--order-seed", "3", "--read-windows", "48",
            "--heldout-tokens", "256"]  # fmt: skip
    model_path = memorised_model(corpus, args, steps=80)
    record = heldout_gap.main(
        [*args, "--model", str(model_path), "--json", str(tmp_path / "gap.json"), "--by-collection", "prose"]
    )
    figures = record["splits"]
    assert list(figures) == list(heldout_gap.SPLITS)
    # Per collection (the mini corpus's ids fold to one per split and language), every split scored.
    assert set(record["collections"]) == {"train", "validation", "held_out"}
    assert set(record["collections"]["held_out"]) == {
        f"mini:held_out:{lang}:N" for lang in ("en", "ja", "zh")
    }
    # Random words: the unread windows can only be guessed from letter statistics, the read ones recalled.
    assert figures["read"]["loss"] < figures["unread"]["loss"] - 1.0, figures
    # The same cells, with as many windows each, in every split.
    assert figures["read"]["tokens"] == figures["unread"]["tokens"]
    for split in heldout_gap.SPLITS:
        assert set(figures[split]["cells"]) == set(figures["held-out"]["cells"]), split
    from transformers import AutoModelForCausalLM

    options = heldout_gap.parse_args([*args, "--model", str(model_path)])
    data = corpus_data.load_corpus(options)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    expected = reproduce_hidden_decoding.evaluate(model, data["heldout"], 32)
    assert figures["held-out"]["loss"] == pytest.approx(expected, rel=1e-6)
    assert (tmp_path / "gap.json").is_file()


def test_a_collection_is_the_document_name_with_its_digits_folded():
    assert heldout_gap.collection_of("chinese-poetry/json/poet.song.12000.json") == "poet.song.N.json"
    assert heldout_gap.collection_of("yuanqu.json") == "yuanqu.json"


def test_a_run_that_read_more_than_the_split_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_CONCEPT_CACHE", str(tmp_path / "cache"))
    corpus = mini_corpus(tmp_path / "corpus")
    args = ["--corpus", str(corpus), "--context", "32", "--order-seed", "0", "--read-windows", "100000"]
    options = heldout_gap.parse_args([*args, "--model", "-"])
    with pytest.raises(SystemExit, match="--read-windows 100000: more than the"):
        heldout_gap.train_samples(corpus_data.load_corpus(options), options)
