"""Keeps benchmarks/bench_hidden_decoding.py from rotting: `--quick` runs end to end in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_hidden_decoding.py"


def test_quick_run_prints_every_table_and_consistent_figures(tmp_path):
    figures_path = tmp_path / "figures.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--json", str(figures_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout
    assert "exactness: n=1 HD logits equal the source's" in printed
    for title in ("[training step:", "[KV cache after", "[decode:", "[profile:", "[decode profile:"):
        assert printed.count(title) == 1, title
    assert "target: 1-in-4 at n=4 <= 4.6x the n=1 step:" in printed
    assert "target: 1-in-4 at n=4, batch 1, >= 0.85x the source's tokens/s: met at T=" in printed
    figures = json.loads(figures_path.read_text())

    train = figures["train"]
    assert [(row["layout"], row["streams"]) for row in train] == [
        (layout, streams) for layout in ("all-full", "1-in-4") for streams in (1, 2, 4, 8)
    ]
    assert all(row["step_ms"] > 0 for row in train)
    assert all(row["ratio"] == 1.0 for row in train if row["streams"] == 1)
    # The operation count: all-full attention grows n², the 1-in-4 layout less, both at least n.
    by_key = {(row["layout"], row["streams"]): row["estimate"] for row in train}
    for streams in (2, 4, 8):
        assert by_key[("all-full", streams)] > by_key[("1-in-4", streams)] > streams - 1

    # KV bytes are exact counts: every layout with per-stream KV stores n entries per token per layer,
    # the shared variant one per token in its intra layers.
    kv = figures["kv"]
    assert {row["layout"] for row in kv} == {"all-full", "1-in-4", "all-intra", "1-in-4 shared"}
    for row in kv:
        assert row["ratio"] == pytest.approx(row["expected"], rel=1e-9)
        if row["layout"] != "1-in-4 shared":
            assert row["ratio"] == pytest.approx(row["streams"], rel=1e-9)
    assert [row["ratio"] for row in kv if row["layout"] == "1-in-4 shared"] == pytest.approx(
        [1.0, 1.25, 1.75, 2.75]
    )

    decode = figures["decode"]
    assert [(row["layout"], row["streams"], row["batch"], row["context"]) for row in decode] == [
        ("1-in-4", 4, batch, context) for batch in (1, 4) for context in (8, 16)
    ]
    assert all(row["rate"] > 0 and row["source_rate"] > 0 and row["ratio"] > 0 for row in decode)
    assert all(row["ratio"] == pytest.approx(row["rate"] / row["source_rate"]) for row in decode)

    decode_profile = figures["decode_profile"]
    assert [(row["model"], row["context"]) for row in decode_profile] == [
        (model, context) for context in (8, 16) for model in ("source", "1-in-4 n=4")
    ]
    assert all(row["matmul"] > 0 and row["attention"] > 0 for row in decode_profile)

    profile = figures["profile"]
    assert [row["streams"] for row in profile] == [1, 2, 4, 8]
    assert all(row["attention"] > 0 and row["matmul"] > 0 for row in profile)


def test_bad_flags_exit_with_a_message():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--parts", "train,bogus"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "--parts has ['bogus']" in result.stderr
