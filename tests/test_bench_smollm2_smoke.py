"""Keeps benchmarks/bench_smollm2.py from rotting: --quick times every model against its source."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import load_benchmark


@pytest.mark.slow
def test_quick_run_reports_every_model_against_the_source(tmp_path):
    out = tmp_path / "rows.json"
    rows = load_benchmark("bench_smollm2").main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    assert {(row["model"], row["length"]) for row in rows} == {
        (model, length) for model in ("source", "conceptmoe", "hd n=2", "hd n=4") for length in (16, 24)
    }
    for row in rows:
        assert row["prefill_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0 and row["kv_bytes"] > 0
        if row["model"] == "source":
            assert row["kv_bytes_vs_source"] == row["prefill_tokens_per_s_vs_source"] == 1
        if row["model"].startswith("hd"):
            # n streams keep n times the source's keys and values (per-stream K/V, the default).
            assert row["kv_bytes_vs_source"] == pytest.approx(int(row["model"][-1]), rel=0.05)
    assert all(row["tokens_per_concept"] >= 1 for row in rows if row["model"] == "conceptmoe")


def test_lengths_and_counts_are_checked():
    script = load_benchmark("bench_smollm2")
    with pytest.raises(SystemExit):
        script.parse_args(["--source", "x", "--lengths", "0"])
    with pytest.raises(SystemExit):
        script.parse_args([])
