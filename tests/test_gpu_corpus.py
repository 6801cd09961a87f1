"""benchmarks/gpu_corpus.py: the pack holds the corpus's first windows in the
reproductions' order, nothing half-written; a CPU smoke run trains and scores every family, the converted
Hidden Decoding model reading on after its source's windows; a missing pack is refused by name."""

from __future__ import annotations

import json
import math

import numpy
import pytest

from tests.benchmark_scripts import load_benchmark
from tests.test_reproduce_corpus import mini_corpus


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu_corpus")
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("HF_CONCEPT_CACHE", str(folder / "cache"))
    script = load_benchmark("gpu_corpus")
    corpus = mini_corpus(folder / "corpus")
    argv = ["pack", "--corpus", str(corpus), "--out", str(folder / "pack"), "--context", "32"]
    script.main([*argv, "--tokens", "20000", "--bytes", "20000", "--heldout-tokens", "256"])
    yield script, folder
    monkeypatch.undo()


def test_the_pack_holds_the_first_windows_of_the_reproductions_order(packed):
    script, folder = packed
    pack = script.load_pack(str(folder / "pack"))
    assert not list(folder.glob(".pack.tmp-*"))  # the staging folder was renamed into place
    tokens, data = pack["tokens"], pack["bytes"]
    assert tokens.shape[1] == data.shape[1] == 32 and tokens.shape[0] * 32 <= 20000
    windows = script.corpus_data.load_corpus(
        script.argparse.Namespace(corpus=pack["meta"]["corpus"], context=32, heldout_tokens=256)
    )["windows"]
    numpy.testing.assert_array_equal(tokens[:3], windows.batch(0, 0, 3).numpy())
    assert set(pack["meta"]["heldout_texts"]) == {"en/prose", "ja/prose", "zh/prose"}
    assert {cell for cell, _ in pack["heldout"]} == set(pack["meta"]["heldout_cells"])


def test_a_cpu_smoke_run_trains_and_scores_every_family(packed):
    script, folder = packed
    out = folder / "out"
    script.main(["run", "--pack", str(folder / "pack"), "--out", str(out), "--cpu-smoke"])
    result = json.loads((out / "gpu_corpus.json").read_text())
    records = {record["family"]: record for record in result["families"]}
    assert list(records) == list(script.FAMILIES)
    for family, record in records.items():
        assert "error" not in record, (family, record.get("error"))
        assert record["steps"] >= 1 and math.isfinite(record["heldout"]["all"])
        assert record["tokens"] == record["steps"] * 4 * 32
    # The converted model reads on from where its source stopped.
    assert records["hidden_decoding"]["first_window"] == records["plain"]["steps"] * 4
    assert records["lslm"]["unit"] == "bits per byte" and records["plain"]["unit"] == "nats per token"
    table = (out / "gpu_corpus.md").read_text()
    assert result["device"].startswith("CPU") and table.count("\n| ") == 2 + len(records)
    assert not list(folder.glob(".out.work-*"))  # the source's scratch copy is removed


def test_a_missing_pack_is_refused_by_name(tmp_path):
    script = load_benchmark("gpu_corpus")
    with pytest.raises(SystemExit, match=r"nothing: no meta\.json"):
        script.main(["run", "--pack", str(tmp_path / "nothing"), "--out", str(tmp_path / "o"), "--cpu-smoke"])
