"""Keeps benchmarks/bench_conceptmoe.py from rotting: its main runs end to end on minuscule sizes."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark


@pytest.mark.parametrize("via", ["memory", "converter"])
def test_benchmark_main_runs_and_reports_every_figure(via, capsys):
    bench = load_benchmark("bench_conceptmoe")
    if via == "converter" and bench.convert_to_conceptmoe is None:
        pytest.fail("hf_concept.conversion.conceptmoe.convert_to_conceptmoe does not import")
    tiny = "--layers 5 --hidden 32 --intermediate 64 --heads 4 --kv-heads 2 --vocab 64 --seq-lens 16,24"
    figures = bench.main(f"{tiny} --decode-tokens 3 --repeats 1 --threads 1 --profile --via {via}".split())
    printed = capsys.readouterr().out
    assert "exactness: fixed R=1" in printed
    assert printed.count("targets (") == 2
    assert set(figures) == {"fixed", "dynamic"}
    for row in figures["fixed"]:
        # Fixed chunking, R = 2: exactly ceil(L / 2) concepts. The cache holds the ideal K/V plus slot and
        # per-row state tensors, which at these minuscule widths are several percent of it.
        assert row["realised"] == pytest.approx(row["length"] / -(-row["length"] // 2))
        assert 0 <= row["deviation"] < 0.2
    for rows in figures.values():
        assert [row["length"] for row in rows] == [16, 24]
        assert all(row["prefill"] > 0 and row["decode"] > 0 and row["kv"] > 0 for row in rows)
        # The cache never holds less than the ideal K/V (its extra is slot and per-row state).
        assert all(row["deviation"] >= 0 for row in rows)
